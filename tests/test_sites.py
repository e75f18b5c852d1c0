"""Which tensors are measured, chosen once (diagnostics.measure.sites): the same sites for the
probe, the watch and diagnose; the head found by what it does (the logits), under any name or
tied to the embedding; a model with no identifiable head has its logits not measured, never an
error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tinylm
from diagnostics import DiagnoseOptions, Watch, diagnose, instrument_points, probe
from diagnostics.jobs import watch as W
from diagnostics.measure import Sites, model_sites

OPTS = DiagnoseOptions(batch_size=2, seq_len=8, batches=1)
V, D = 40, 16


class SelfAttention(nn.Module):
    """Causal attention through F.scaled_dot_product_attention (one head)."""

    def __init__(self, d: int):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, d) each
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), SelfAttention(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Unembed(nn.Module):
    """A head that is not an nn.Linear and has no ``out_features``: logits = h W^T."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return h @ self.weight.T


class Decoder(nn.Module):
    """A decoder that is not tinylm: token and position tables, blocks, a final norm, the head
    registered under ``head`` (``tie``: its weight is the token table; ``width``: its output
    width, V unless given), then a one-wide value head that is not the logits."""

    def __init__(self, head: str | None = "lm_head", tie: bool = False, width: int = V, unembed: bool = False,
                 vocab: int = V, d: int = D, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head_name = head
        if head is not None:
            setattr(self, head, Unembed(self.tok.weight) if unembed else nn.Linear(d, width, bias=False))
            if tie and not unembed:
                getattr(self, head).weight = self.tok.weight
        self.value = nn.Linear(d, 1)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[-1]))
        for b in self.blocks:
            h = b(h)
        h = self.norm(h)
        self.value(h)  # computed, not returned
        if self.head_name is None:  # logits from the table itself, with no module of their own
            return h @ self.tok.weight.T
        return getattr(self, self.head_name)(h)


def tiny(**kw) -> tinylm.TransformerLM:
    cfg = dict(vocab_size=V, context_length=8, d_model=D, num_layers=2, num_heads=2, d_ff=32)
    return tinylm.TransformerLM(tinylm.ModelConfig(**{**cfg, **kw}), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["lm_head", "head", "output", "embed_out", "unembedding"])
@pytest.mark.parametrize("tie", [False, True])
def test_the_head_is_found_by_what_it_does_under_any_name(name, tie):
    s = model_sites(Decoder(head=name, tie=tie))
    assert s.head == name and s.points[name] == "logits"
    assert s.embedding == "tok" and s.embeddings == ("tok", "pos")
    assert s.watch == ("tok", "pos", "blocks.0", "blocks.1", name)
    assert "value" in s.points and s.points["value"] == "linear"  # registered after the head, not V wide


def test_a_tied_head_without_out_features_is_found_by_its_weight():
    s = model_sites(Decoder(head="unembed", unembed=True))
    assert s.head == "unembed" and s.points["unembed"] == "logits" and s.embedding == "tok"


def test_a_linear_inside_the_blocks_is_never_the_head():
    # d = V: every d -> d projection inside the blocks is as wide as the vocabulary
    s = model_sites(Decoder(head="out", vocab=D, width=D))
    assert s.head == "out"
    assert [n for n, k in s.points.items() if k == "logits"] == ["out"]


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True}, {"norm": "post"},
                                {"norm_kind": "layer", "ffn": "gelu", "positions": "learned", "bias": True}])
def test_a_tinylm_model_has_its_plan_sites(kw):
    model = tiny(**kw)
    plan, s = tinylm.plan.build(model.config), model_sites(model)
    assert s.head == plan.head and s.embedding == plan.embedding and s.depth == plan.block_outputs()
    assert s.blocks.names == tuple(b.output for b in plan.blocks)
    assert s.attention == tuple(f"layers.{i}.attn" for i in range(2))
    assert s.points[plan.head] == "logits" and s.watch[0] == plan.embedding and s.watch[-1] == plan.head


def test_hugging_face_heads_embeddings_and_attention():
    transformers = pytest.importorskip("transformers")
    from benchmarks.verdict_zoo import hf

    transformers.logging.set_verbosity_error()
    gpt2, llama = model_sites(hf("gpt2", L=2, V=100)()), model_sites(hf("llama", L=2, V=100)())
    assert gpt2.head == "lm_head" and gpt2.embedding == "transformer.wte"  # tied to wte
    assert gpt2.attention == ("transformer.h.0.attn", "transformer.h.1.attn")
    assert llama.head == "lm_head" and llama.embedding == "model.embed_tokens"
    assert llama.attention == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert gpt2.points["lm_head"] == llama.points["lm_head"] == "logits"


@pytest.mark.parametrize("make", [tiny, lambda: tiny(tie_embeddings=True), lambda: Decoder(head="output"),
                                  lambda: Decoder(head="embed_out", tie=True)], ids=["tiny", "tiny-tied", "output",
                                                                                    "embed_out-tied"])
def test_probe_watch_and_diagnose_measure_the_same_sites(make):
    model = make()
    s = model_sites(model)
    assert instrument_points(model) == dict(s.points)
    assert W.default_sites(model) == list(s.watch) and set(s.watch) <= set(s.points)
    assert W.find_sites(model) == [*s.embeddings, *s.blocks.names, s.head]
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with probe(model) as run:
        F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert run.stats.kinds[s.head] == "logits" and (s.head, "backward") in run.stats.tensors
    watch = Watch(model, every=1)
    with watch.step(0):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    watch.record(loss)
    assert watch.history["sites"] == list(s.watch) and watch.history["kinds"][s.head] == "logits"
    assert watch.history["records"][0]["stats"][s.head]["count"] == 2 * 8 * V
    result = diagnose(model, options=OPTS)
    assert [d.name for d in result.depth] == list(s.depth)
    assert {r.name for r in result.tensors if r.kind == "logits"} == {s.head}


@pytest.mark.parametrize("make", [lambda: Decoder(head=None), lambda: Decoder(head="proj", width=V + 1)],
                         ids=["logits-from-the-table", "no-vocab-wide-linear"])
def test_a_model_with_no_identifiable_head_has_no_logits_measured_and_no_error(make):
    model = make()
    s = model_sites(model)
    assert s.head is None and "logits" not in s.points.values()
    assert s.watch == ("tok", "pos", "blocks.0", "blocks.1") == tuple(W.find_sites(model))
    assert s.depth == ("blocks.input", "blocks.0", "blocks.1")
    result = diagnose(model, options=OPTS)  # the loss is read from the output; no head row
    assert not [r for r in result.tensors if r.kind == "logits"] and len(result.depth) == 3
    assert "no sites" not in Watch(model).describe()


def test_a_module_with_nothing_to_find():
    s = model_sites(nn.ReLU())
    assert s == Sites(embeddings=(), embedding=None, blocks=None, attention=(), head=None, points=s.points,
                      watch=(), depth=())
    assert dict(s.points) == {} and W.find_sites(nn.ReLU()) == [] and W.describe_sites(list(s.watch)).startswith("no")
    s = model_sites(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)))  # no vocabulary: no head
    assert s.head is None and s.embedding is None and set(s.points.values()) == {"linear"}
    with pytest.raises(TypeError):
        s.points["0"] = "logits"  # read-only: a caller takes a copy (instrument_points)


def test_watch_judges_growth_of_a_head_by_kind_not_name():
    """A head named ``output`` (kind "logits") is judged for growth like tinylm's ``lm_head``; a
    branch output of the same history is not (its growth is learning)."""
    from diagnostics.judge.over_time import judged

    assert judged("output", norm="pre", kind="logits")
    assert judged("lm_head", norm="pre")
    assert not judged("output", norm="pre", kind="linear")
    assert not judged("layers.0.attn", norm="pre", kind="attn")


def test_sites_are_found_again_when_the_structure_changes():
    """model_sites keeps a model's sites while its modules, parameters and config stay the same
    objects, and finds them again (as a first look would) after any of them changed."""
    from diagnostics.measure import sites as S
    model = tiny()
    first = model_sites(model)
    assert model_sites(model) is first and first == S._find(model)
    steps = [
        lambda: setattr(model.lm_head, "weight", model.token_embeddings.weight),  # re-tied: a parameter replaced
        lambda: model.layers.append(tinylm.TransformerBlock(D, 2, 32, 8, 10000.0)),  # a module added
        lambda: setattr(model.layers[0], "ffn", nn.Identity()),  # a module replaced
        lambda: setattr(model, "config", model.config.replace(num_layers=3)),  # another config object
    ]
    before = first
    for change in steps:
        change()
        now = model_sites(model)
        assert now is not before and now == S._find(model) and model_sites(model) is now
        before = now
    assert "layers.2" in before.points and not any(n.startswith("layers.0.ffn.") for n in before.points)

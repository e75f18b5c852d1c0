"""The block plan: the model's dataflow as data, built from a :class:`ModelConfig`.

A plan lists what :class:`tinylm.TransformerLM` computes, in order, with the module
names it computes them in and the names of the tensors each step reads and writes:

    token_embeddings [+ position_embeddings -> resid_in] -> block 0 -> ... -> block L-1 -> [ln_final] -> lm_head

(with learned positions the stream block 0 reads is the sum that the Tap ``resid_in``
marks; otherwise it is the token embedding itself) and inside block i (x the residual
point the block reads, ``layers.{i-1}`` or the model's ``input`` for block 0;
h = ``layers.{i}.resid_mid``; z = ``layers.{i}``):

    pre : norm ln1(x); attention(ln1); add x + attn -> h; norm ln2(h); ffn(ln2); add h + ffn -> z
    post: attention(x); add x + attn; norm ln1 -> h; ffn(h); add h + ffn; norm ln2 -> z
    none: attention(x); add x + attn -> h; ffn(h); add h + ffn -> z

Each norm, attention and FFN step also says which function it is (``variant``: the norm kind
"rms" or "layer"; the FFN kind "swiglu", "silu", "gelu", "gelu_tanh" or "relu"; attention
"rope" or "nope") and whether its module adds biases (``bias``: the linears' biases, or
LayerNorm's shift).

A tensor is named by the module whose output it is (the names a probe records: every
module, every :class:`tinylm.Tap`, ``layers.i.resid_mid`` and the block output
``layers.i``). Two names may denote one tensor: a post-norm block's ``ln1`` output *is*
``resid_mid`` and its ``ln2`` output *is* the block output, so such a step writes both
names. A sum no module outputs (the post-norm ``x + attn`` before ``ln1``) is named
``"{a}+{b}"`` after the two tensors it adds; no module has that name.

``tests/test_plan.py`` holds the plan to ``TransformerBlock.forward`` for every config
variant; the theories (``diagnostics.theory``) and the verdicts walk the plan instead of
rebuilding the wiring and the names.

Example::

    p = tinylm.plan.build(config)
    p.residual_points()          # ('token_embeddings', 'layers.0.resid_mid', 'layers.0', ...)
    for block in p.blocks:
        for step in block.steps:
            step.kind, step.module, step.reads, step.writes
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config import ModelConfig
from .errors import ConfigError

__all__ = ["Step", "BlockPlan", "ModelPlan", "Branch", "build", "EMBEDDING", "POSITIONS", "RESID_IN", "HEAD", "FINAL_NORM",
           "block_name", "mid_name", "stream_into", "branch_stream", "block_index", "is_sum", "on_stream"]

#: the kinds of step a block is made of
STEP_KINDS = ("norm", "attention", "ffn", "add")

EMBEDDING = "token_embeddings"
POSITIONS = "position_embeddings"
RESID_IN = "resid_in"
FINAL_NORM = "ln_final"
HEAD = "lm_head"

_BLOCK = re.compile(r"^layers\.(\d+)(?:\.|$)")


def block_name(i: int) -> str:
    """The module name of block i, which is also the name of its output on the residual stream."""
    return f"layers.{i}"


def mid_name(i: int) -> str:
    """The residual point between block i's two sublayers (its ``resid_mid`` Tap)."""
    return f"layers.{i}.resid_mid"


def stream_into(i: int, first: str = EMBEDDING) -> str:
    """The residual point block i reads: ``first`` for block 0 (the embedding output, or
    ``RESID_IN`` with learned positions: ``ModelPlan.input``), else block i-1's output."""
    return first if i == 0 else block_name(i - 1)


def branch_stream(kind: str, i: int, first: str = EMBEDDING) -> str:
    """The residual point block i's branch of ``kind`` ("attn" or "ffn") is added to: the block's
    input for attention, its mid point for the FFN, under every norm placement (equal to
    ``Branch.stream`` of every plan whose ``input`` is ``first``; for code that has names but
    no config)."""
    if kind not in ("attn", "ffn"):
        raise ValueError(f"kind={kind!r}: must be 'attn' or 'ffn'")
    return stream_into(i, first) if kind == "attn" else mid_name(i)


def is_sum(name: str) -> bool:
    """Whether ``name`` is a residual sum no module outputs (a post-norm block's ``"{a}+{b}"``)."""
    return "+" in name


def on_stream(name: str) -> bool:
    """Whether ``name`` is a residual point of a tinylm model (the embedding output, the sum of
    token and position embeddings, a block's mid point or a block's output), read from the name alone."""
    i = block_index(name)
    return name in (EMBEDDING, RESID_IN) or (i is not None and name in (block_name(i), mid_name(i)))


def block_index(name: str) -> int | None:
    """i for a name ``layers.i`` or ``layers.i.*``, else None."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Step:
    """One operation of a block.

    kind: "norm" (RMSNorm), "attention" (the attention branch), "ffn" (the FFN branch) or
    "add" (a residual add). module: the module that computes it (the norm, the branch, the
    ``resid_mid`` Tap or the block for an add that no module but the block computes).
    reads: the tensors it reads (an add: the stream, then the branch). writes: the names of
    the one tensor it writes, the module's own output first, then any residual point that is
    the same tensor. branch: "attn" or "ffn", the branch this step belongs to (its norm, the
    branch, its add). variant: which function a norm, attention or FFN step is (norm: "rms" or
    "layer"; attention: "rope" or "nope"; ffn: "swiglu", "silu", "gelu", "gelu_tanh" or
    "relu"; "" for an add). bias: whether the step's module adds learned biases.
    An attention step also states its key/value heads: ``kv_heads`` (H_kv; H for multi-head
    attention, fewer with grouped queries: each K/V head serves H / H_kv query heads),
    ``kv_width`` (H_kv d_k, the output width of k_proj and v_proj) and ``window`` (the
    sliding window W, query i reads key j iff 0 <= i - j < W; None: every j <= i); 0, 0 and
    None for the other kinds. ``qk_norm``: the norm an attention step applies to each head's
    queries and keys inside the attention module ("rms" or "layer", modules ``{attn}.q_norm``
    and ``{attn}.k_norm``), "none" without one and for the other kinds.
    """

    kind: str
    module: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    branch: str
    variant: str = ""
    bias: bool = False
    kv_heads: int = 0
    kv_width: int = 0
    window: int | None = None
    qk_norm: str = "none"

    @property
    def output(self) -> str:
        """The first name of the tensor this step writes."""
        return self.writes[0]


@dataclass(frozen=True)
class Branch:
    """A residual branch: ``name`` (its output, ``layers.i.attn`` or ``layers.i.ffn``), kind
    "attn" or "ffn", its block, ``reads`` (the tensor it reads: a norm output or the stream),
    ``norm`` (the norm feeding it, or None) and ``stream`` (the residual point it is added to)."""

    name: str
    kind: str
    block: int
    reads: str
    norm: str | None
    stream: str


@dataclass(frozen=True)
class BlockPlan:
    """Block i: the residual point it reads (``input``), its ``mid`` point and ``output``, its steps in order."""

    index: int
    input: str
    mid: str
    output: str
    steps: tuple[Step, ...]

    @property
    def name(self) -> str:
        return block_name(self.index)

    def branches(self) -> tuple[Branch, ...]:
        """The attention and FFN branches of this block, in order."""
        out = []
        for s in self.steps:
            if s.kind not in ("attention", "ffn"):
                continue
            norm = next((n.module for n in self.steps if n.kind == "norm" and n.output == s.reads[0]), None)
            add = next(a for a in self.steps if a.kind == "add" and s.output in a.reads)
            out.append(Branch(s.output, s.branch, self.index, s.reads[0], norm, add.reads[0]))
        return tuple(out)


def _block(i: int, norm: str, first: str = EMBEDDING, *, norm_kind: str = "rms", ffn_kind: str = "swiglu",
           attention: str = "rope", bias: bool = False, kv: tuple[int, int, int | None] = (0, 0, None),
           qk_norm: str = "none") -> BlockPlan:
    b, x, h, z = block_name(i), stream_into(i, first), mid_name(i), block_name(i)
    attn, ffn, ln1, ln2 = f"{b}.attn", f"{b}.ffn", f"{b}.ln1", f"{b}.ln2"

    def norm_step(module, reads, writes, branch):  # LayerNorm has a bias iff the model has biases
        return Step("norm", module, reads, writes, branch, norm_kind, bias and norm_kind == "layer")

    def attn_step(reads):
        return Step("attention", attn, reads, (attn,), "attn", attention, bias, *kv, qk_norm=qk_norm)

    def ffn_step(reads):
        return Step("ffn", ffn, reads, (ffn,), "ffn", ffn_kind, bias)

    if norm == "pre":
        steps = (norm_step(ln1, (x,), (ln1,), "attn"),
                 attn_step((ln1,)),
                 Step("add", h, (x, attn), (h,), "attn"),
                 norm_step(ln2, (h,), (ln2,), "ffn"),
                 ffn_step((ln2,)),
                 Step("add", b, (h, ffn), (z,), "ffn"))
    elif norm == "post":
        s1, s2 = f"{x}+{attn}", f"{h}+{ffn}"
        steps = (attn_step((x,)),
                 Step("add", b, (x, attn), (s1,), "attn"),
                 norm_step(ln1, (s1,), (ln1, h), "attn"),
                 ffn_step((h,)),
                 Step("add", b, (h, ffn), (s2,), "ffn"),
                 norm_step(ln2, (s2,), (ln2, z), "ffn"))
    elif norm == "none":
        steps = (attn_step((x,)),
                 Step("add", h, (x, attn), (h,), "attn"),
                 ffn_step((h,)),
                 Step("add", b, (h, ffn), (z,), "ffn"))
    else:
        raise ConfigError(f"norm={norm!r}: must be 'pre', 'post' or 'none'")
    return BlockPlan(i, x, h, z, steps)


@dataclass(frozen=True)
class ModelPlan:
    """The dataflow of a TransformerLM: ``embedding`` [+ ``positions`` -> ``input``] -> ``blocks``
    -> ``final_norm`` (None unless pre-norm) -> ``head``. Built by :func:`build`.

    ``positions`` is the learned position table's module (None unless ``positions="learned"``);
    ``input`` is the residual point block 0 reads: the token embedding's output, or with learned
    positions the Tap ``resid_in`` that marks token + position embeddings.
    """

    config: ModelConfig
    blocks: tuple[BlockPlan, ...]
    embedding: str = EMBEDDING
    final_norm: str | None = None
    head: str = HEAD
    positions: str | None = None
    input: str = EMBEDDING

    @property
    def norm_kind(self) -> str:
        """The kind of every norm of the model, ``final_norm`` included: "rms" or "layer"."""
        return self.config.norm_kind

    def residual_points(self) -> tuple[str, ...]:
        """The names on the residual stream in order: the input of block 0, then per block its
        mid point ``layers.i.resid_mid`` and its output ``layers.i``."""
        return (self.input,) + tuple(n for b in self.blocks for n in (b.mid, b.output))

    def block_outputs(self) -> tuple[str, ...]:
        """The input of block 0 and every block's output: the stream between blocks."""
        return (self.input,) + tuple(b.output for b in self.blocks)

    def branches(self) -> tuple[Branch, ...]:
        """Every attention and FFN branch in order."""
        return tuple(br for b in self.blocks for br in b.branches())

    def branch(self, name: str) -> Branch:
        """The branch whose output is ``name`` (KeyError if none)."""
        for br in self.branches():
            if br.name == name:
                return br
        raise KeyError(f"name={name!r}: not a branch of this plan; branches look like layers.0.attn, layers.0.ffn")

    def head_input(self) -> str:
        """The tensor lm_head reads: ln_final's output, or the last block's."""
        return self.final_norm or self.blocks[-1].output

    def describe(self) -> str:
        """The plan as text, one line per step: ``module: kind(reads) -> writes``."""
        lines = [f"{self.embedding}: embedding(token_ids) -> {self.embedding}"]
        if self.positions:
            lines += [f"{self.positions}: embedding(positions) -> {self.positions}",
                      f"{self.input}: add({self.embedding}, {self.positions}) -> {self.input}"]
        for b in self.blocks:
            for s in b.steps:
                line = f"{s.module}: {s.kind}({', '.join(s.reads)}) -> {' = '.join(s.writes)}"
                lines.append(line + _heads(s, self.config))
        if self.final_norm:
            lines.append(f"{self.final_norm}: norm({self.blocks[-1].output}) -> {self.final_norm}")
        lines.append(f"{self.head}: linear({self.head_input()}) -> logits")
        return "\n".join(lines)

    def producers(self) -> dict[str, Step]:
        """{tensor name: the block step that writes it}, every name a step writes."""
        return {n: s for b in self.blocks for s in b.steps for n in s.writes}

    def modules(self) -> tuple[str, ...]:
        """The named modules the plan runs, in the order they finish (as forward hooks fire): each
        step's module, the ``resid_mid`` Tap where it marks a step's output, then the block itself
        (a residual add no Tap marks is computed in the block's own forward)."""
        out = [self.embedding] + ([self.positions, self.input] if self.positions else [])
        for b in self.blocks:
            for s in b.steps:
                if s.module != b.name:
                    out.append(s.module)
                if b.mid in s.writes and s.module != b.mid:  # post-norm: the Tap marks ln1's output
                    out.append(b.mid)
            out.append(b.name)
        if self.final_norm:
            out.append(self.final_norm)
        return tuple(out + [self.head])


def _heads(step: Step, config: ModelConfig) -> str:
    """What an attention step's line adds where it is not plain multi-head causal attention:
    `` [H_kv=2 of H=8 (k/v width 32), window 4, qk-norm rms]``; "" otherwise."""
    if step.kind != "attention":
        return ""
    parts = [f"H_kv={step.kv_heads} of H={config.num_heads} (k/v width {step.kv_width})"] \
        if step.kv_heads != config.num_heads else []
    parts += [f"window {step.window}"] if step.window is not None else []
    parts += [f"qk-norm {step.qk_norm}"] if step.qk_norm != "none" else []
    return f" [{', '.join(parts)}]" if parts else ""


def build(config: ModelConfig) -> ModelPlan:
    """The plan of ``TransformerLM(config)``: which steps run, in which modules, on which tensors."""
    if not isinstance(config, ModelConfig):
        raise ConfigError(f"config={type(config).__name__}: pass a tinylm.ModelConfig (model.config)")
    learned = config.positions == "learned"
    first = RESID_IN if learned else EMBEDDING
    blocks = tuple(_block(i, config.norm, first, norm_kind=config.norm_kind, ffn_kind=config.ffn,
                          attention="rope" if config.rope else "nope", bias=config.bias,
                          kv=(config.kv_heads, config.kv_heads * config.head_dim, config.sliding_window),
                          qk_norm=config.qk_norm)
                   for i in range(config.num_layers))
    return ModelPlan(config, blocks, final_norm=FINAL_NORM if config.norm == "pre" else None,
                     positions=POSITIONS if learned else None, input=first)

"""The probe: hooks removed whatever happens, the model left exactly as it was, any nn.Module."""

import gc
import time
import weakref

import pytest
import torch
from torch import nn

import tinylm
from diagnostics import OptionsError, ProbeOptions, instrument_points, probe
from diagnostics.measure.moments import Moments

CFG = tinylm.ModelConfig(vocab_size=64, context_length=8, d_model=32, num_layers=2, num_heads=2, d_ff=64)


def model_of(seed=0, **changes):
    return tinylm.TransformerLM(CFG.replace(**changes), generator=torch.Generator().manual_seed(seed))


def tokens(seed=0, b=3, t=9):
    return torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))


def step(model, x):
    loss = tinylm.functional.cross_entropy(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    return loss


def hook_dicts_empty(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
               and not getattr(m, "_backward_pre_hooks", {}) for m in model.modules())


def snapshot(model: nn.Module):
    return (
        {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        {n: b.clone() for n, b in model.named_buffers()},
        {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
        {n: p.requires_grad for n, p in model.named_parameters()},
        {n: m.training for n, m in model.named_modules()},
    )


def same(a, b) -> bool:
    sa, ba, ga, ra, ta = a
    sb, bb, gb, rb, tb = b
    eq = lambda x, y: (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))  # noqa: E731
    return (sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
            and all(torch.equal(ba[k], bb[k]) for k in ba) and all(eq(ga[k], gb[k]) for k in ga)
            and ra == rb and ta == tb)


def test_default_points_of_tinylm():
    pts = instrument_points(model_of())
    assert pts["token_embeddings"] == "embedding" and pts["lm_head"] == "logits"
    for i in range(2):
        assert pts[f"layers.{i}"] == "residual"
        assert pts[f"layers.{i}.attn"] == "attn_branch" and pts[f"layers.{i}.ffn"] == "ffn_branch"
        assert pts[f"layers.{i}.resid_mid"] == "resid_mid" and pts[f"layers.{i}.ffn.hidden"] == "ffn_hidden"
        assert pts[f"layers.{i}.attn.scores"] == "attn_scores" and pts[f"layers.{i}.attn.probs"] == "attn_probs"
        assert pts[f"layers.{i}.attn.heads"] == "attn_heads"
        for leaf in ("ln1", "ln2"):
            assert pts[f"layers.{i}.{leaf}"] == "norm"
        for leaf in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "ffn.w1", "ffn.w2", "ffn.w3"):
            assert pts[f"layers.{i}.{leaf}"] == "linear"
    assert "" not in pts and "layers" not in pts  # neither the root nor containers


def test_measures_forward_and_backward_exactly():
    model, x = model_of(), tokens()
    captured = {}
    h1 = model.layers[1].register_forward_hook(lambda m, i, o: captured.__setitem__("out", o))
    with probe(model) as run:
        out = model(x[:, :-1])
        captured["out"].retain_grad()
        tinylm.functional.cross_entropy(out, x[:, 1:]).backward()
    h1.remove()
    st = run.stats
    ref, gref = captured["out"].detach().double(), captured["out"].grad.double()
    f, b = st.tensors[("layers.1", "forward")], st.tensors[("layers.1", "backward")]
    assert f.count == ref.numel() and abs(f.var - ref.var(correction=0).item()) < 1e-6 * ref.var().item()
    assert abs(b.var - gref.var(correction=0).item()) < 1e-6 * gref.var().item()
    assert st.steps == 1 and st.order[0] == "token_embeddings"
    assert set(st.attention) == {"layers.0.attn.probs", "layers.1.attn.probs"}
    assert set(st.cosine) == {"token_embeddings", "layers.0", "layers.1"}
    assert st.params["layers.0.ffn.w1.weight"].grad_std > 0


def test_model_left_exactly_as_it_was():
    model, x = model_of(), tokens()
    step(model, x)  # existing gradients must survive
    model.train()
    model.layers[0].ln1.weight.requires_grad_(False)
    before = snapshot(model)
    with probe(model) as run:
        assert not model.training  # eval mode inside (dropout off)
        step(model, x)
    assert run.stats.tensors
    assert hook_dicts_empty(model)
    assert same(before, snapshot(model))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_exception_inside_removes_hooks_and_restores(where):
    model, x = model_of(), tokens()
    model.train()
    before = snapshot(model)

    def boom(grad):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with probe(model):
            if where == "forward":
                model(x[:, :-1])
                raise RuntimeError("boom")
            out = model(x[:, :-1])
            out.register_hook(boom)
            tinylm.functional.cross_entropy(out, x[:, 1:]).backward()
    assert hook_dicts_empty(model)
    assert same(before, snapshot(model))


def test_hooks_are_inert_after_exit():
    model, x = model_of(), tokens()
    with probe(model) as run:
        loss = tinylm.functional.cross_entropy(model(x[:, :-1]), x[:, 1:])
    assert ("layers.0", "backward") not in run.stats.tensors
    loss.backward()  # the graph outlived the probe: its tensor hooks must do nothing
    assert ("layers.0", "backward") not in run.stats.tensors


def test_restore_grads_false_keeps_the_new_gradients():
    model, x = model_of(), tokens()
    with probe(model, ProbeOptions(restore_grads=False)):
        step(model, x)
    assert all(p.grad is not None for p in model.parameters())


def test_no_activation_is_kept():
    model, x = model_of(), tokens()
    refs = []
    h = model.layers[0].register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    with probe(model) as run:
        step(model, x)
    h.remove()
    gc.collect()
    assert refs and all(r() is None for r in refs)
    assert run.stats.tensors  # the statistics survive, the tensors do not


def test_two_batches_in_one_probe_equal_two_probes_merged():
    model = model_of()
    x1, x2 = tokens(1), tokens(2)
    with probe(model) as both:
        step(model, x1)
        step(model, x2)
    with probe(model) as r1:
        step(model, x1)
    with probe(model) as r2:
        step(model, x2)
    merged = r1.stats.merge(r2.stats)
    assert both.stats.steps == merged.steps == 2
    assert both.stats.tensors.keys() == merged.tensors.keys()
    for k, m in both.stats.tensors.items():
        n = merged.tensors[k]
        assert m.count == n.count and m.n_zero == n.n_zero and m.max_abs == n.max_abs
        # same Chan update in float64 on both sides: equal to rounding
        assert abs(m.mean - n.mean) <= 1e-12 * max(abs(m.mean), 1e-30) + 1e-300
        assert abs(m.m2 - n.m2) <= 1e-12 * m.m2


def test_any_module_mlp_and_torch_transformer():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    with probe(mlp) as run:
        mlp(x).square().mean().backward()
    st = run.stats
    assert set(st.kinds) == {"0", "2"} and st.kinds["0"] == "linear"
    assert st.tensors[("2", "backward")].count == 20
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False)
    before = snapshot(enc)
    with probe(enc) as run:
        enc(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
    st = run.stats
    assert ("layers.0.linear1", "forward") in st.tensors and ("layers.1.norm2", "backward") in st.tensors
    assert ("layers.0.self_attn", "forward") in st.tensors  # a module with its own parameters, tuple output
    assert hook_dicts_empty(enc) and same(before, snapshot(enc))


def test_unknown_module_name_is_a_clear_error():
    with pytest.raises(OptionsError, match="no such module"):
        with probe(model_of(), ProbeOptions(modules=("layers.9",))):
            pass


def test_moments_of_embedding_match_the_rows_looked_up():
    model, x = model_of(), tokens()
    with probe(model, ProbeOptions(modules=("token_embeddings",))) as run:
        model(x[:, :-1])
    m: Moments = run.stats.tensors[("token_embeddings", "forward")]
    ref = model.token_embeddings.weight.detach()[x[:, :-1]].double()
    assert abs(m.mean - ref.mean().item()) < 1e-12 and abs(m.var - ref.var(correction=0).item()) < 1e-9


@pytest.mark.parametrize("shape", [(300, 40), (40, 300), (64, 64), (1, 17)])
def test_spectral_stats_match_svd(shape):
    """sigma_max and stable rank from the Gram matrix agree with float64 svdvals."""
    from diagnostics.measure.probe import spectral_stats

    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    w[0] *= 4  # a dominant direction, so stable rank is well away from both its bounds
    sv = torch.linalg.svdvals(w.double())
    spec, srank = spectral_stats(w)
    assert spec == pytest.approx(sv[0].item(), rel=1e-5)
    assert srank == pytest.approx((sv.square().sum() / sv[0] ** 2).item(), rel=1e-5)
    assert spectral_stats(torch.zeros(3, 4)) == (0.0, 0.0)


def test_a_tensor_seen_twice_in_a_row_is_reduced_once_and_correctly():
    """The same tensor reaching two hooks back to back is reduced once, by the run's Reducer (a branch is its
    projection's output; backward, the gradient at a block's output and mid-point passes
    unchanged to the branch added there), and that summary is what each name alone measures.
    Negative control: resid_mid and the attention branch are different tensors forward."""
    model, x = model_of(seed=3), tokens(seed=3)
    with probe(model) as run:
        step(model, x)
    both = run.stats.tensors
    same = [("layers.{i}.attn", "layers.{i}.attn.output_proj", "forward"),
            ("layers.{i}.ffn", "layers.{i}.ffn.w2", "forward"),
            ("layers.{i}", "layers.{i}.ffn.w2", "backward"),
            ("layers.{i}.resid_mid", "layers.{i}.attn.output_proj", "backward")]
    for i in range(CFG.num_layers):
        for a, b, d in same:
            a, b = a.format(i=i), b.format(i=i)
            with probe(model, ProbeOptions(modules=(a,))) as alone:
                step(model, x)
            assert both[(a, d)] == both[(b, d)] == alone.stats.tensors[(a, d)], (a, b, d)
        mid, attn = both[(f"layers.{i}.resid_mid", "forward")], both[(f"layers.{i}.attn", "forward")]
        assert mid.var != attn.var


def test_row_mean_squares_are_shared_and_never_stale():
    """A block's output is the residual point, the next norm's input and the cosine's rows: its
    per-token mean square is read once (with its summary, by the run's Reducer) and shared, and each consumer agrees
    with what that name measures alone (there from torch's float32 norms: to 1e-6). Negative
    control: a tensor changed in place is measured again (4x after doubling), not served from
    the memo."""
    model, x = model_of(seed=4), tokens(seed=4)
    with probe(model) as run:
        step(model, x)
    s = run.stats
    for name in ("token_embeddings", "layers.0", "layers.1.ln1", "layers.1.resid_mid", "layers.1.ln2", "ln_final"):
        with probe(model, ProbeOptions(modules=(name,))) as alone:
            step(model, x)
        a = alone.stats
        assert set(a.inv_ms) | set(a.norm_back) | set(a.cosine), name  # the name has a consumer
        for got, want in ((s.inv_ms, a.inv_ms), (s.norm_back, a.norm_back), (s.cosine, a.cosine)):
            for k in want:
                g, w = got[k], want[k]
                assert g.count == w.count and g.mean == pytest.approx(w.mean, rel=1e-6, abs=1e-9), (name, k)
                assert g.var == pytest.approx(w.var, rel=1e-5, abs=1e-12), (name, k)
    t = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    first = run._row_ms(t)
    assert run._row_ms(t) is first
    t.mul_(2.0)
    assert torch.allclose(run._row_ms(t), 4 * first)


def test_each_tensor_is_read_once_per_step(monkeypatch):
    """Counting the reductions the run's Reducer makes: one per tensor, not one per name. Per
    block, forward, the attention branch is output_proj's output and the FFN branch w2's;
    backward, the gradient at the block's output is the FFN branch's (and w2's) and the one at
    its mid-point the attention branch's (and output_proj's): 2 + 4 names per block that read
    nothing new. Norm inputs and norm gradients' row mean squares come from reads already made.
    Reads: the Reducer's (requests reduced at once), the queue's (each tensor once per flush, its
    plain requests and those with rows) and the attention's causal buffers (one read each,
    together in one call).
    Negative control: a Reducer and a queue that remember nothing read once per name and more."""
    from diagnostics.measure import reducer as reducer_module

    real, calls = reducer_module.reduce, []

    def counted(x, **kw):
        calls.append(kw)
        return real(x, **kw)

    from diagnostics.measure import reduction

    real_causal = reduction.causal_parts

    def counted_causal(xs, probs):  # an attention's buffers, read together in one call
        got = real_causal(xs, probs)
        calls.extend({"causal": True} for _ in (xs if got is not None else ()))
        return got

    from diagnostics.measure import pending

    real_queued = pending._reduced

    def counted_queued(xs, versions, loop):  # the queue's plain tensors, each read once at its flush
        calls.extend({} for _ in xs)
        return real_queued(xs, versions, loop)

    from diagnostics.measure import pending_rows

    real_rows = pending_rows.Rows.reduce

    def counted_rows(self):  # the queue's tensors with rows, each read once at its flush
        calls.extend({"rows": True} for _ in self.xs)
        return real_rows(self)

    from diagnostics.measure import attention

    real_loop = attention._loop

    def counted_loop(asked):  # the attention's buffers read at their addresses, in one call
        got = real_loop(asked)
        calls.extend({"causal": True} for _ in (asked if got is not None else ()))
        return got

    monkeypatch.setattr(reducer_module, "reduce", counted)
    monkeypatch.setattr(reduction, "causal_parts", counted_causal)
    monkeypatch.setattr(attention, "_loop", counted_loop)
    monkeypatch.setattr(pending, "_reduced", counted_queued)
    monkeypatch.setattr(pending_rows.Rows, "reduce", counted_rows)
    model, x = model_of(seed=6), tokens(seed=6)
    with probe(model, ProbeOptions(params=False)) as run:
        step(model, x)
    names = len(run.stats.tensors)
    assert len(calls) == names - 6 * CFG.num_layers
    calls.clear()
    monkeypatch.setattr(reducer_module.Reducer, "__call__",
                        lambda self, t, **kw: reducer_module.reduce(t, **kw))  # remembers nothing
    real_add = pending.Pending.add

    def forgetful(self, key, t):  # a queue that does not know what it holds
        self._ids.clear()
        return real_add(self, key, t)
    monkeypatch.setattr(pending.Pending, "add", forgetful)
    real_tensor = pending_rows.Rows.tensor

    def forgetful_rows(self, t, *a):
        self._ids.clear()
        return real_tensor(self, t, *a)
    monkeypatch.setattr(pending_rows.Rows, "tensor", forgetful_rows)
    with probe(model, ProbeOptions(params=False)) as run:
        step(model, x)
    assert len(calls) > names


def test_the_run_times_its_own_work():
    """run.seconds: the wall time inside the probe's hooks and its exit work, positive, below
    the whole probed step, and growing with each step (negative control: a run whose hooks
    never fire, the model not called, records none)."""
    model, x = model_of(seed=5), tokens(seed=5)
    t0 = time.perf_counter()
    with probe(model, ProbeOptions(params=False)) as run:
        step(model, x)
        one = run.seconds
        step(model, x)
    whole = time.perf_counter() - t0
    assert 0.0 < one < run.seconds < whole
    with probe(model, ProbeOptions(params=False)) as idle:
        pass
    assert idle.seconds == 0.0


def test_one_gradient_hook_per_tensor():
    """The attention branch is output_proj's output and a norm's output also carries its
    backward factor: each such tensor gets one gradient hook that measures it for every name
    (each hook is a trip from autograd into Python). Checked on the tensors themselves, and
    the shared measurements equal those of each name probed alone."""
    model, x = model_of(3), tokens(3)
    seen = {}

    def keep(name):
        def hook(module, inputs, output):
            seen[name] = len(output._backward_hooks or {})
        return hook

    with probe(model) as run:
        # registered after the probe's own hooks, so they see what the probe put on the tensors
        hs = [model.get_submodule(n).register_forward_hook(keep(n)) for n in
              ("layers.0.attn", "layers.0.attn.output_proj", "layers.0.ln1", "layers.1.ffn", "layers.1.ffn.w2")]
        step(model, x)
        for h in hs:
            h.remove()
    assert seen == {n: 1 for n in seen} and len(seen) == 5
    t = run.stats.tensors
    for name in ("layers.0.attn", "layers.0.attn.output_proj", "layers.1.ffn", "layers.1.ffn.w2", "layers.0.ln1"):
        model.zero_grad(set_to_none=True)
        with probe(model, ProbeOptions(modules=(name,))) as alone:
            step(model, x)
        a = alone.stats
        assert a.tensors[(name, "backward")].vector() == pytest.approx(t[(name, "backward")].vector(), rel=1e-12)
    assert a.norm_back["layers.0.ln1"].vector() == pytest.approx(run.stats.norm_back["layers.0.ln1"].vector(), rel=1e-12)
    # negative control: the branch and its projection are one tensor, the block output another
    assert t[("layers.0.attn", "backward")].vector() == t[("layers.0.attn.output_proj", "backward")].vector()
    assert t[("layers.0", "backward")].vector() != t[("layers.0.attn", "backward")].vector()

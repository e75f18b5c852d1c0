"""replay: a step run twice, compared site by site; the model left as the first execution left it.

Injections flip one exponent bit of one element (|x| >= the median) of one site's output or of
its gradient during the rerun only. Such a flip changes the element by at least |x|/2, a relative
departure of at least 0.5 * median|x| / ||X|| ~ 3e-3 at these sizes (8192 elements), 1000 times
the float32 tolerance (~3e-6); the sketch estimates a rank-one difference to a relative error of
about 1/sqrt(k) = 18% (k = 32), so a miss would need a chi-square product 1000 times below its mean
(probability far below 1e-6). The default run tests a seeded subset (8 forward, 8 backward, every
one must be found and named); benchmarks/bench_replay.py measures the rates over 200 per model.
"""

import json
import math

import pytest
import torch

from benchmarks.bench_replay import (injected_step, injection_sites, inject_once, step_of, sweep_false_alarms, tiny_model,
                                     tokens)
from diagnostics.errors import OptionsError
from diagnostics.jobs.fingerprint import sketch
from diagnostics.jobs.replay import REPLAY_COLUMNS, ReplayError, ReplayOptions, replay, reduce_site
from diagnostics.judge.replay import ProtocolError, ReplayProtocol, VERDICTS, judge_rows


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def _counted(fn):
    calls = {"n": 0}

    def wrapped():
        calls["n"] += 1
        return fn()
    return wrapped, calls


def test_identical_rerun_and_the_model_left_as_one_plain_step():
    m, twin = tiny_model(0), tiny_model(0)
    x = tokens(3)
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    fn, calls = _counted(step_of(m, x))
    torch.manual_seed(5)
    r = replay(m, fn)
    after_replay = torch.rand(3)
    torch.manual_seed(5)
    loss = step_of(twin, x)()
    after_plain = torch.rand(3)
    assert calls["n"] == 2
    assert r.verdict == "identical" and r.first is None and r.reproduced is True
    assert str(r).startswith("identical")
    assert float(r.loss.detach()) == float(loss.detach()) and r.losses[0] == r.losses[1]
    for (n, p), (_, q) in zip(m.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, params[n]) and torch.equal(p.grad, q.grad), n
    assert torch.equal(after_replay, after_plain)  # the generator as the first execution left it
    assert m.training  # modes as they were
    kinds = {row.kind for row in r.rows}
    assert {"attn_branch", "ffn_branch", "residual", "logits", "loss", "param_grad"} <= kinds


def test_dropout_reruns_with_the_same_masks_and_without_them_departs():
    m = tiny_model(0, dropout=0.2)
    m.train()
    x = tokens(4)
    assert replay(m, step_of(m, x)).verdict == "identical"
    m.zero_grad(set_to_none=True)
    r = replay(m, step_of(m, x), ReplayOptions(rng=False))  # negative control: other masks
    assert r.verdict == "departs" and r.first.direction == "forward" and r.first.block == 0


def test_forward_flips_are_found_at_their_site(model):
    sites = injection_sites(model)
    found = [inject_once(model, sites[i % len(sites)], "forward", 1000 + i) for i in range(8)]
    assert all(hit and named for hit, named, _ in found), [t for h, n, t in found if not (h and n)]


def test_backward_flips_are_found_at_their_site(model):
    sites = injection_sites(model)
    found = [inject_once(model, sites[(5 * i) % len(sites)], "backward", 2000 + i) for i in range(8)]
    assert all(hit and named for hit, named, _ in found), [t for h, n, t in found if not (h and n)]


def test_math_preserving_reruns_are_no_alarm(model):
    assert sweep_false_alarms(model, "identical", 2)["identical"] == 2
    explicit = sweep_false_alarms(model, "explicit-attention", 2)
    assert explicit.get("departs", 0) == 0 and explicit.get("roundoff", 0) >= 1


@pytest.mark.slow
def test_another_thread_count_is_no_alarm(model):
    assert sweep_false_alarms(model, "threads", 3).get("departs", 0) == 0


def test_departs_names_the_first_site_and_says_what_to_do(model):
    site = next(s for s in injection_sites(model) if s.key == "layers.2.ffn")
    model.zero_grad(set_to_none=True)
    r = replay(model, injected_step(model, tokens(9), site, "forward", torch.Generator().manual_seed(1), {}))
    text = str(r)
    assert text.startswith("the rerun departs at layers.2.ffn (forward)") and "suspect the hardware" in text
    assert r.first.block == 2 and r.reproduced is False and "another device" in r.action
    frame = r.to_frame()
    assert list(frame.columns) == list(REPLAY_COLUMNS) and len(frame) == len(r.rows)
    data = json.loads(r.to_json())
    assert data["verdict"] == "departs" and data["first"]["site"] == "layers.2.ffn" and data["schema_version"] == "1"


def test_a_step_that_steps_the_optimizer_is_refused():
    m = tiny_model(0)
    step = step_of(m, tokens(1))

    def fn():  # an optimizer's update inside the step
        loss = step()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(p.grad, alpha=-0.1)
        return loss
    with pytest.raises(ReplayError, match="fn wrote parameter"):
        replay(m, fn)
    with pytest.raises(ReplayError, match="fn="):
        replay(m, 3)
    with pytest.raises(OptionsError, match="model="):
        replay("m", step)
    with pytest.raises(OptionsError, match="k=1"):
        ReplayOptions(k=1)
    with pytest.raises(OptionsError, match="rng="):
        ReplayOptions(rng="yes")


def test_gradients_already_there_accumulate_once_and_buffers_written_once():
    m, twin = tiny_model(0), tiny_model(0)
    for model in (m, twin):
        model.register_buffer("steps", torch.zeros(()))
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
    x = tokens(2)

    def fn_of(model):
        step = step_of(model, x)

        def fn():  # two micro-batches, and a buffer the step writes
            model.steps += 1
            half = step_of(model, x[:2])()
            return step() + half
        return fn
    r = replay(m, fn_of(m))
    fn_of(twin)()
    assert r.verdict == "identical"
    assert any(row.site.endswith("#1") for row in r.rows)  # the second micro-batch measured too
    assert float(m.steps) == 1.0
    for (n, p), (_, q) in zip(m.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_reduce_site_is_the_fingerprint_sketch():
    x = torch.randn(3, 7, 40, generator=torch.Generator().manual_seed(0))
    x[0, 1, 2] = math.inf
    x[2, 0, 0] = math.nan
    (m1, s1), (m2, s2) = sketch(x, 8), reduce_site(x, 8, {})
    assert torch.allclose(m1, m2, rtol=1e-14, atol=0) and torch.equal(s1, s2)


def test_the_protocol_names_its_states_and_refuses_skips():
    p = ReplayProtocol()
    with pytest.raises(ProtocolError):
        p.rerun()
    p.first()
    p.rerun()
    assert p.judge([0.0, 0.5], [0.0, 1e-7], bitwise=False).name == "roundoff"
    assert judge_rows([0.0], [0.0], True)[0].name == "identical"
    assert judge_rows([0.2, 3.0, math.inf], [1e-7, 1e-3, math.inf], False) == (VERDICTS["departs"], 1)
    assert judge_rows([math.nan], [math.nan], False)[1] == 0  # NaN departs
    assert judge_rows([], [], True)[0].name == "not measured"


def test_a_rerun_that_raises_leaves_the_first_execution_and_no_hook():
    m, twin = tiny_model(0), tiny_model(0)
    x = tokens(6)
    step, calls = step_of(m, x), {"n": 0}

    def fn():
        calls["n"] += 1
        loss = step()
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return loss
    with pytest.raises(RuntimeError, match="device lost"):
        replay(m, fn)
    step_of(twin, x)()
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())
    for p, q in zip(m.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attention = torch.nn.Linear(d, d)  # a stand-in branch: the sites are found by name and place
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attention(self.norm(x))
        return x + self.mlp(self.norm(x))


class _UserLM(torch.nn.Module):
    def __init__(self, vocab=64, d=32, n=3):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(n))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.wte(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def test_a_user_module_with_a_block_stack():
    torch.manual_seed(0)
    m = _UserLM()
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    r = replay(m, step_of(m, x))
    assert r.verdict == "identical"
    assert {"embedding", "layers.1.attn", "layers.2.ffn", "layers.2", "final_norm", "logits"} <= {w.site for w in r.rows}
    site = next(s for s in injection_sites(m) if s.key == "layers.1.ffn")
    m.zero_grad(set_to_none=True)
    r = replay(m, injected_step(m, x, site, "backward", torch.Generator().manual_seed(2), {}))
    assert r.verdict == "departs" and (r.first.site, r.first.direction, r.first.block) == ("layers.1.ffn", "backward", 1)


def test_bfloat16_flips_below_the_roundoff_tolerance_are_named_when_exact():
    """In bfloat16 the tolerance (u = 2^-8) exceeds what one element moves the tensor by (~4e-3):
    the default may call such a flip roundoff; exact=True names it at its site (50 of 50 per
    direction in bench_replay.py --dtype bfloat16 --exact; here 3 each)."""
    m = tiny_model(0).to(torch.bfloat16)
    sites = injection_sites(m)
    exact = ReplayOptions(exact=True)
    for direction in ("forward", "backward"):
        found = [inject_once(m, sites[(2 * i + 3) % len(sites)], direction, 500 + i, exact) for i in range(3)]
        assert all(hit and named for hit, named, _ in found), found
    m.zero_grad(set_to_none=True)
    assert replay(m, step_of(m, tokens(0)), exact).verdict == "identical"  # exact is no alarm when nothing differs

"""The instability catalog (benchmarks/instability_runs.py): its structure, and that its runs fail
or stay healthy as it claims, read from its own plain-hook truth traces. The full benchmark
(benchmarks/instability.py, every run with the watch attached) is behind the slow marker."""

import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import instability_runs as IR  # noqa: E402

#: fields a control may differ in from its failing run besides the one setting
_LABELS = {"name", "role", "control_of", "note"}


def test_catalog_has_eight_kinds_each_with_a_control_one_setting_apart():
    fails = [r for r in IR.CATALOG if r.role == "fail"]
    kinds = {r.kind for r in fails}
    assert len(kinds) >= 8, kinds
    for f in fails:
        controls = [r for r in IR.CATALOG if r.control_of == f.name]
        assert len(controls) == 1, f.name
        a, b = asdict(f), asdict(controls[0])
        changed = [k for k in a if k not in _LABELS and a[k] != b[k]]
        assert len(changed) == 1, (f.name, changed)
        assert controls[0].kind == f.kind and controls[0].role == "control"


def test_catalog_covers_models_attention_paths_and_sizes():
    healthy = [r for r in IR.CATALOG if r.role == "healthy"]
    assert len(healthy) >= 20
    assert {(r.model, r.attention) for r in healthy} >= {("tinylm", "sdpa"), ("tinylm", "eager"), ("gpt", "sdpa"),
                                                         ("gpt", "eager")}
    assert {r.norm for r in healthy} >= {"pre", "post", "none"}
    assert len({r.lr for r in healthy}) >= 3 and len({r.layers for r in healthy}) >= 3
    for r in IR.CATALOG:
        assert r.steps <= 600 and 2 <= r.layers <= 6 and 64 <= r.ctx <= 128
    assert len({r.name for r in IR.CATALOG}) == len(IR.CATALOG)


def test_departure_rules():
    assert IR.blowup([5.0, 3.0, 2.0, 3.9, 4.1]) == 4
    assert IR.blowup([5.0, 3.0, float("nan")]) == 2
    assert IR.blowup([5.0, 4.0, 3.0]) is None
    ctrl = [3.0] * 60
    assert IR.onset_vs_control([3.0] * 30 + [3.5] * 30, ctrl) is not None
    assert IR.onset_vs_control([3.2] * 60, ctrl) is None


def _max_logit(rec):
    return max(rec["attn_max_logit"])


def test_overflow_run_departs_after_a_visible_precursor_and_its_control_does_not():
    fail = IR.train(IR.by_name("fp16_overflow/fail"))
    dep = fail["departure"]
    assert dep is not None and dep >= 60 and not math.isfinite(fail["losses"][dep])
    early = [r for r in fail["records"] if r["step"] <= dep - 20]
    # the residual stream is already past the fp16 headroom (65504 / 8) 20+ steps before it overflows
    assert max(max(r["act_max"]) for r in early) > 65504 / 8
    # and the attention logits grew >= 5x from step 0 (the same high LR)
    assert _max_logit(early[-1]) >= 5 * _max_logit(early[0])
    ctrl = IR.train(IR.replace(IR.by_name("fp16_overflow/control"), steps=len(fail["losses"])))
    assert ctrl["departure"] is None
    assert all(math.isfinite(v) for v in ctrl["losses"])


def test_attention_logits_grow_in_the_failing_run_and_not_in_its_control():
    fail = IR.train(IR.replace(IR.by_name("attn_logit_growth/tinylm-sdpa/fail"), steps=61))
    ctrl = IR.train(IR.replace(IR.by_name("attn_logit_growth/tinylm-sdpa/control"), steps=61))
    f, c = fail["records"], ctrl["records"]
    assert [r["step"] for r in f] == list(range(0, 61, 10))
    assert _max_logit(f[-1]) >= 5 * _max_logit(f[0]) and _max_logit(f[-1]) > 50
    assert _max_logit(c[-1]) < 5 * _max_logit(c[0])
    assert min(f[-1]["attn_entropy_ratio"]) < 0.2 < min(c[-1]["attn_entropy_ratio"])


@pytest.mark.slow
def test_full_benchmark_runs_fail_and_stay_healthy_as_claimed(tmp_path):
    import json

    import instability

    out = tmp_path / "watch.json"
    assert instability.main(["--workers", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for name, res in data["runs"].items():
        if res["run"]["role"] == "fail":
            assert res["departure"] is not None, name
        else:
            assert res["departure"] is None, name


def _watched(name: str, steps: int) -> list:
    """The watch's alerts over the first ``steps`` steps of a catalog run (watch at its defaults,
    every 10 steps, given the optimizer), as the benchmark attaches it."""
    from diagnostics import Watch

    seen = []

    def factory(model, opt):
        return Watch(model, every=IR.EVERY, optimizer=opt)

    def on_record(t, model, report):
        seen.extend(report.alerts)

    IR.train(IR.replace(IR.by_name(name), steps=steps), truth=False, watch_factory=factory, on_record=on_record)
    return seen


def test_the_watch_warns_of_attention_logit_growth_early_and_not_on_its_control():
    """The failing run departs at step 90 (its loss 10% above the control's): the watch names the
    attention 20+ steps before; its control (LR 3e-3) hears nothing (the negative control)."""
    alerts = _watched("attn_logit_growth/tinylm-sdpa/fail", 61)
    first = min(a.step for a in alerts)
    assert first <= 90 - 20
    assert {"attention_logits", "exploding"} <= {a.signal for a in alerts}
    assert all("qk-norm" in a.fix for a in alerts if a.signal == "attention_logits")
    assert all(a.site.endswith("attn.scores") for a in alerts if a.signal == "exploding")
    assert _watched("attn_logit_growth/tinylm-sdpa/control", 61) == []


def test_the_watch_names_an_epsilon_dominated_adam_at_its_first_record():
    alerts = _watched("adam_eps_stall/fail", 11)
    assert [(a.step, a.signal) for a in alerts][:1] == [(0, "adam_epsilon")] and "eps" in alerts[0].fix
    assert _watched("adam_eps_stall/control", 11) == []


def test_heldout_runs_on_a_given_nanogpt_model_file(tmp_path, monkeypatch):
    """``--nanogpt`` builds the NanoGPT runs with the given model.py's ``GPT`` (every position's
    logits, eager attention with nanoGPT's mask buffer), keeps only the runs that class can build
    (pre-LN, tied, final norm) with their controls, and refuses a missing file with exit 2."""
    import instability_heldout as H

    path = tmp_path / "model.py"  # a model.py whose GPT behaves as nanoGPT's does (tests/test_nanogpt.py)
    path.write_text("from tests.test_nanogpt import GPT, GPTConfig  # noqa: F401\n")
    monkeypatch.setenv(H.NANOGPT_ENV, str(path))
    run = H.by_name("healthy/nanogpt-eager-4l")
    model = H.build(run)
    assert isinstance(model, H.NanoGPTModel) and type(model.gpt).__name__ == "GPT"
    assert all(not b.attn.flash and b.attn.bias.shape == (1, 1, run.ctx, run.ctx) for b in model.gpt.transformer.h)
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape[:2] == (2, 5)
    kept = {r.name for r in H.CATALOG if H.nanogpt_builds(r)}
    assert "attn_logit_growth/nanogpt/fail" in kept and "healthy/nanogpt-post-warmup" not in kept
    assert not any("tinylm" in n for n in kept)
    monkeypatch.delenv(H.NANOGPT_ENV)
    assert not isinstance(H.build(run), H.NanoGPTModel)  # negative control: the re-written model without it
    assert H.main(["--nanogpt", str(tmp_path / "missing.py")]) == 2

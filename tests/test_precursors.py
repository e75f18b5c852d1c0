"""The precursors judged over a watch history: each reported once when it has held for
``early_persist`` records, with its value, threshold, cause, fix and what was ruled out;
told apart from the symptoms they resemble (underflow is not vanishing; a float32 run has no
underflow); reaching the loop through ``Watch.record``; forensics written on a spike."""

import json
import math

import pytest
import torch

from diagnostics import Thresholds, Watch
from diagnostics.judge import precursors as P
from tinylm import ModelConfig, TransformerLM


def _history(records, norm="pre", kinds=None, param_dims=None):
    return {"format": "tinylm-watch", "version": 1, "watch_every": 10, "spike_factor": 1.5, "sites": [],
            "norm": norm, "kinds": kinds or {}, "param_dims": param_dims or {},
            "series": {"step": [], "loss": [], "lr": [], "grad_norm": []}, "records": records, "events": []}


def _rec(step, **parts):
    rec = {"step": step, "reason": "interval", "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "stats": {},
           "attention": {}, "update_ratio": {}}
    rec.update(parts)
    return rec


def _attn(logit, entropy=2.0, ceiling=3.0):
    return {"layers.0.attn.probs": {"entropy_mean": entropy, "saturated": 0.0, "max_logit": logit,
                                    "entropy_ceiling": ceiling, "rows": 64}}


def _all(history, **th):
    return P.all_precursor_alerts(history, Thresholds(**th))


def test_attention_logits_reported_once_after_persisting_then_as_a_fail_at_ten_times():
    logits = [5, 60, 80, 120, 200, 700, 900]
    h = _history([_rec(10 * k, attention=_attn(v)) for k, v in enumerate(logits)])
    alerts = _all(h, attn_logit=50.0)
    assert [(a.step, a.severity, a.signal) for a in alerts] == [(30, "warn", "attention_logits"),
                                                                (50, "fail", "attention_logits")]
    a = alerts[0]
    assert a.site == "layers.0.attn.probs" and a.value == 120 and a.threshold == 50 and a.since == 10
    assert a.rising == 3 and "rising for 3 records" in a.message and "qk-norm" in a.fix
    assert "not measured" in a.ruled_out and "log_z" in a.ruled_out  # never called ok when not measured
    assert "attention_entropy" in a.ruled_out.split(";")[0]  # measured and within its threshold


def test_a_signal_that_does_not_persist_is_not_reported_negative_control():
    h = _history([_rec(10 * k, attention=_attn(v)) for k, v in enumerate([5, 60, 80, 10, 60, 70, 9])])
    assert _all(h, attn_logit=50.0) == []
    # the same series judged with persistence 2 is reported twice (re-armed after coming back)
    assert [a.step for a in _all(h, attn_logit=50.0, early_persist=2)] == [20, 50]
    # a value past the fail level (10x the threshold) is reported at once, as a fail
    spike = _history([_rec(10 * k, attention=_attn(v)) for k, v in enumerate([5, 600, 700])])
    assert [(a.step, a.severity) for a in _all(spike, attn_logit=50.0)] == [(10, "fail")]


def test_entropy_collapse_against_the_causal_maximum():
    h = _history([_rec(10 * k, attention=_attn(10.0, entropy=e, ceiling=3.0)) for k, e in
                  enumerate([2.0, 0.08, 0.07, 0.06])])
    alerts = _all(h)
    assert [(a.step, a.signal) for a in alerts] == [(30, "attention_entropy")]
    assert alerts[0].value == pytest.approx(0.02) and alerts[0].threshold == 0.03


def test_log_z_drift_and_adam_epsilon():
    recs = [_rec(10 * k, logits={"logz_mean": -z, "logz_std": 1.0, "logz_absmax": z, "max_logit": 10.0},
                 optimizer={"eps_share": e, "alignment": 0.5, "alignment_min": 0.1})
            for k, (z, e) in enumerate([(5, 0.1), (35, 0.9), (40, 0.95), (50, 0.97)])]
    alerts = _all(_history(recs))
    # a share over every entry needs no persistence: at its first record past the threshold
    assert sorted((a.signal, a.step) for a in alerts) == [("adam_epsilon", 10), ("log_z", 30)]
    assert "z-loss" in next(a for a in alerts if a.signal == "log_z").fix
    assert "eps" in next(a for a in alerts if a.signal == "adam_epsilon").fix


def _grads(zero, dtype):
    stats = {"layers.0": {"count": 10, "fwd_var": 1.0, "grad_var": 1e-9, "grad_zero": zero,
                          "fwd_absmax": 1.0, "fwd_nonfinite": 0.0, "grad_nonfinite": 0.0}}
    return {"stats": stats, "dtypes": {"layers.0": dtype}}


def test_underflow_is_judged_in_low_precision_only():
    fp16 = _history([_rec(10 * k, **_grads(0.6, "float16")) for k in range(3)])
    alerts = _all(fp16)
    assert [(a.signal, a.severity, a.step) for a in alerts] == [("underflow", "fail", 0)]  # 0.6 > (0.01 + 1) / 2
    assert "GradScaler" in alerts[0].fix
    fp32 = _history([_rec(10 * k, **_grads(0.6, "float32")) for k in range(3)])
    assert _all(fp32) == []  # the same zeros in float32 are not underflow (negative control)


def test_a_vanishing_gradient_made_of_zeros_in_float16_is_named_underflow():
    row = {"step": 30, "site": "layers.0", "verdict": "vanishing", "stat": "grad_var", "value": 1e-9,
           "threshold": 1e-5}
    low = P.verdict_alert(_history([]), _rec(30, **_grads(0.4, "float16")), row, Thresholds())
    assert P.verdict_alert(_history([]), _rec(30, **_grads(0.005, "float16")), row, Thresholds()).signal == "vanishing"
    assert low.signal == "underflow" and "40.0%" in low.cause and "GradScaler" in low.fix
    plain = P.verdict_alert(_history([]), _rec(30, **_grads(0.4, "float32")), row, Thresholds())
    assert plain.signal == "zero_gradient" and "cut" in plain.cause and "GradScaler" not in plain.fix
    dense = P.verdict_alert(_history([]), _rec(30, **_grads(0.005, "float32")), row, Thresholds())
    assert dense.signal == "vanishing" and "cut" not in dense.cause  # few zeros: it does vanish
    post = P.verdict_alert(_history([], norm="post"), _rec(30, **_grads(0.0, "float32")), row, Thresholds())
    assert "post-norm" in post.cause and "warm" in post.fix
    scores = dict(row, site="layers.0.attn.scores")  # sharpening attention: judged by the attention signals
    assert P.verdict_alert(_history([]), _rec(30, **_grads(0.0, "float32")), scores, Thresholds()) is None


def test_the_alerts_of_one_record_are_grouped_by_signal():
    from diagnostics.jobs.watch_alerts import grouped

    two = {**_attn(300.0), "layers.1.attn.probs": dict(_attn(400.0)["layers.0.attn.probs"])}
    alerts = _all(_history([_rec(10 * k, attention=two) for k in range(3)]))
    assert len(alerts) == 2 and {a.site for a in alerts} == {"layers.0.attn.probs", "layers.1.attn.probs"}
    [one] = grouped(alerts)
    assert one.site == "layers.0.attn.probs" and "[at 2 sites: layers.0.attn.probs, layers.1.attn.probs]" in one.message
    assert grouped([]) == [] and grouped(alerts[:1]) == alerts[:1]


def test_update_ratios_of_matrices_only():
    dims = {"w": 2, "norm.weight": 1}
    recs = [_rec(10 * k, update_ratio={"w": r, "norm.weight": 5.0}) for k, r in enumerate([0.01, 0.4, 0.5, 0.5])]
    alerts = _all(_history(recs, param_dims=dims))
    assert [(a.signal, a.site, a.step) for a in alerts] == [("update_large", "w", 30)]
    post = _all(_history(recs, norm="post", param_dims=dims))
    assert "post-norm" in post[0].fix


# ----------------------------------------------------------------- through the watch


def _model():
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2,
                                     d_ff=32))


def test_the_loop_hears_a_warning_and_a_spike_writes_forensics(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randint(0, 32, (2, 8))
    watch = Watch(model, every=1, log_dir=str(tmp_path), thresholds=Thresholds(attn_logit=1.0, spike_warmup=2))
    heard = []
    for t in range(6):
        with watch.step(t):
            loss = model(x).logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        report = watch.record(loss * (10.0 if t == 5 else 1.0))
        assert not report  # warnings only: a loop that breaks on a failure goes on
        heard += list(report)
    watch.close()
    assert any(a.signal == "attention_logits" and a.step == 2 for a in heard)  # persisted 3 records
    assert heard[-1].signal == "spike" and heard[-1].step == 5 and "attention_logits" in heard[-1].cause
    assert watch.alerts == heard
    lines = [json.loads(s) for s in (tmp_path / "watch.jsonl").read_text().splitlines()]
    assert {ln["signal"] for ln in lines if ln["type"] == "alert"} >= {"attention_logits", "spike"}
    path = next(ln["path"] for ln in lines if ln["type"] == "forensics" and ln["step"] == 5)
    report = json.loads(open(path).read())
    assert report["step"] == 5 and report["trigger"]["kind"] == "spike"
    assert [r["step"] for r in report["records"]] == [0, 1, 2, 3, 4, 5][-8:]
    assert [s["step"] for s in report["steps"]] == [0, 1, 2, 3, 4]  # the steps logged before it


def test_forensics_keep_a_bounded_window():
    model = _model()
    x = torch.randint(0, 32, (2, 8))
    watch = Watch(model, every=1, forensics=2)
    for t in range(5):
        with watch.step(t):
            model(x).logsumexp(-1).mean().backward()
        watch.record(1.0 if t < 4 else math.nan)
    assert [r["step"] for r in watch.reports[-1]["records"]] == [3, 4]
    assert [s["step"] for s in watch.reports[-1]["steps"]] == [2, 3]  # forensics x every steps
    with pytest.raises(ValueError, match="forensics"):
        Watch(model, forensics=0)


def _series(history, losses):
    history["series"] = {"step": list(range(len(losses))), "loss": list(losses), "lr": [1e-3] * len(losses),
                         "grad_norm": [1.0] * len(losses)}
    return history


def test_a_stall_is_a_flat_loss_beside_its_cause():
    import numpy as np

    rng = np.random.default_rng(0)
    flat = 3.0 + 0.01 * rng.standard_normal(200)
    recs = [_rec(t, optimizer={"eps_share": 0.9, "alignment": 1.0, "alignment_min": 1.0}) for t in range(0, 200, 10)]
    alerts = _all(_series(_history(recs), flat))
    stalls = [a for a in alerts if a.signal == "stall"]
    assert [a.step for a in stalls] == [50]  # half the window logged: reported when it begins, once
    assert "adam_epsilon" in stalls[0].message and "eps" in stalls[0].fix
    # negative controls: the same flat loss without a cause; a falling loss beside the same cause
    calm = [_rec(t, optimizer={"eps_share": 0.1, "alignment": 1.0, "alignment_min": 1.0}) for t in range(0, 200, 10)]
    assert _all(_series(_history(calm), flat)) == []
    falling = 3.0 - 0.002 * np.arange(200) + 0.01 * rng.standard_normal(200)
    assert not [a for a in _all(_series(_history(recs), falling)) if a.signal == "stall"]
    slope, se = P.loss_trend(_series(_history(recs), falling), 199, 100)
    assert abs(slope + 0.002) < 6 * se  # the fitted slope holds the true one


def test_a_framework_callback_logs_each_alert(caplog):
    """The Trainer and Lightning callbacks drive the watch through Steps: their loops have no
    record() to hear alerts, so each goes to the "diagnostics.watch" logger at its severity."""
    import logging

    from diagnostics.integrations._steps import Steps

    model = _model()
    x = torch.randint(0, 32, (2, 8))
    steps = Steps(Watch(model, every=1, thresholds=Thresholds(attn_logit=1.0)))
    with caplog.at_level(logging.WARNING, logger="diagnostics.watch"):
        for t in range(3):
            steps.begin(t)
            model(x).logsumexp(-1).mean().backward()
            steps.before_optimizer()
            steps.end(t, 1.0, 1e-3)
    steps.close()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert caplog.records[0].getMessage().startswith("step 2: attention_logits")


def test_weights_far_from_their_declared_init_are_named_at_step_0():
    """A tinylm model whose matrices were scaled x5 after init: the first record (step 0) names
    it; the same model as built (the negative control) does not, nor does a run resumed later."""
    def first_alerts(scale):
        model = _model()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.dim() == 2 and n.startswith("layers."):
                    p.mul_(scale)
        watch = Watch(model, every=1)
        x = torch.randint(0, 32, (2, 8))
        with watch.step(0):
            model(x).logsumexp(-1).mean().backward()
        return watch.record(1.0).alerts, watch.history["records"][0].get("init")

    alerts, init = first_alerts(5.0)
    assert init["drift"] == pytest.approx(5.0, rel=0.05)
    assert [(a.step, a.signal, a.severity) for a in alerts] == [(0, "init_scale", "warn")]  # 4 < 5 < 4^2
    assert "tinylm.init.apply" in alerts[0].fix
    alerts, init = first_alerts(1.0)
    assert alerts == [] and init["drift"] == pytest.approx(1.0, rel=0.1)


def test_a_long_run_past_its_threshold_is_reported_once_and_judging_looks_back_a_bounded_window():
    recs = [_rec(10 * k, attention=_attn(300.0)) for k in range(3 * P.LOOKBACK)]
    alerts = _all(_history(recs))
    assert [(a.step, a.severity) for a in alerts] == [(20, "warn")]  # not again when the run outgrows the window
    # after 500 calm records, three past the threshold: reported at the third, since the first
    long = _history([_rec(10 * k, attention=_attn(5.0 if k < 500 else 300.0)) for k in range(503)])
    assert [(a.step, a.since) for a in P.precursor_alerts(long, 502)] == [(5020, 5000)]

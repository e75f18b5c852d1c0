"""Precursors judged against the run's own baseline: exact zeros in a float32 gradient cut by a
float16 cast are named at the first record (any dtype, not only fp16 sites); a first Adam step is
judged as what it must be (each entry moves by the learning rate), never failing a nanoGPT-like
run at step 0 nor naming post-norm on a pre-norm model; a maximum growing far past its own early
level and rising is warned of. Each with a negative control. Real runs are tiny (one thread)."""

import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from diagnostics import Thresholds, Watch
from diagnostics.judge import baseline as B
from diagnostics.judge import precursors as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import instability_heldout as H  # noqa: E402


def _train(model, steps, lr, loss_div=1.0, loss_scale=1.0, every=10, sched=None):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    watch = Watch(model, every=every, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    alerts = []
    for t in range(steps):
        x = torch.randint(0, 60, (4, 32), generator=gen)
        with watch.step(t):
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
            (loss / loss_div * loss_scale).backward()
            for p in model.parameters():
                p.grad.mul_(1.0 / loss_scale)
            opt.step()
            opt.zero_grad()
        alerts += list(watch.record(loss.item(), lr=lr))
    watch.close()
    return alerts, watch.history


def _tinylm(cast=None, layers=3):
    import tinylm

    torch.manual_seed(0)
    model = tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=60, context_length=32, d_model=32, num_layers=layers,
                                                    num_heads=2, d_ff=64), generator=torch.Generator().manual_seed(0))
    if cast is not None:
        H.cast_backward(model.layers[cast])
    return model


def test_zeros_from_a_float16_cast_of_a_float32_gradient_are_named_at_the_first_record():
    """The gradient into block 1 rounded through float16, the loss divided as a 4M-token step
    divides it: block 0, its branches and the embedding hold fp32 tensors of fp16-rounded values,
    nearly all exactly zero; the watch names it at step 0 (a fail: past halfway to 1) at those
    sites and nowhere above the cut."""
    torch.set_num_threads(1)
    alerts, history = _train(_tinylm(cast=1), 1, 1e-3, loss_div=2.0 ** 22)
    zeros = [a for a in alerts if a.signal == "zero_gradient"]
    assert zeros and zeros[0].step == 0 and zeros[0].severity == "fail"
    stats = history["records"][0]["stats"]
    cut = ("token_embeddings", "layers.0.attn", "layers.0.resid_mid", "layers.0.ffn", "layers.0")
    assert all(stats[s]["grad_zero"] > 0.9 for s in cut), {s: stats[s]["grad_zero"] for s in cut}
    assert {a.site for a in zeros} <= set(cut) and zeros[0].site == "token_embeddings"
    assert all(f"{s}," in zeros[0].message or f"{s}]" in zeros[0].message for s in cut[1:])  # one alert, 5 sites
    assert "float16" in zeros[0].cause and "cast" in zeros[0].cause and "mask" in zeros[0].cause
    # negative control: the same cast with the loss scaled by 2^16 around it keeps the gradient
    alerts, _ = _train(_tinylm(cast=1), 1, 1e-3, loss_div=2.0 ** 22, loss_scale=2.0 ** 16)
    assert [a for a in alerts if a.signal == "zero_gradient"] == []


def _zrec(step, shares, dtype="float32"):
    stats = {s: {"grad_zero": z, "grad_absmax": 1e-3} for s, z in shares.items()}
    return {"step": step, "reason": "interval", "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "stats": stats,
            "attention": {}, "update_ratio": {}, "dtypes": {s: dtype for s in shares}}


def _hist(records, kinds):
    return {"format": "tinylm-watch", "version": 1, "watch_every": 10, "spike_factor": 1.5, "sites": list(kinds),
            "norm": "pre", "kinds": kinds, "param_dims": {}, "series": {"step": [], "loss": [], "lr": [],
                                                                           "grad_norm": []},
            "records": records, "events": []}


def test_zero_share_judged_against_the_runs_own_baseline():
    kinds = {"emb": "embedding", "layers.0": "residual", "layers.1": "residual", "layers.0.attn.scores": "attn_scores"}
    # a padded batch: every dense site holds the same 30% of zeros, from the first record on (negative control)
    padded = _hist([_zrec(10 * k, {"emb": 0.3, "layers.0": 0.3, "layers.1": 0.3, "layers.0.attn.scores": 0.5})
                    for k in range(4)], kinds)
    assert P.all_precursor_alerts(padded, Thresholds()) == []
    # a branch whose zeros start at step 20 against its own earlier records and the other sites
    late = [{"emb": 0.0, "layers.0": z, "layers.1": 0.0} for z in (0.0, 0.0, 0.05, 0.06, 0.0, 0.3)]
    alerts = P.all_precursor_alerts(_hist([_zrec(10 * k, s) for k, s in enumerate(late)], kinds), Thresholds())
    assert [(a.step, a.severity, a.site) for a in alerts] == [(20, "warn", "layers.0"), (50, "warn", "layers.0")]
    # float16 sites are the absolute underflow rule's, never both
    fp16 = _hist([_zrec(0, {"emb": 0.0, "layers.0": 0.6, "layers.1": 0.0}, dtype="float16")], kinds)
    assert {a.signal for a in P.all_precursor_alerts(fp16, Thresholds())} == {"underflow"}


def test_a_first_adam_step_on_small_init_weights_is_not_a_fail():
    """nanoGPT at LR 3e-2 without warm-up: Adam's first step moves each entry by 0.03, which is
    4.2x the rms of the 0.02 / sqrt(2 L) residual projections (L = 4) by construction. No fail at
    step 0, no post-norm named on this pre-norm model; the first step is judged on the median
    matrix. Negative control: at LR 0.1 the median matrix moves by 5x its size: a fail at step 0."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    alerts, history = _train(H.NanoGPT(60, 32, 32, 4, 2), 1, 3e-2)
    ratios = history["records"][0]["update_ratio"]
    top = max(v for k, v in ratios.items() if k.endswith("c_proj.weight"))
    assert 3.0 < top < 6.0  # what main failed on: ~ lr / (0.02 / sqrt(8)) = 4.24
    assert not [a for a in alerts if a.severity == "fail"], [a.message for a in alerts]
    assert not any("post-norm" in a.message for a in alerts)
    first = [a for a in alerts if a.signal == "first_update"]
    median = statistics.median(v for k, v in ratios.items() if history["param_dims"][k] >= 2)
    assert first and first[0].severity == "warn" and first[0].value == median
    torch.manual_seed(0)
    alerts, _ = _train(H.NanoGPT(60, 32, 32, 4, 2), 1, 1e-1)
    fails = [a for a in alerts if a.severity == "fail"]
    assert [(a.step, a.signal) for a in fails] == [(0, "first_update")] and fails[0].value > 3.0
    # the post-norm cause is named where the model is post-norm, and only there
    post = {"norm": "post", "param_dims": {}, "records": [{"step": 0, "update_ratio": {"w.weight": 5.0}}]}
    post_alerts = P.precursor_alerts(post, 0, Thresholds())
    assert post_alerts and all("post-norm" in a.cause for a in post_alerts)


def test_update_ratios_after_the_first_step_are_judged_per_matrix():
    """Step 0's one large matrix (a small-init one under Adam's sign step) is not judged alone; the
    same matrix past update_high at three records from step 10 on is (the negative control)."""
    recs = [{"step": 10 * k, "update_ratio": {"a": v, "b": 0.01, "c": 0.01}} for k, v in enumerate([9.0, 0.5, 0.5, 0.5])]
    alerts = P.all_precursor_alerts({"norm": None, "param_dims": {"a": 2, "b": 2, "c": 2}, "records": recs},
                                    Thresholds())
    assert [(a.step, a.signal, a.site) for a in alerts] == [(30, "update_large", "a")]  # 3 records past 0.3
    assert "post-norm" not in alerts[0].cause


def _arec(step, logit):
    return {"step": step, "reason": "interval", "stats": {}, "update_ratio": {},
            "attention": {"layers.0.attn.probs": {"max_logit": logit, "entropy_mean": 2.0, "entropy_ceiling": 3.0}}}


def test_attention_logits_growing_fast_are_warned_before_the_absolute_threshold():
    factor, floor, p = B.GROWTH["attention_logits"], B.FLOOR["attention_logits"], B.PERSIST["attention_logits"]
    grow = [2.0, 8.0, 12.0] + [12.0 * (factor * 1.05) ** (j + 1) for j in range(p + 1)]  # 25, 55, 121
    alerts = P.all_precursor_alerts({"records": [_arec(10 * k, v) for k, v in enumerate(grow)]}, Thresholds())
    assert [(a.step, a.signal) for a in alerts][:1] == [(10 * (2 + p), "attention_logits")]
    assert alerts[0].value < Thresholds().attn_logit and "per record" in alerts[0].message
    # negative controls: a healthy run's fastest growth (x1.46 per record above 20), and a fast
    # growth under the floor
    healthy = [2.0, 10.5, 16.6, 30.8, 44.9, 64.6, 94.0]
    assert P.all_precursor_alerts({"records": [_arec(10 * k, v) for k, v in enumerate(healthy)]}, Thresholds()) == []
    small = [0.1, 0.3, 0.9, 2.7, 8.1, floor * 0.99]
    assert P.all_precursor_alerts({"records": [_arec(10 * k, v) for k, v in enumerate(small)]}, Thresholds()) == []


def test_an_update_ratio_jumping_with_the_learning_rate_is_warned_at_once():
    ratios = [0.5, 0.02, 0.03, 0.03, 0.03 * B.GROWTH["update_large"] * 1.1]
    recs = [{"step": 10 * k, "update_ratio": {"a.weight": r}} for k, r in enumerate(ratios)]
    alerts = P.all_precursor_alerts({"records": recs}, Thresholds())
    assert [(a.step, a.signal, a.severity) for a in alerts if a.step > 0] == [(40, "update_large", "warn")]
    # negative control: a linear warm-up doubles the ratio from step 10 to 20, and no more
    warm = [0.01, 0.06, 0.11, 0.16, 0.2]
    recs = [{"step": 10 * k, "update_ratio": {"a.weight": r}} for k, r in enumerate(warm)]
    assert [a for a in P.all_precursor_alerts({"records": recs}, Thresholds()) if a.step > 0] == []


def test_the_held_out_set_is_apart_from_the_tuning_set():
    """Each failing run has one control one setting apart; the kinds the early warnings are scored
    on; its text is other files than the tuning set's; nothing in it names a threshold."""
    import instability_runs as IR

    fails = [r for r in H.CATALOG if r.role == "fail"]
    assert {r.kind for r in fails} >= {"attn_logit_growth", "grad_cast_underflow", "post_norm_no_warmup",
                                       "output_logit_divergence", "adam_eps", "lr_spike"}
    assert {r.model for r in fails} == {"nanogpt", "tinylm"}
    for f in fails:
        (ctrl,) = [r for r in H.CATALOG if r.control_of == f.name]
        a, b = f.to_dict(), ctrl.to_dict()
        changed = [k for k in a if k not in ("name", "role", "control_of", "note") and a[k] != b[k]]
        assert len(changed) == 1, (f.name, changed)
    assert len([r for r in H.CATALOG if r.role == "healthy"]) >= 8
    assert not set(H._FILES) & set(IR._FILES)
    assert "Thresholds" not in Path(H.__file__).read_text().split("def rejudge")[0]

"""The watch: records at its interval, moments equal to direct computation, update ratios,
hooks removed, spike and non-finite alarms naming the layer that moved first, verdicts with
negative controls, exports, and the "during training" panel and plot."""

from __future__ import annotations

import copy
import csv
import io
import json
import math

import numpy as np
import pytest
import torch

import tinylm
from diagnostics import Thresholds
from diagnostics.result import COLUMNS, DTYPES
from diagnostics.integrations import writers
from diagnostics.jobs import history as H
from diagnostics.jobs import watch as W
from diagnostics.judge import over_time as V
from tinylm.train import TrainOptions
from diagnostics.jobs.watch import train_watched as train
from tinylm import functional as F

TH = Thresholds()  # the defaults: the one set of thresholds diagnose reads too
SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)


def small_model(seed: int = 0, **changes) -> tinylm.TransformerLM:
    return tinylm.TransformerLM(tinylm.ModelConfig(**{**SMALL, **changes}), generator=torch.Generator().manual_seed(seed))


def tokens(n: int = 3000) -> np.ndarray:
    return np.resize(np.random.default_rng(0).integers(0, 32, 7), n).astype(np.int64)


def no_hooks(model) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())


# --------------------------------------------------------------------------- recording


def test_records_at_the_interval_with_every_site():
    r = train(small_model(), tokens(), TrainOptions(steps=7, batch_size=2, watch_every=3))
    h = r.history
    assert [rec["step"] for rec in h["records"]] == [0, 3, 6]
    assert h["sites"] == W.default_sites(r.model)
    assert h["sites"][0] == "token_embeddings" and h["sites"][-1] == "lm_head"
    assert "layers.1.attn.scores" in h["sites"] and "layers.1" in h["sites"]
    for rec in h["records"]:
        assert set(rec["stats"]) == set(h["sites"])
        assert set(rec["update_ratio"]) == {n for n, _ in r.model.named_parameters()}
        assert set(rec["attention"]) == {"layers.0.attn.probs", "layers.1.attn.probs"}
    assert len(h["series"]["loss"]) == 7
    assert no_hooks(r.model)


def test_watch_off_records_nothing_but_the_loss():
    r = train(small_model(), tokens(), TrainOptions(steps=3, batch_size=2, watch_every=0))
    assert r.history["records"] == [] and len(r.history["series"]["loss"]) == 3


def test_moments_equal_a_direct_computation():
    model = small_model()
    x = torch.from_numpy(tokens()[:16].reshape(2, 8))
    y = torch.from_numpy(tokens()[1:17].reshape(2, 8))
    w = W.Watch(model, every=1)
    with w.capture():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    w.commit(0, float(loss.detach()), 1e-3, 1.0)
    got = w.history["records"][0]["stats"]
    # direct: the block-1 output and the gradient of the loss with respect to it, with attention
    # on the path it takes under the watch's probe (the fused kernel, as without the probe)
    model.zero_grad(set_to_none=True)
    kept = {}
    h = model.layers[1].register_forward_hook(lambda m, a, out: kept.setdefault("out", out))
    out_loss = F.cross_entropy(model(x), y)
    kept["out"].retain_grad()
    out_loss.backward()
    h.remove()
    act = kept["out"].detach().double()
    grad = kept["out"].grad.double()
    assert got["layers.1"]["count"] == act.numel()
    assert got["layers.1"]["fwd_var"] == pytest.approx(act.var(correction=0).item(), rel=1e-9)
    assert got["layers.1"]["fwd_mean"] == pytest.approx(act.mean().item(), rel=1e-9, abs=1e-12)
    assert got["layers.1"]["fwd_absmax"] == pytest.approx(act.abs().max().item(), rel=1e-9)
    assert got["layers.1"]["grad_var"] == pytest.approx(grad.var(correction=0).item(), rel=1e-9)
    assert got["layers.1"]["fwd_nonfinite"] == 0.0
    # negative control: the block-0 output has other moments
    assert abs(got["layers.0"]["fwd_var"] - act.var(correction=0).item()) > 1e-3 * act.var().item()


def test_attention_scores_are_measured_over_causal_entries_only():
    model = small_model()
    x = torch.from_numpy(tokens()[:16].reshape(2, 8))
    w = W.Watch(model, every=1)
    with w.capture():
        model(x).sum().backward()
    w.commit(0, 0.0, 0.0, 0.0)
    st = w.history["records"][0]["stats"]["layers.0.attn.scores"]
    T, H, B = 8, 2, 2
    assert st["count"] == B * H * T * (T + 1) // 2  # the -inf above the diagonal are not counted
    assert st["fwd_nonfinite"] == 0.0 and math.isfinite(st["fwd_var"])


def test_update_ratio_is_the_relative_change_of_each_parameter():
    r = train(small_model(), tokens(), TrainOptions(steps=2, batch_size=2, watch_every=1, lr=1e-2))
    before = small_model()  # same seed: the weights before step 0
    opt_model = small_model()
    # replay step 0 by hand: the ratio recorded at step 0 is ||W1 - W0|| / ||W0||
    r0 = train(opt_model, tokens(), TrainOptions(steps=1, batch_size=2, watch_every=1, lr=1e-2))
    for name, p0 in before.named_parameters():
        p1 = dict(r0.model.named_parameters())[name]
        want = torch.linalg.vector_norm((p1 - p0).double()) / torch.linalg.vector_norm(p0.double())
        assert r.history["records"][0]["update_ratio"][name] == pytest.approx(want.item(), rel=1e-6), name
    assert all(v > 0 for v in r.history["records"][1]["update_ratio"].values())


def test_hooks_are_removed_when_the_step_raises():
    model = small_model()
    w = W.Watch(model, every=1)
    with pytest.raises(RuntimeError, match="boom"):
        with w.capture():
            model(torch.zeros(1, 4, dtype=torch.long))
            raise RuntimeError("boom")
    assert no_hooks(model)


def test_unknown_site_is_refused():
    with pytest.raises(tinylm.TinyLMError, match="layers.9"):
        W.Watch(small_model(), sites=["layers.9"])


def test_history_is_weights_only_loadable(tmp_path):
    r = train(small_model(), tokens(), TrainOptions(steps=2, batch_size=2, watch_every=1))
    torch.save({"history": r.history}, tmp_path / "h.pt")
    back = torch.load(tmp_path / "h.pt", weights_only=True)["history"]
    assert back == r.history


# --------------------------------------------------------------------------- alarms


def test_spike_alarm_fires_once_and_rearms():
    w = W.Watch(small_model(), every=5, spike_factor=1.5)
    for _ in range(TH.spike_warmup):
        assert w.alarm(2.0) is None
    assert w.alarm(2.9) is None  # 1.45x the running loss: not a spike
    assert w.alarm(4.0) == "spike"
    assert w.alarm(4.0) is None  # still high: no second alarm
    assert w.alarm(2.0) is None  # back down: re-armed
    assert w.alarm(5.0) == "spike"
    assert w.alarm(float("nan")) == "nonfinite"


def test_no_spike_alarm_before_the_warmup_or_on_a_falling_loss():
    w = W.Watch(small_model(), every=5)
    assert all(w.alarm(100.0 / (t + 1)) is None for t in range(3))  # the first steps may jump: no alarm
    w2 = W.Watch(small_model(), every=5)
    assert all(w2.alarm(10.0 - 0.1 * t) is None for t in range(50))


def test_nonfinite_loss_stops_and_names_the_layer_that_moved_first():
    """Sabotage block 1's FFN mid-run (a NaN weight): the watch records at once and names the block."""
    events = []
    model = small_model(num_layers=3)

    def sabotage(info):
        if info.step == 6:
            with torch.no_grad():
                model.layers[1].ffn.w2.weight[0, 0] = math.nan

    r = train(model, tokens(), TrainOptions(steps=20, batch_size=2, watch_every=3), on_step=sabotage,
              on_event=events.append)
    assert r.stopped is not None and "non-finite" in r.stopped and r.iteration == 6
    assert len(r.history["series"]["loss"]) == 7 and math.isnan(r.history["series"]["loss"][-1])
    ev = r.history["events"][0]
    assert ev["step"] == 6 and ev["kind"] == "nonfinite"
    # block 1's FFN is the first site (forward order) that stopped being finite; block 0 and
    # block 1's attention and resid_mid (before the FFN) stayed finite
    assert ev["site"] == "layers.1.ffn" and ev["moved_at"] == 6, ev
    assert "layers.1.ffn moved first" in ev["message"] and "stopped being finite" in ev["message"]
    assert events and events[0].message == ev["message"]
    assert r.history["records"][-1]["reason"] == "nonfinite" and r.history["records"][-1]["step"] == 6
    stats = r.history["records"][-1]["stats"]
    assert stats["layers.1.resid_mid"]["fwd_nonfinite"] == 0.0 and stats["layers.1.ffn"]["fwd_nonfinite"] > 0
    dep = V.first_departure(r.history)
    assert dep["step"] == 6 and dep["verdict"] == "non_finite"


def test_negative_control_healthy_training_raises_no_alarm_and_no_verdict():
    r = train(small_model(), tokens(), TrainOptions(steps=12, batch_size=2, watch_every=3, lr=1e-3))
    assert r.history["events"] == []
    assert V.first_departure(r.history) is None


# --------------------------------------------------------------------------- verdicts on synthetic histories


def _history(values: dict[str, list[float]], grads: dict[str, list[float]] | None = None) -> dict:
    sites = list(values)
    n = len(next(iter(values.values())))
    recs = []
    for k in range(n):
        stats = {}
        for s in sites:
            g = (grads or {}).get(s, [1.0] * n)[k]
            stats[s] = {"count": 10, "fwd_mean": 0.0, "fwd_var": values[s][k], "fwd_absmax": 1.0,
                        "fwd_nonfinite": 0.0 if math.isfinite(values[s][k]) else 1.0,
                        "grad_mean": 0.0, "grad_var": g, "grad_absmax": 1.0, "grad_nonfinite": 0.0}
        recs.append({"step": 10 * k, "reason": "interval", "loss": 1.0, "lr": 1.0, "grad_norm": 1.0,
                     "stats": stats, "update_ratio": {}, "attention": {}})
    return {"format": "tinylm-watch", "version": 1, "watch_every": 10, "sites": sites,
            "series": {"step": [], "loss": [], "lr": [], "grad_norm": []}, "records": recs, "events": []}


def test_exploding_is_growth_beyond_the_threshold_over_the_lowest_earlier_value():
    h = _history({"layers.0": [5.0, 1.0, 500.0, 1.5e3]})
    dep = V.first_departure(h)
    assert dep == {"step": 30, "site": "layers.0", "verdict": "exploding", "stat": "fwd_var", "value": 1.5e3,
                   "threshold": TH.watch_growth * 1.0}


def test_exploding_negative_control_growth_below_the_threshold_is_ok():
    assert V.first_departure(_history({"layers.0": [1.0, 10.0, 100.0, 0.99 * TH.watch_growth]})) is None


def test_branch_outputs_are_not_judged_for_growth_but_for_nonfinite():
    assert V.first_departure(_history({"layers.0.ffn": [1e-6, 1.0]})) is None
    dep = V.first_departure(_history({"layers.0.ffn": [1.0, math.nan]}))
    assert dep["verdict"] == "non_finite"


def test_pre_norm_residual_scale_is_not_judged_but_its_attention_scores_are():
    h = _history({"layers.0": [1.0, 1e6], "layers.0.attn.scores": [1.0, 1.0]})
    h["norm"] = "pre"  # every read of the residual stream is normalised: its scale reaches nothing
    assert V.first_departure(h) is None
    h["norm"] = "post"  # negative control: without pre-norm the same growth is judged
    assert V.first_departure(h)["site"] == "layers.0"
    s = _history({"layers.0.attn.scores": [1.0, 2 * TH.watch_growth]})
    s["norm"] = "pre"
    assert V.first_departure(s)["verdict"] == "exploding"


def test_vanishing_gradient_and_its_negative_control():
    h = _history({"layers.0": [1.0, 1.0, 1.0]}, grads={"layers.0": [1e-6, 1e-8, 0.5e-6 / TH.watch_shrink]})
    assert V.first_departure(h)["verdict"] == "vanishing" and V.first_departure(h)["step"] == 20
    h = _history({"layers.0": [1.0, 1.0, 1.0]}, grads={"layers.0": [1e-6, 1e-8, 2e-6 / TH.watch_shrink]})
    assert V.first_departure(h) is None


def test_first_mover_prefers_the_upstream_site_at_the_earliest_record():
    h = _history({"layers.0": [1.0, 1.0, 1.0, 50.0], "layers.1": [1.0, 1.0, 20.0, 1e6]})
    m = V.first_mover(h)
    assert m["site"] == "layers.1" and m["step"] == 20 and m["factor"] == pytest.approx(20.0)
    h = _history({"layers.0": [1.0, 1.0, 30.0], "layers.1": [1.0, 1.0, 1e6]})
    assert V.first_mover(h)["site"] == "layers.0"  # same record: the upstream one
    assert V.first_mover(_history({"layers.0": [1.0, 2.0, 9.0]})) is None  # below watch_move = 10x


# --------------------------------------------------------------------------- exports and the panel


def test_json_and_csv_exports(tmp_path):
    r = train(small_model(), tokens(), TrainOptions(steps=4, batch_size=2, watch_every=2))
    writers.write_json(r.history, tmp_path / "w.json")
    writers.write_csv(r.history, tmp_path / "w.csv")
    back = json.loads((tmp_path / "w.json").read_text())
    assert back["records"][1]["stats"]["layers.0"]["fwd_var"] == r.history["records"][1]["stats"]["layers.0"]["fwd_var"]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "w.csv").read_text())))
    assert list(rows[0]) == list(COLUMNS)  # the one schema
    var = [row for row in rows if row["statistic"] == "var" and row["direction"] == "forward"]
    assert len(var) == 2 * len(r.history["sites"])
    assert {row["verdict"] for row in rows if row["statistic"] == "var"} == {"ok"}
    first = var[0]
    assert float(first["value"]) == pytest.approx(r.history["records"][0]["stats"][first["name"]]["fwd_var"])
    assert [float(row["value"]) for row in rows if row["statistic"] == "loss"] == r.history["series"]["loss"]


def test_json_export_turns_nonfinite_into_valid_json(tmp_path):
    h = _history({"layers.0": [1.0, math.inf, math.nan]})
    writers.write_json(h, tmp_path / "w.json")
    text = (tmp_path / "w.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["records"][1]["stats"]["layers.0"]["fwd_var"] == "inf"


def test_write_atomic_leaves_the_old_file_whole_when_writing_fails(tmp_path):
    path = tmp_path / "w.json"
    writers.write_atomic(path, "old\n")

    def half(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        writers.write_atomic(path, half)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["w.json"]
    writers.write_atomic(path, "new\n")  # negative control: a write that succeeds replaces it
    assert path.read_text() == "new\n"


def _render(renderable) -> str:
    from rich.console import Console

    console = Console(width=100, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_render_history_shows_blocks_and_the_first_departure():
    from reports.watch_view import render_history

    h = _history({"token_embeddings": [1.0] * 4, "layers.0": [1.0, 2.0, 4.0, 8.0], "layers.1": [1.0, 1.0, 3e3, math.nan],
                  "lm_head": [1.0] * 4})
    text = _render(render_history(h))
    assert "during training" in text and "layers.0" in text and "layers.1" in text
    assert "first verdict other than ok: step 20, layers.1 exploding" in text
    assert "×" in text  # the non-finite record is marked
    assert max(len(line) for line in text.splitlines()) <= 100


def test_render_history_of_a_healthy_run_says_ok():
    from reports.watch_view import render_history

    r = train(small_model(), tokens(), TrainOptions(steps=4, batch_size=2, watch_every=1, lr=1e-3))
    text = _render(render_history(r.history))
    assert "every verdict stayed ok over all 4 records" in text
    assert _render(render_history({**r.history, "records": []})).count("no watch records") == 1


def test_plot_history_writes_a_png(tmp_path):
    from reports.watch_view import plot_history

    r = train(small_model(), tokens(), TrainOptions(steps=3, batch_size=2, watch_every=1))
    plot_history(r.history, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_history_of_a_foreign_history_says_so(tmp_path):
    from reports.watch_view import plot_history, render_history

    text = _render(render_history([1, 2, 3]))
    assert "not a tinylm watch history" in text
    plot_history({"something": "else"}, tmp_path / "p.png")  # draws an empty figure, does not fail
    assert (tmp_path / "p.png").exists()


def test_a_history_judges_once_however_often_it_is_drawn(monkeypatch, tmp_path):
    """The renderers draw a History's verdicts: the verdict function runs once for the terminal
    panel (twice), the notebook HTML, the plot and every question asked, and the renderers call
    no verdict function themselves; a grown history is judged again, once."""
    from diagnostics import History
    from reports.notebook import history_html
    from reports.watch_view import plot_history, render_history

    calls = []
    judge = H.verdicts
    monkeypatch.setattr(H, "verdicts", lambda *a, **k: calls.append(a) or judge(*a, **k))

    def forbidden(*a, **k):
        raise AssertionError("a renderer judged")

    for name in ("verdicts", "first_departure", "first_mover"):
        monkeypatch.setattr(V, name, forbidden)
    h = History(_history({"token_embeddings": [1.0] * 4, "layers.0": [1.0, 2.0, 4.0, 8.0],
                          "layers.1": [1.0, 1.0, 3e3, math.nan], "lm_head": [1.0] * 4}))
    texts = [_render(render_history(h)) for _ in range(2)]
    assert texts[0] == texts[1] and "first verdict other than ok: step 20, layers.1 exploding" in texts[0]
    assert "exploding at step 20 (layers.1)" in history_html(h)
    plot_history(h, tmp_path / "p.png")
    h.to_frame(), h.verdicts(), h.first_departure(), h.departures(), h.first_mover()
    assert len(calls) == 1
    assert h.departures()["layers.1"]["step"] == 20 and h.first_departure() == h.verdicts()[0]
    History(h.data).verdicts()  # negative control: a new History judges
    assert len(calls) == 2
    rec = copy.deepcopy(h.data["records"][-1])
    rec["step"] = 40
    h.data["records"].append(rec)  # the dict grew (a running watch appends): judged again, once
    assert [v["step"] for v in h.verdicts()][-1] == 40 and h.verdicts() == h.verdicts()
    assert len(calls) == 3


# --------------------------------------------------------------------------- the one schema and the one set of thresholds


def test_frame_is_the_one_schema_with_each_verdict_on_its_direction():
    h = _history({"layers.0": [1.0, 1.0, 2 * TH.watch_growth]}, grads={"layers.0": [1.0, 1.0, 1.0]})
    h["series"] = {"step": [0, 10, 20], "loss": [3.0, 2.5, 9.0], "lr": [1e-3] * 3, "grad_norm": [1.0] * 3}
    df = H.to_frame(h, run="demo")
    assert list(df.columns) == list(COLUMNS) and df.dtypes.astype(str).to_dict() == DTYPES
    assert set(df["run"]) == {"demo"}
    site = df[(df["name"] == "layers.0") & (df["statistic"] == "var")]
    # 3 records x 2 directions; the explosion at step 20 is the forward variance's verdict, not the gradient's
    assert len(site) == 6 and list(site["block"]) == [0] * 6
    at20 = site[site["step"] == 20].set_index("direction")
    assert at20.loc["forward", "verdict"] == "exploding" and at20.loc["forward", "value"] == 2 * TH.watch_growth
    assert at20.loc["backward", "verdict"] == "ok"
    assert set(site[site["step"] < 20]["verdict"]) == {"ok"}
    loss = df[df["statistic"] == "loss"]
    assert list(loss["step"]) == [0, 10, 20] and list(loss["value"]) == [3.0, 2.5, 9.0]
    assert loss["name"].isna().all() and loss["verdict"].isna().all()
    assert df["predicted"].isna().all() and df["valid"].isna().all()  # the watch predicts nothing


def test_a_history_stored_in_the_old_format_reads_the_same():
    """A history as checkpoints stored it before kinds, model and thresholds were written: its rows,
    verdicts and panel come out as from a new one, with kind/scheme/depth/width None and the
    default thresholds."""
    from reports.watch_view import render_history

    model = small_model()
    x = torch.from_numpy(tokens()[:16].reshape(2, 8))
    w = W.Watch(model, every=1)
    for t in range(2):
        with w.capture():
            model(x).logsumexp(-1).mean().backward()
        w.commit(t, 1.0, 1e-3, 1.0)
        w.log(t, 1.0, 1e-3, 1.0)
    new = w.history
    old = {k: v for k, v in new.items() if k not in ("kinds", "model", "thresholds", "param_dims")}
    assert set(old) == {"format", "version", "watch_every", "spike_factor", "sites", "norm", "series", "records",
                        "events"}
    a, b = H.to_frame(new), H.to_frame(old)
    assert len(a) == len(b) and b["scheme"].isna().all() and b["depth"].isna().all()
    assert b[b["statistic"] == "var"]["kind"].isna().all()  # the site kinds were not stored
    assert set(a["kind"].dropna()) >= {"residual", "attn_scores", "embedding"} and set(a["scheme"]) == {"cs336"}
    same = ["step", "name", "block", "direction", "statistic", "value", "verdict"]
    assert a[same].equals(b[same])
    assert V.verdicts(old) == V.verdicts(new) and V.thresholds_of(old) == Thresholds()
    assert "every verdict stayed ok over all 2 records" in _render(render_history(old))
    resumed = W.Watch(small_model(), every=1, history=old)  # a resumed run continues an old history
    assert resumed.history is old and resumed.history["thresholds"] == Thresholds().to_dict()


def test_diagnose_and_the_watch_read_the_same_thresholds():
    """One Thresholds object drives both jobs: diagnose reports the values it judged with, the watch
    judges and alarms with them. A 50x rise is ok under the default watch_growth (1e3) and exploding
    under watch_growth=20 (the negative control is the default)."""
    from diagnostics import DiagnoseOptions, diagnose

    th = Thresholds(watch_growth=20.0, spike_factor=3.0, spike_warmup=2)
    model = small_model()
    w = W.Watch(model, thresholds=th)
    assert w.thresholds is th and w.spike_factor == 3.0 and w.history["thresholds"] == th.to_dict()
    result = diagnose(model, options=DiagnoseOptions(batch_size=2, seq_len=8, batches=1, thresholds=th))
    assert result.thresholds == th.to_dict() == w.history["thresholds"]
    assert Thresholds.from_dict(result.thresholds) == th
    rise = _history({"layers.0": [1.0, 50.0]})
    assert V.first_departure(rise) is None  # defaults: 50x < 1e3x
    assert V.first_departure(rise, th)["verdict"] == "exploding"
    rise["thresholds"] = th.to_dict()  # the history's own thresholds are the default reading
    assert V.first_departure(rise)["threshold"] == 20.0
    # the spike settings: warmup 2 and factor 3 instead of 10 and 1.5
    assert [w.alarm(2.0), w.alarm(2.0), w.alarm(5.0), w.alarm(7.0)] == [None, None, None, "spike"]
    d = W.Watch(small_model())
    assert d.thresholds == Thresholds() and d.spike_factor == 1.5


@pytest.mark.parametrize("changes, match", [
    (dict(watch_growth=1.0), "watch_growth=1.0"), (dict(spike_factor=0.5), "spike_factor=0.5"),
    (dict(spike_ema=1.0), "spike_ema=1.0"), (dict(spike_warmup=2.5), "spike_warmup=2.5"),
    (dict(watch_move=math.nan), "watch_move=nan"),
])
def test_bad_watch_thresholds_are_named(changes, match):
    with pytest.raises(tinylm.TinyLMError, match=match):
        Thresholds(**changes)
    with pytest.raises(tinylm.TinyLMError, match="thresholds="):
        W.Watch(small_model(), thresholds={"watch_growth": 10})

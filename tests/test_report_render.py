"""Rendering of the diagnose report on a fixed-width console, from results built by hand.

The results here are constructed from the diagnostics dataclasses with known
numbers, so each assertion checks that a given field reaches the page (and in
the right place); tests/test_report_diagnose.py renders results of real runs.
"""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
from rich.console import Console

from diagnostics.result import AttentionRow, DepthRow, DiagnoseResult, Finding, Header, ParamRow, TensorRow
from reports.charts import BOTH, MEASURED, NONFINITE, PREDICTED, DepthChart, DepthSeries
from reports.fmt import num, pct, ratio_interval
from reports.render import LayerTable, ReportContext, attention_table, depth_chart, header_table, report, verdict_panel


def _row(name, block, kind, direction, var, pred=None, verdict="ok", valid=True, nonfinite=0.0):
    ratio = var / pred if pred else None
    return TensorRow(name, block, kind, direction, 4096, 0.0, var, var, 3.0 * math.sqrt(var) if var == var else var,
                     0.0, nonfinite, 0.0, 0.0, 0.0, 0.0, pred, ratio,
                     None if ratio is None else ratio * 0.9, None if ratio is None else ratio * 1.1,
                     "global" if pred else "", valid, "" if valid else "branch too large for the linear regime", verdict)


def make_result(num_layers=3, gain=1.2, findings=(), nan_block=None, cosine=0.02, cosine_predicted=None):
    """cosine_predicted: the predicted cosine after block i is cosine_predicted * (i + 1), after the
    embedding cosine_predicted / 2 (None: no prediction)."""
    tensors = [_row("token_embeddings", None, "embedding", "forward", 0.97, 0.973),
               _row("token_embeddings", None, "embedding", "backward", 2e-9)]
    def cp(k):
        if cosine_predicted is None:
            return None
        return cosine_predicted * k if k else cosine_predicted / 2

    depth = [DepthRow(0, "token_embeddings", 0.97, 0.973, 2e-9, None, 0.01, cp(0))]
    params = [ParamRow("token_embeddings.weight", None, (100, 32), 0.986, 0.986, "TN(0,1)", 1.0, None, None, 1e-6, 0.0)]
    attention = []
    v, g = 0.97, 2e-9
    for i in range(num_layers):
        v *= gain
        verdict = "exploding" if gain > 4 and i >= 1 else "ok"
        fv = float("nan") if nan_block is not None and i >= nan_block else v
        tensors += [
            _row(f"layers.{i}.attn", i, "attn_branch", "forward", 0.3 * fv, 0.3 * v),
            _row(f"layers.{i}.attn", i, "attn_branch", "backward", g, g),
            _row(f"layers.{i}.ffn", i, "ffn_branch", "forward", 0.2 * fv, 0.2 * v, valid=False),
            _row(f"layers.{i}", i, "residual", "forward", fv, v, "non_finite" if fv != fv else verdict),
            _row(f"layers.{i}", i, "residual", "backward", g),
            _row(f"layers.{i}.attn.q_proj", i, "linear", "forward", 0.5, 0.5),
        ]
        params += [ParamRow(f"layers.{i}.attn.output_proj.weight", i, (32, 32), 0.171, 0.176, "TN", 0.97, 1.9, 20.0, 1e-6, 0.0),
                   ParamRow(f"layers.{i}.ffn.w2.weight", i, (32, 64), 0.140, 0.144, "TN", 0.98, 1.9, 20.0, 1e-6, 0.0)]
        attention.append(AttentionRow(f"layers.{i}.attn.probs", i, 0.8 + 0.1 * i, 2.31, 0.02, 2.35, 0.004 * i))
        depth.append(DepthRow(i + 1, f"layers.{i}", fv, v, g, g * 1.1, cosine * (i + 1), cp(i + 1)))
    tensors.append(_row("lm_head", None, "logits", "forward", 0.9, 1.0))
    header = Header("TransformerLM", dict(vocab_size=100, context_length=16, d_model=32, num_layers=num_layers,
                                          num_heads=4, d_ff=64, norm="pre", ffn="swiglu", positions="rope"),
                    12345, "cs336", 256, 4, 16, 2, 2, 0, "global", 4.66, math.log(100), "random")
    return DiagnoseResult(header, tensors, params, attention, depth, list(findings),
                          {"exploding_gain": 4.0, "vanishing_gain": 0.25}, "2026-01-01T00:00:00Z")


EXPLODING = Finding("exploding", "layers.1", 31.0, 4.0,
                    "residual variance multiplies by 31x per block from block 1 (threshold 4x)",
                    "per-block forward variance gain", "forward", 1,
                    "a norm layer is missing or the branch init is too large; try pre-norm")


def render(renderable, width=100) -> str:
    buf = io.StringIO()
    Console(width=width, file=buf, color_system=None, legacy_windows=False).print(renderable)
    return buf.getvalue()


def test_numbers_are_short_and_honest():
    assert num(0.0312) == "0.0312"
    assert num(12.345) == "12.3"
    assert num(1.234e-7) == "1.23e-7"
    assert num(4.5e12, 2) == "4.5e12"
    assert num(None) == "-" and num(float("nan")) == "nan" and num(float("-inf")) == "-inf" and num(0) == "0"
    assert ratio_interval(1.02, 0.97, 1.08) == "1.02 [0.97, 1.08]"
    assert ratio_interval(1.003, 0.0123, 31.4, 2, ",") == "1.00 [0.012,31]"
    assert ratio_interval(1.02, None, None) == "1.02" and ratio_interval(None, 1, 2) == "-"
    assert pct(0.123) == "12%" and pct(0.0) == "0%" and pct(0.00001) == "<0.1%" and pct(0.05) == "5.0%"


def test_healthy_report_says_healthy_and_shows_every_block():
    out = render(report(make_result(), ReportContext(source="fresh test model", data="random tokens")))
    assert "HEALTHY" in out and "NOT HEALTHY" not in out
    assert "12,345" in out and "fresh test model" in out and "random tokens" in out
    assert "V=100 ctx=16 d=32 L=3 H=4 d_ff=64" in out
    order = [out.index(s) for s in ("parameters", "verdict: healthy", "Variance over depth", "Per layer",
                                    "Attention and rank collapse")]
    assert order == sorted(order), "the report's sections are out of order"
    for i in range(3):
        assert f"block {i}" in out and f"layers.{i}.attn" in out and f"layers.{i}.ffn" in out


def test_exploding_report_names_the_finding_number_threshold_and_suggestion():
    res = make_result(num_layers=4, gain=31.0, findings=[EXPLODING])
    out = render(verdict_panel(res))
    assert "NOT HEALTHY: 1 finding (exploding)" in out
    assert "EXPLODING" in out and "layers.1 (block 1, forward)" in out
    assert "per-block forward variance gain = 31.0, threshold 4.00" in out
    assert "try: a norm layer is missing" in out
    table = render(LayerTable(res))
    exploding_rows = [line for line in table.splitlines() if "exploding" in line]
    assert [r.split()[0] for r in exploding_rows] == ["layers.1", "layers.2", "layers.3"]


def test_layer_table_rows_carry_measured_predicted_ratio_interval_and_drift():
    out = render(LayerTable(make_result(gain=1.0)), width=120)
    line = next(s for s in out.splitlines() if s.split() and s.split()[0] == "layers.0.attn")
    # forward var 0.291 vs predicted 0.291 (ratio 1, interval [0.9, 1.1]); output_proj drift 0.97
    assert "0.291" in line and "1.00 [0.90, 1.10]" in line and "0.97" in line and "ok" in line
    ffn = next(s for s in out.splitlines() if s.split() and s.split()[0] == "layers.0.ffn")
    assert "*" in ffn, "a prediction outside its validity must be marked"
    # linear rows only with all_tensors (or when flagged)
    assert "q_proj" not in out
    assert "layers.0.attn.q_proj" in render(LayerTable(make_result(), all_tensors=True), width=120)


@pytest.mark.parametrize("width", [80, 100, 120])
def test_report_fits_the_width(width):
    res = make_result(num_layers=12, gain=31.0, findings=[EXPLODING])
    out = render(report(res, ReportContext(source="x" * 30)), width=width)
    assert max(len(line) for line in out.splitlines()) <= width
    # the flag words are not cut, even at 80 columns
    assert sum("exploding" in line for line in out.splitlines()) >= 11


def test_depth_chart_places_measured_and_predicted_markers():
    chart = DepthChart(["a", "b", "c"], [DepthSeries("fwd", [1.0, 10.0, 100.0], [1.0, 1.0, 1.0])])
    lines = render(chart, width=60).splitlines()
    rows = {line.split("│")[0].strip(): line.split("│")[1] for line in lines if "│" in line and line.split("│")[0].strip()}
    assert BOTH in rows["a"]  # measured == predicted
    assert rows["b"].index(MEASURED) > rows["b"].index(PREDICTED)
    assert rows["c"].index(MEASURED) > rows["b"].index(MEASURED)  # 100 lies right of 10 on the log axis


def test_depth_chart_marks_nonfinite_and_rejects_misaligned_input():
    chart = DepthChart(["a", "b"], [DepthSeries("fwd", [1.0, float("nan")], [None, None])])
    out = render(chart, width=60)
    assert NONFINITE in out
    with pytest.raises(ValueError, match="one per label"):
        DepthChart(["a"], [DepthSeries("fwd", [1.0, 2.0], [None, None])])


def test_depth_chart_from_result_has_one_row_per_depth():
    out = render(depth_chart(make_result(num_layers=5)))
    for label in ["embed"] + [f"block {i}" for i in range(5)]:
        assert any(line.strip().startswith(label) for line in out.splitlines())


def test_nonfinite_model_is_reported_with_its_weights():
    res = make_result(nan_block=1, findings=[Finding("non_finite", "layers.1", 1.0, 0.0,
                                                      "outputs of layers.1 are non-finite (first such layer)",
                                                      "fraction non-finite", "forward", 1, "")])
    ctx = ReportContext(nonfinite_params=["layers.1.attn.q_proj.weight"])
    out = render(report(res, ctx))
    assert "NON-FINITE" in out and "layers.1" in out and NONFINITE in out
    # the loader's list is shown too when no finding covers it
    res2 = make_result()
    out2 = render(verdict_panel(res2, ctx))
    assert "NOT HEALTHY" in out2 and "layers.1.attn.q_proj.weight" in out2


def test_header_and_attention_panel():
    res = make_result()
    head = render(header_table(res, ReportContext(source="tinylm checkpoint m.pt, iteration 5", dtype="bfloat16")))
    assert "iteration 5" in head and "bfloat16" in head and "256 measured" in head and "seeds 0..1" in head
    att = render(attention_table(res), width=100)
    line = next(s for s in att.splitlines() if s.strip().startswith("2 "))
    # block 2: score std 1.00, entropy 2.31 of 2.35 uniform, 0.8% saturated, cosine after block 2 = 0.06
    assert "1.00" in line and "2.31" in line and "2.35" in line and "0.8%" in line and "0.0600" in line


def test_cosine_panel_shows_the_prediction_beside_the_measurement():
    """With a predicted cosine (the kernel theory) the rank-collapse panel gets a "pred" column right of
    the measured cosine, and the embedding's prediction in the caption; without one, neither."""
    res = make_result(cosine=0.02, cosine_predicted=0.025)
    for width in (100, 80):
        att = render(attention_table(res), width=width)
        head = next(s for s in att.splitlines() if s.strip().startswith("block"))
        assert head.split()[-3:] == ["cosine", "pred", "flags"]
        line = next(s for s in att.splitlines() if s.strip().startswith("2 "))
        # block 2: measured 0.0600, predicted 0.0750, in that order, before the verdict
        assert line.split()[-3:] == ["0.0600", "0.0750", "ok"]
        flat = " ".join(att.split())
        assert "after the embedding 0.0100 (pred 0.0125)" in flat and "token-kernel theory" in flat
    # the kernel's validity flows through: a prediction outside it carries the table's "*"
    k = next(i for i, r in enumerate(res.tensors) if (r.name, r.direction) == ("layers.2", "forward"))
    res.tensors[k] = dataclasses.replace(res.tensors[k], valid=False, validity="no norm")
    line = next(s for s in render(attention_table(res)).splitlines() if s.strip().startswith("2 "))
    assert line.split()[-3:] == ["0.0600", "0.0750*", "ok"]
    plain = render(attention_table(make_result()), width=100)
    assert "pred" not in plain and plain.splitlines()[1].split()[-2:] == ["cosine", "flags"]


def test_layer_table_caption_describes_the_ratio_and_the_rules():
    """The ratio is the geometric mean over replicates with a t interval on ln(ratio); the rule note
    appears when a prediction came from the kernel theory."""
    res = make_result()
    flat = " ".join(render(LayerTable(res), width=100).split())
    assert "geometric mean over replicates" in flat and "Student-t on ln(ratio)" in flat
    assert "token-kernel" not in flat
    res.tensors[0] = dataclasses.replace(res.tensors[0], rule="kernel embedding: ...")
    flat = " ".join(render(report(res), width=100).split())
    assert "pred: forward by the token-kernel theory, backward by the independent-token rules" in flat
    assert "global (forward: token-kernel theory; backward: independent-token rules)" in flat
    k = next(i for i, r in enumerate(res.tensors) if r.direction == "backward")
    res.tensors[k] = dataclasses.replace(res.tensors[k], rule="kernel stream gradient")
    flat = " ".join(render(report(res), width=100).split())
    assert "pred: forward by the token-kernel theory, backward by the token-kernel theory" in flat
    assert "global (forward: token-kernel theory; backward: token-kernel theory)" in flat


def test_progress_bar_draws_on_a_terminal_and_stays_silent_otherwise():
    from reports.progress import progress_bar

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80, color_system=None)
    with progress_bar("diagnose", enabled=True, console=console) as update:
        update(1, 4, "batch 1 of 4")
        update(4, 4, "batch 4 of 4")
    assert "batch" in buf.getvalue() and "4/4" in buf.getvalue()
    quiet = io.StringIO()
    with progress_bar("diagnose", console=Console(file=quiet)) as update:  # not a terminal: no bar
        update(1, 4, "batch 1 of 4")
    assert quiet.getvalue() == ""



def test_depth_figure_draws_the_variance_rows_of_the_frame():
    """The plot reads the tidy frame: the residual line is the forward "var" rows of kind residual at
    depth block + 1, measured solid and predicted dashed; a non-finite value is left out."""
    import matplotlib.pyplot as plt

    from reports.plots import depth_figure

    res = make_result(num_layers=3, gain=2.0, nan_block=2)
    frame = res.to_frame()
    var = frame[(frame.statistic == "var") & (frame.kind == "residual") & (frame.direction == "forward")]
    fig = depth_figure(res)
    try:
        lines = {line.get_label(): line for line in fig.axes[0].lines}
        measured, predicted = lines["residual"], lines["residual predicted"]
        assert list(measured.get_xdata()) == [1, 2]  # block 2 is NaN: not drawn
        assert list(measured.get_ydata()) == list(var.value.iloc[:2])
        assert list(predicted.get_xdata()) == [1, 2, 3] and list(predicted.get_ydata()) == list(var.predicted)
    finally:
        plt.close(fig)

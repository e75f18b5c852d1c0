"""The watch's precision trend: its numbers are precision()'s on the same operands, a growing massive
activation raises precision_drop (a healthy run does not), the option checked, the rows tidy."""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from diagnostics import History, OptionsError, PrecisionOptions, PrecisionWatch, Watch, precision
from diagnostics.jobs.watch_precision import gemm_sqnr, sample_rows
from diagnostics.measure.quant import recipe
from tinylm import functional as F

CHANNEL = 5


def _model(seed: int = 0) -> tinylm.TransformerLM:
    torch.manual_seed(seed)
    return tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=64, context_length=32, d_model=32, num_layers=2,
                                                   num_heads=2, d_ff=64))


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(step))


def _run(steps: int, scales: list[float] | None = None, **kw) -> Watch:
    """``steps`` SGD steps watched every step; ``scales[t]``: layer 0's attention input at token 0 and
    one channel multiplied by it at step t (a massive activation growing over training)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    now = {"scale": 1.0}

    def hook(mod, args, out):
        out = out.clone()
        out[:, 0, CHANNEL] = out[:, 0, CHANNEL] * now["scale"]
        return out

    handle = model.layers[0].ln1.register_forward_hook(hook) if scales else None
    watch = Watch(model, every=1, **kw)
    for t in range(steps):
        now["scale"] = scales[t] if scales else 1.0
        b = _batch(t)
        with watch.step(t):
            loss = F.cross_entropy(model(b[:, :-1]), b[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(loss)
    watch.close()
    if handle is not None:
        handle.remove()
    return watch


def test_numbers_are_precisions_on_the_same_operands():
    model = _model()
    b = _batch(0)
    watch = Watch(model, every=1, precision=PrecisionWatch("tensorwise", tokens=0))
    with watch.step(0):  # no optimizer step: precision() below sees the same weights; its loss as precision()'s
        loss = torch.nn.functional.cross_entropy(model(b[:, :-1]).float().flatten(0, -2), b[:, 1:].flatten())
        loss.backward()
    watch.record(loss)
    got = watch.history["records"][0]["precision"]
    ref = precision(model, b, PrecisionOptions(recipes=("tensorwise",), theory=False))
    assert got["tokens"] == 4 * 32 and set(got["modules"]) == {r.module for r in ref.rows}
    for r in ref.rows:
        e = got["modules"][r.module]
        # the same code on the same operands (the same pass, in eval mode there, training mode here: no
        # dropout): equal to the bit
        assert e[r.gemm] == min(r.sqnr_db, r.row_sqnr_db) and e[f"{r.gemm}_row"] == r.row_sqnr_db, (r.module, r.gemm)
    for m in got["modules"]:
        assert got["modules"][m]["underflow"] == max(r.underflow for r in ref.rows if r.module == m)
    # negative control: another recipe's figures differ from these (the check can fail)
    rw = precision(model, b, PrecisionOptions(recipes=("rowwise",), theory=False))
    assert any(abs(got["modules"][r.module][r.gemm] - min(r.sqnr_db, r.row_sqnr_db)) > 1.0 for r in rw.rows)


def test_growing_massive_activation_alerts_and_healthy_run_does_not(tmp_path):
    scales = [1.0, 1.0, 1e2, 1e4, 1e6, 1e6]
    bad = _run(6, scales, precision="tensorwise", log_dir=str(tmp_path))
    drops = [a for a in bad.alerts if a.signal == "precision_drop"]
    assert drops, [a.message for a in bad.alerts]
    first = drops[0]
    assert first.step >= 3 and "layers.0.attn.q_proj" in first.message, first.message
    assert "massive activation" in first.cause and "rowwise or MXFP8" in first.fix
    assert len({a.step for a in drops}) == 1  # once per run of records past its threshold
    # the trend keeps the precursor: the input's peak / median grew with the scale
    peaks = [r["precision"]["modules"]["layers.0.attn.q_proj"]["input_peak"] for r in bad.history["records"]]
    assert peaks[-1] > 1e3 * peaks[0]
    # the log dir keeps the trend: read back, the records hold it and the alert is replayed from them
    back = History.read(tmp_path)
    assert back["records"][-1]["precision"] == bad.history["records"][-1]["precision"]
    assert [a.step for a in back.alerts if a.signal == "precision_drop"] == [first.step]
    healthy = _run(6, None, precision="tensorwise")
    assert not [a for a in healthy.alerts if a.signal == "precision_drop"], [a.message for a in healthy.alerts]
    qs = [r["precision"]["modules"]["layers.0.attn.q_proj"]["fprop"] for r in healthy.history["records"]]
    assert max(qs) - min(qs) < 3.0 and min(qs) > 20


def test_rows_and_off_by_default():
    watch = _run(2, None, precision=PrecisionWatch("mxfp8", drop_db=3.0))
    assert watch.history["precision"]["recipe"] == "mxfp8"
    assert watch.history["precision"]["products"] == ["layers.0.ffn.w2", "layers.1.ffn.w2"]
    df = History(watch.history).to_frame()
    q = df[(df.statistic == "sqnr_db_fprop") & (df.name == "layers.1.ffn.w2")]
    assert len(q) == 2 and q.value.map(math.isfinite).all() and (q.kind == "linear").all()
    assert {"row_sqnr_db_wgrad", "peak_ratio_input", "peak_ratio_grad"} <= set(df.statistic)
    plain = _run(1)
    assert "precision" not in plain.history and "precision" not in plain.history["records"][0]


@pytest.mark.parametrize("value, words", [("fp7", "precision='fp7': must be one of tensorwise"),
                                          (3, "precision=3: must be a recipe name"),
                                          (PrecisionWatch, "precision=<class")])
def test_option_checked_in_one_line(value, words):
    with pytest.raises(OptionsError) as e:
        Watch(_model(), precision=value)
    assert str(e.value).startswith(words) and "\n" not in str(e.value) and "; pass " in str(e.value)


def test_options_fields_checked():
    with pytest.raises(OptionsError, match=r"^recipe='fp7': must be one of tensorwise, rowwise"):
        PrecisionWatch(recipe="fp7")
    with pytest.raises(OptionsError, match=r"^drop_db=0: must be a finite number > 0"):
        PrecisionWatch(drop_db=0)
    with pytest.raises(OptionsError, match=r"^tokens=-1: must be an integer >= 0"):
        PrecisionWatch(tokens=-1)


def test_subsample_keeps_the_largest_rows_and_each_sampled_row_is_exact():
    gen = torch.Generator().manual_seed(1)
    x, w, g = torch.randn(512, 32, generator=gen), torch.randn(48, 32, generator=gen), torch.randn(512, 48, generator=gen)
    x[301, 7] = 1e5  # a massive activation at a row the stride skips
    g[77, 3] = 50.0
    rows = sample_rows(x, g, 64)
    assert {301, 77} <= set(rows.tolist()) and len(rows) == 66 and rows[1] == 8
    sub = gemm_sqnr(x[rows], w, g[rows], recipe("tensorwise"))
    # the scale per tensor is the whole tensor's: fprop's sampled rows are the full GEMM's rows, so the massive
    # row's harm shows; without it in the sample (negative control) the typical row reads far higher
    bare = torch.arange(0, 512, 8)
    miss = gemm_sqnr(x[bare], w, g[bare], recipe("tensorwise"))
    assert sub["fprop"][1] < miss["fprop"][1] - 6 and sub["input_peak"] > 1e4 > miss["input_peak"]


@pytest.mark.parametrize("tokens", [16, 0])
def test_nothing_is_read_on_the_host_inside_forward_and_backward(tokens):
    """The layers' operands are kept on their device during the step and measured after it; a sampled
    record still measures every layer. Negative control: a gradient hook that reads one number is seen."""
    from diagnostics.measure.opcount import OpCount

    def reads_inside(model, watch, extra_hook=False):
        b = _batch(0)
        with watch.step(0):
            with OpCount() as ops:
                out = model(b[:, :-1])
                if extra_hook:
                    out.register_hook(lambda g: float(g.sum()) and None)
                torch.nn.functional.cross_entropy(out.float().flatten(0, -2), b[:, 1:].flatten()).backward()
            inside = ops.host_reads
        watch.record(1.0)
        return inside

    model = _model()
    watch = Watch(model, every=1, precision=PrecisionWatch("tensorwise", tokens=tokens))
    assert reads_inside(model, watch) == 0
    got = watch.history["records"][0]["precision"]
    # 128 token rows: every 8th (16) and up to two rows of the largest entries
    assert (16 <= got["tokens"] <= 18 if tokens else got["tokens"] == 4 * 32) and len(got["modules"]) == 2 * 7 + 1
    other = _model()
    control = Watch(other, every=1, precision=PrecisionWatch("tensorwise", tokens=tokens))
    assert reads_inside(other, control, extra_hook=True) >= 1


class _Plain(torch.nn.Module):
    """A leaf with a 2-D weight whose forward is x W^T, of a class the trend does not know."""

    def __init__(self, n_in, n_out, factor=1.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.factor = factor

    def forward(self, x):
        return self.factor * (x @ self.weight.t())


def test_a_layer_of_an_unknown_class_is_checked_after_the_step():
    """x W^T from an unknown class is measured; one whose output is 2 x W^T (negative control) is not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Plain(16, 32), torch.nn.Tanh(), _Plain(32, 8, factor=2.0))
    watch = Watch(model, every=1, precision="tensorwise")
    with watch.step(0):
        model(torch.randn(4, 16)).square().mean().backward()
    watch.record(1.0)
    got = watch.history["records"][0]["precision"]["modules"]
    assert set(got) == {"0"} and math.isfinite(got["0"]["fprop"]) and got["0"]["fprop"] > 20

"""The ``diagnose`` report: header, verdict, depth chart, per-layer table, attention panel.

Each piece is a function from a :class:`diagnostics.DiagnoseResult` (plus what
the command line knows about where the model came from) to a rich renderable;
:func:`report` puts them in the order a reader needs them: what was measured,
is it healthy (and if not, where, the number, the threshold and what to try),
the shape over depth, the details. Every figure drawn is a field of the result;
nothing is computed here. Verdicts are printed as words as well as colours, so
the report reads the same on a terminal without colour.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .charts import DepthChart, DepthSeries
from .fmt import VERDICT_STYLE, first_that_fits, num, pct, ratio_interval, short_name, verdict_text

__all__ = [
    "ReportContext",
    "SUMMARY_KINDS",
    "header_table",
    "verdict_panel",
    "depth_chart",
    "LayerTable",
    "layer_table",
    "attention_table",
    "AttentionTable",
    "report",
]

#: tensor kinds the per-layer table shows by default (``all_tensors`` shows every row);
#: a tensor a finding names is shown as well.
SUMMARY_KINDS = ("embedding", "attn_branch", "ffn_branch", "residual", "logits")

# The weight whose std goes beside a tensor of this kind: suffixes tried in order on the tensor's name.
_WEIGHT_OF = {
    "embedding": (".weight",),
    "linear": (".weight",),
    "norm": (".weight",),
    "logits": (".weight",),
    "attn_branch": (".output_proj.weight",),
    "ffn_branch": (".w2.weight",),
}


@dataclass
class ReportContext:
    """What the command line knows besides the result: where the model and the tokens came from."""

    # source, data, dtype, device: for a result whose header does not hold them (a document written
    # before it recorded them); the header's own facts are drawn where it has them
    source: str = "a model"  # e.g. "tinylm checkpoint model.pt, iteration 5,000"
    data: str = ""  # e.g. "uniform random tokens over [0, 10000)"
    dtype: str = "float32"
    device: str = "cpu"
    nonfinite_params: list[str] = field(default_factory=list)  # from the checkpoint loader
    all_tensors: bool = False
    random_trained: bool = False  # a trained model measured on uniform random tokens (also read from the header)


def _kv(table: Table, key: str, value: str | Text) -> None:
    table.add_row(Text(key, style="bold"), value if isinstance(value, Text) else Text(value))


_POSITIONS = {"rope": "RoPE", "learned": "learned positions", "none": "NoPE"}


def _positions(cfg: dict[str, Any]) -> str:
    """The position scheme of a config dict (a legacy boolean "rope" key read too)."""
    if "positions" in cfg:
        return cfg["positions"]
    return "rope" if cfg.get("rope", True) else "none"


def _config_line(cfg: dict[str, Any] | None, kv_heads: int | None = None) -> str:
    if not cfg:
        return "(not a tinylm model: no config)" + (f" · K/V heads {kv_heads}" if kv_heads else "")
    parts = [f"V={cfg.get('vocab_size')}", f"ctx={cfg.get('context_length')}", f"d={cfg.get('d_model')}",
             f"L={cfg.get('num_layers')}", f"H={cfg.get('num_heads')}", f"d_ff={cfg.get('d_ff')}"]
    kv = cfg.get("num_kv_heads") or kv_heads
    if kv and kv != cfg.get("num_heads"):  # grouped-query attention: H query heads share kv K/V heads
        parts.insert(5, f"KV={kv}")
    norm = {"pre": "pre-norm", "post": "post-norm", "none": "no norm"}.get(cfg.get("norm", "pre"), str(cfg.get("norm")))
    if cfg.get("norm_kind") == "layer" and cfg.get("norm", "pre") != "none":
        norm += " LayerNorm"
    variant = [norm, cfg.get("ffn", "swiglu"), _POSITIONS.get(_positions(cfg), "?")]
    if cfg.get("bias"):
        variant.append("biases")
    if cfg.get("tie_embeddings"):
        variant.append("tied embeddings")
    if cfg.get("qk_norm", "none") != "none":
        variant.append(f"qk-norm {cfg['qk_norm']}")
    return " ".join(parts) + " · " + ", ".join(variant)


def header_table(result: Any, ctx: ReportContext) -> Table:
    """Model config, parameter count, source (format, iteration), data, tokens measured, seeds, theory, loss."""
    h = result.header
    t = Table.grid(padding=(0, 2))
    t.add_column(no_wrap=True)
    t.add_column(overflow="fold")
    _kv(t, "model", f"{h.model_class} {_config_line(h.config, getattr(h, 'kv_heads', None))}")
    dtype = getattr(h, "dtype", "") or ctx.dtype
    if getattr(h, "dtype", "") and getattr(h, "dtype_note", ""):
        dtype += f" ({h.dtype_note})"
    _kv(t, "parameters", f"{h.parameter_count:,} on {getattr(h, 'device', '') or ctx.device}, dtype {dtype}")
    _kv(t, "source", getattr(h, "source", "") or ctx.source)
    _kv(t, "tokens", f"{h.tokens_measured:,} measured = {h.seeds} seed(s) x {h.batches} batch(es) x "
                     f"{h.batch_size} x {h.seq_len}; {getattr(h, 'data', '') or ctx.data or h.token_source}")
    seeds = f"seed {h.seed}" if h.seeds == 1 else f"seeds {h.seed}..{h.seed + h.seeds - 1}"
    init = f", init {h.init}" if h.init else ""
    rules = _theories(result)
    if h.theory in ("off", "none"):  # "none": documents written before the header said "off"
        _kv(t, "theory", f"off: measurement only, no predictions{init}; {seeds}")
    else:
        scope = _interval_scope(h)
        _kv(t, "theory", f"{h.theory}{rules}{init}; {seeds}" + (f"; 99% intervals over {scope}" if scope else ""))
    declared = getattr(h, "declared", "")
    if declared:
        state = {True: "fresh (at its declared init)", False: "trained (moved off its declared init)",
                 None: "fresh or trained unknown"}[getattr(h, "fresh", None)]
        kinds = getattr(h, "kinds", None)
        _kv(t, "init", f"declared: {declared}; " + (_kind_states(kinds) if kinds else state))
    loss = Text(f"{num(h.loss, 4)}")
    if h.loss_uniform is not None:
        loss.append(f" (uniform guess ln V = {num(h.loss_uniform, 4)})", style="dim")
        # a model not at its declared init (trained, or nothing declared) on uniform random tokens
        trained = ctx.random_trained or (h.token_source == "random" and getattr(h, "fresh", None) is not True)
        if trained and h.loss is not None and h.loss > h.loss_uniform:
            # on uniform targets the loss is ln V + KL(uniform || p): above ln V for any model whose predictions
            # are not uniform, so it measures how confident the model is, not how well it predicts text
            loss.append("; above ln V because the tokens are random, not because the model is broken: "
                        "cross-entropy on uniform targets is ln V plus how far the model's predictions are "
                        "from uniform", style="dim")
    _kv(t, "loss", loss)
    return t


def _kind_states(kinds: list[dict]) -> str:
    """Per weight kind, fresh / misscaled (with its factor and blocks) / trained, in words."""
    def blocks(k: dict) -> str:
        b = k.get("blocks") or []
        return "" if not b else f" blocks {b[0]}-{b[-1]}" if b == list(range(b[0], b[-1] + 1)) and len(b) > 1 \
            else " block" + ("s " if len(b) > 1 else " ") + ",".join(map(str, b))
    by = {s: [k for k in kinds if k.get("state") == s] for s in ("fresh", "misscaled", "trained")}
    parts = []
    if by["misscaled"]:
        parts.append("misscaled " + ", ".join(f"{k['kind']} x{num(k['factor'], 3)}{blocks(k)}"
                                              for k in by["misscaled"]))
    for s, words in (("trained", "trained (moved off its declared init)"), ("fresh", "fresh (at its declared init)")):
        if by[s]:
            names = [k["kind"] for k in by[s]]
            parts.append(f"{words}: " + ("all kinds" if len(names) == len(kinds) else
                                          "every other kind" if parts and len(names) > 6 else ", ".join(names)))
    return "; ".join(parts)


def _interval_scope(header: Any) -> str:
    """What the 99% intervals cover: the header's words, or for a document written before the header
    held them :func:`diagnostics.interval_scope` (imported here, so that importing this module does
    not import torch)."""
    if getattr(header, "interval", ""):
        return header.interval
    from diagnostics import interval_scope

    return interval_scope(header)


def _uses_kernel(result: Any, direction: str | None = None) -> bool:
    """Whether any prediction (of ``direction``, or either) was made by the token-kernel theory (its
    rules start with "kernel")."""
    return any(getattr(r, "rule", "").startswith("kernel") for r in result.tensors
               if direction is None or r.direction == direction)


def _theories(result: Any) -> str:
    """" (forward: ...; backward: ...)": which theory made each direction's predictions, when a kernel
    theory made any ("" otherwise)."""
    if not _uses_kernel(result):
        return ""
    names = {True: "token-kernel theory", False: "independent-token rules"}
    return (f" (forward: {names[_uses_kernel(result, 'forward')]}; "
            f"backward: {names[_uses_kernel(result, 'backward')]})")


#: words of each cause a finding can name (diagnostics.judge.causes.CAUSES, repeated here so that
#: the report reads a result document without importing the judge)
_CAUSE_WORDS = {
    "non_finite": "non-finite values", "score_scale": "attention scores not scaled by 1/sqrt(d_k)",
    "saturated_attention": "saturated attention", "dead_units": "dead units", "init_scale": "badly scaled weights",
    "kind_scale": "one weight kind misscaled",
    "no_norm": "no normalisation", "post_norm_depth": "deep post-norm", "logit_scale": "logits too large",
    "attn_logits": "attention logits growing", "attn_entropy": "attention entropy collapse",
    "output_logits": "output logits drifting", "massive_activations": "massive activations",
    "unclear": "cause unclear",
}


#: the checks without which a diagnosis is "not judged" (diagnostics.result.STREAM_FORWARD and LOSS),
#: those the healthy sentence names (it is said only when all were made), and --check's exit code for
#: "not judged" (reports.cmd_diagnose.EXIT_NOT_JUDGED); repeated here so that drawing a result
#: document imports neither torch nor the command
_CORE = ("residual stream gains (forward)", "loss against ln V")
_SENTENCE = ("residual stream gains (forward)", "exactly-zero (dead) tensors", "attention (saturated rows)",
             "non-finite values")
_EXIT_NOT_JUDGED = 5


def _coverage_lines(result: Any) -> list[Text]:
    """"checked: ..." and "not checked: checks: why; ..." (the checks that share a reason together)
    under the verdict (none for a document written before the result recorded them)."""
    judged = getattr(result, "judged", None)
    if judged is None:
        return []
    lines = [Text("checked: ", style="bold dim")]
    lines[0].append(", ".join(judged) or "nothing", style="dim")
    if result.not_judged:
        by_reason: dict[str, list[str]] = {}
        for check, why in result.not_judged:
            by_reason.setdefault(why, []).append(check)
        t = Text("not checked: ", style="bold dim")
        t.append("; ".join(f"{', '.join(checks)}: {why}" for why, checks in by_reason.items()), style="dim")
        lines.append(t)
    return lines


def _finding_row(f: Any) -> tuple[Text, Text]:
    style = VERDICT_STYLE.get(f.kind, "bold")
    warn = getattr(f, "severity", "fail") == "warn"
    line = Text("WARN " if warn else "FAIL ", style="bold yellow" if warn else "bold red")
    line.append(verdict_text(f.kind).upper(), style=style)
    where = f.where
    extra = [x for x in (f"block {f.block}" if f.block is not None else "", f.direction or "") if x]
    if extra:
        where += f" ({', '.join(extra)})"
    line.append(f"  {where}: ", style="bold")
    line.append(f.message)
    stat = f.statistic or "value"
    line.append(f"\n{stat} = {num(f.value)}, threshold {num(f.threshold)}", style="dim")
    cause = getattr(f, "cause", "")
    if cause:
        line.append("\ncause: ", style="bold")
        line.append(_CAUSE_WORDS.get(cause, cause))
    if f.suggestion:
        line.append("\n→ try: ", style="bold")
        line.append(f.suggestion)
    return Text("!" if warn else "✗", style="bold yellow" if warn else style), line


def verdict_panel(result: Any, ctx: ReportContext | None = None, max_findings: int = 6) -> Panel:
    """The verdict in plain words: healthy, or each finding with its number, threshold and suggestion."""
    ctx = ctx or ReportContext()
    body: list[RenderableType] = []
    # The loader's list of non-finite weights is shown only when no finding already reports them.
    nonfinite = [] if any(f.kind == "non_finite" for f in result.findings) else list(ctx.nonfinite_params)
    judged = getattr(result, "judged", None)
    status = getattr(result, "status", "")
    if not result.findings and not nonfinite and status == "not judged":
        missing = dict(result.not_judged)
        t = Text("? NOT JUDGED", style="bold magenta")
        reasons = dict.fromkeys(missing[c] for c in _CORE if c in missing)
        t.append(": " + "; ".join(reasons) + f"; --check exits {_EXIT_NOT_JUDGED}", style="magenta")
        body.append(t)
        title, border = "verdict: not judged", "magenta"
    elif not result.findings and not nonfinite:
        t = Text("✓ HEALTHY", style="bold green")
        if judged is None or set(_SENTENCE) <= set(judged):
            t.append(": no tensor vanishes, explodes, dies, saturates or turns non-finite", style="green")
        else:
            t.append(": no finding among the checks below", style="green")
        h = result.header
        if h.loss_uniform is not None:
            t.append(f"; loss {num(h.loss, 4)} vs ln V {num(h.loss_uniform, 4)}", style="dim")
        body.append(t)
        title, border = "verdict: healthy", "green"
    else:
        warns = [f for f in result.findings if getattr(f, "severity", "fail") == "warn"]
        n = len(result.findings) - len(warns) + (1 if nonfinite else 0)
        kinds = sorted({verdict_text(f.kind) for f in result.findings} | ({"non-finite"} if nonfinite else set()))
        w = f"{len(warns)} warning{'s' if len(warns) != 1 else ''}"
        if n:
            head = Text(f"✗ NOT HEALTHY: {n} {'failing ' if warns else ''}finding{'s' if n != 1 else ''}"
                        + (f" and {w}" if warns else ""), style="bold red")
            head.append(f" ({', '.join(kinds)}); --check exits 1", style="red")
        else:
            head = Text(f"! HEALTHY, WITH {w.upper()}: it trains, with care", style="bold yellow")
            head.append(f" ({', '.join(kinds)}); --check exits 0, --check=warn exits 1", style="yellow")
        body.append(head)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        if nonfinite:
            t = Text("NON-FINITE WEIGHTS", style=VERDICT_STYLE["non_finite"])
            t.append(f"  {len(nonfinite)} parameter(s) hold NaN or inf: {', '.join(nonfinite[:4])}"
                     f"{' ...' if len(nonfinite) > 4 else ''}")
            grid.add_row(Text("✗", style="bold red"), t)
        for f in result.findings[:max_findings]:
            grid.add_row(*_finding_row(f))
        body.append(grid)
        if len(result.findings) > max_findings:
            body.append(Text(f"... and {len(result.findings) - max_findings} more (see the table below and --json)",
                             style="dim"))
        title, border = ("verdict: not healthy", "red") if n else ("verdict: healthy, with warnings", "yellow")
    body += _coverage_lines(result)
    return Panel(Group(*body), title=title, title_align="left", border_style=border, box=box.ROUNDED)


def _depth_label(row: Any) -> str:
    return "embed" if row.index == 0 else f"block {row.index - 1}"


def depth_chart(result: Any) -> DepthChart:
    """The residual stream over depth: forward variance and its gradient's, each beside its prediction."""
    rows = result.depth
    labels = [_depth_label(r) for r in rows]
    valid = {(r.name, r.direction): r.valid for r in result.tensors if r.predicted is not None}
    fwd = DepthSeries("forward: residual variance", [r.forward_var for r in rows],
                      [r.forward_predicted for r in rows], style="cyan",
                      valid=[valid.get((r.name, "forward"), True) for r in rows])
    bwd = DepthSeries("backward: gradient variance", [r.backward_var for r in rows],
                      [r.backward_predicted for r in rows], style="magenta",
                      valid=[valid.get((r.name, "backward"), True) for r in rows])
    return DepthChart(labels, [fwd, bwd], title="Variance over depth (residual stream)")


SEVERITY = ("non_finite", "exploding", "vanishing", "dead", "saturated", "misscaled", "imbalanced")


def _verdict_cell(kinds: Iterable[str], note: str = "") -> Text:
    """The worst verdict as a coloured word (``+N`` when the row has N more kinds), ``ok`` otherwise."""
    bad = list(dict.fromkeys(k for k in kinds if k and k != "ok"))
    if not bad:
        t = Text("ok", style=VERDICT_STYLE["ok"])
    else:
        bad.sort(key=lambda k: SEVERITY.index(k) if k in SEVERITY else len(SEVERITY))
        t = Text(verdict_text(bad[0]), style=VERDICT_STYLE.get(bad[0], "bold"))
        if len(bad) > 1:
            t.append(f" +{len(bad) - 1}", style="dim")
    if note:
        t.append(f" {note}", style="dim")
    return t


def _param_index(result: Any) -> dict[str, Any]:
    return {p.name: p for p in result.params}


def _weight_for(name: str, kind: str, params: dict[str, Any]) -> Any:
    for suffix in _WEIGHT_OF.get(kind, ()):
        p = params.get(name + suffix)
        if p is not None:
            return p
    return None


def _selected(result: Any, all_tensors: bool) -> list[str]:
    """Tensor names in the order they were produced: the summary kinds plus anything flagged."""
    names: list[str] = []
    flagged = {f.where for f in result.findings}
    for r in result.tensors:
        if r.name in names:
            continue
        if all_tensors or r.kind in SUMMARY_KINDS or r.name in flagged:
            names.append(r.name)
    return names


class LayerTable:
    """One row per tensor: forward variance vs predicted, ratio with its 99% interval, gradient variance
    vs predicted, weight std / declared init std, and the verdict in words.

    A renderable that fits itself to the width without cutting a number: from 110 columns
    everything with three significant digits; below, two digits and compact intervals, then,
    one step at a time while the table is still too wide, short names (``L3.attn``), and w/init,
    the gradient's prediction, the forward prediction and the interval left out (the ratio
    stays: it is measured over predicted).
    """

    #: the columns left out, in order, while the table is too wide
    DROP_ORDER = ("names", "w/init", "grad pred", "fwd pred", "interval")

    def __init__(self, result: Any, all_tensors: bool = False) -> None:
        self.result = result
        self.all_tensors = all_tensors

    def layouts(self, width: int) -> list[Any]:
        """The layouts tried for ``width``, fullest first (each a function that builds the table)."""
        if width >= 110:
            return [lambda: self.table(width)]
        drops = [self.DROP_ORDER[:k] for k in range(len(self.DROP_ORDER) + 1)]
        return [lambda d=d: self.table(width, drop=d) for d in drops]

    def table(self, width: int = 120, drop: Sequence[str] = ()) -> Table:
        """The table laid out for ``width`` columns, without the columns named in ``drop``
        (any of :attr:`DROP_ORDER`)."""
        compact = width < 110
        d = 2 if compact else 3

        def n(v: Any) -> str:
            text = num(v, d)
            return num(v, 1) if compact and len(text) > 6 else text  # 9.0e-10 -> 9e-10

        def interval(r: Any) -> str:
            if r.predicted is not None and not r.valid:  # a premise that fails gives no ratio to read
                return "-*"
            if "interval" in drop:
                return ratio_interval(r.ratio, None, None, d)
            return ratio_interval(r.ratio, r.ratio_low, r.ratio_high, d, "," if compact else ", ")

        result = self.result
        rows = {(r.name, r.direction): r for r in result.tensors}
        params = _param_index(result)
        predicted = any(r.predicted is not None for r in result.tensors)
        show = {c: c not in drop for c in self.DROP_ORDER}
        if not predicted:  # theory off, or none for this model: no prediction columns at all
            show.update({"fwd pred": False, "grad pred": False, "interval": False})
        scope = _interval_scope(result.header)
        parts = []
        if not predicted:
            parts.append("theory off: measurement only" if result.header.theory == "off"
                         else "no predictions for this model")
        elif show["interval"]:
            parts.append("ratio = measured/predicted, geometric mean over replicates [99% interval"
                         + (f" over {scope}" if scope else "") + ": Student-t on ln(ratio), so asymmetric and > 0]")
        else:
            parts.append("ratio = measured/predicted, geometric mean over replicates"
                         + (f" ({scope})" if scope else ""))
        if _uses_kernel(result):
            parts.append("pred: " + _theories(result).strip(" ()").replace(":", " by the").replace(";", ","))
        if show["w/init"]:
            parts.append("w/init = weight std / declared init std")
        if predicted:
            parts.append("* = prediction outside its validity (no ratio shown; --json has it and why)")
        if "names" in drop:
            parts.append("Ln = layers.n, tok_emb = token_embeddings")
        left_out = [c for c in drop if c != "names" and (predicted or c == "w/init")]
        if left_out:
            parts.append(f"left out at this width: {', '.join(left_out)} (see --width or --json)")
        caption = "; ".join(parts)
        t = Table(box=box.SIMPLE_HEAD, padding=(0, 1) if not compact else (0, 1, 0, 0), pad_edge=False,
                  show_edge=False, title="Per layer", title_justify="left", title_style="bold", caption=caption,
                  caption_justify="left", caption_style="dim")
        # text columns fold when nothing else helps; number columns never shrink below their digits
        t.add_column("tensor", overflow="fold")
        t.add_column("fwd" if compact else "fwd var", justify="right", no_wrap=True)
        if show["fwd pred"]:
            t.add_column("pred", justify="right", no_wrap=True)
        if predicted:
            t.add_column("ratio [99%]" if show["interval"] else "ratio", justify="right", no_wrap=True)
        t.add_column("grad" if compact else "grad var", justify="right", no_wrap=True)
        if show["grad pred"]:
            t.add_column("pred", justify="right", no_wrap=True)
        if show["w/init"]:
            t.add_column("w/init", justify="right", no_wrap=True)
        t.add_column("flags", overflow="fold")
        for name in _selected(result, self.all_tensors):
            f, b = rows.get((name, "forward")), rows.get((name, "backward"))
            w = _weight_for(name, (f or b).kind, params)
            kinds = [r.verdict for r in (f, b) if r is not None] + ([w.verdict] if w is not None else [])
            invalid = any(r is not None and r.predicted is not None and not r.valid for r in (f, b))

            def pred(r: Any) -> str:
                if r is None:
                    return "-"
                return n(r.predicted) + ("*" if r.predicted is not None and not r.valid else "")

            cells: list[Any] = [short_name(name) if "names" in drop else name, n(f.var) if f else "-"]
            if show["fwd pred"]:
                cells.append(pred(f))
            if predicted:
                cells.append(interval(f) if f else "-")
            cells.append(n(b.var) if b else "-")
            if show["grad pred"]:
                cells.append(pred(b))
            if show["w/init"]:
                cells.append("-" if w is None or w.drift is None else f"{w.drift:.2f}")
            cells.append(_verdict_cell(kinds, "*" if invalid else ""))
            t.add_row(*cells)
        return t

    def __rich_console__(self, console: Any, options: Any):
        yield first_that_fits(self.layouts(options.max_width), options.max_width)


def layer_table(result: Any, all_tensors: bool = False, width: int = 120) -> Table:
    """The per-layer table as a rich Table laid out for ``width`` columns (see :class:`LayerTable`)."""
    return first_that_fits(LayerTable(result, all_tensors).layouts(width), width)


def attention_table(result: Any, drop: Sequence[str] = ()) -> Table:
    """Per attention layer: score std, entropy (mean, min, uniform), saturated rows, and the
    rank-collapse signal: mean cosine similarity between tokens after that block, measured and,
    where theory predicts it (the token-kernel theory, global mode), predicted beside it.

    ``drop`` (any of :attr:`AttentionTable.DROP_ORDER`) narrows it: "uniform" moves the uniform
    entropy to the caption when every block shares it, "short" abbreviates the headings, "min"
    and "pred" leave those columns out.
    """
    cos_after = {r.index - 1: _measured(r.cosine) for r in result.depth if r.index >= 1}
    measured = any(_measured(r.cosine) is not None for r in result.depth)
    # a predicted cosine is outside validity where its tensor's forward prediction is (the table's "*")
    invalid = {r.name for r in result.tensors if r.direction == "forward" and r.predicted is not None and not r.valid}

    def predicted_text(r: Any) -> str:
        v = getattr(r, "cosine_predicted", None)
        return "-" if v is None else num(v) + ("*" if r.name in invalid else "")

    pred_after = {r.index - 1: predicted_text(r) for r in result.depth if r.index >= 1}
    embed = next((r for r in result.depth if r.index == 0), None)
    predicted = any(getattr(r, "cosine_predicted", None) is not None for r in result.depth)
    uniforms = {num(a.entropy_uniform) for a in result.attention}
    show_uniform = "uniform" not in drop or len(uniforms) > 1
    show_min, show_pred = "min" not in drop, predicted and "pred" not in drop
    short = "short" in drop
    caption = "entropy in nats (uniform: causal attention spread evenly"
    if not show_uniform and uniforms:
        caption += f", {uniforms.pop()} here"
    caption += "); saturated: rows with max prob > 0.99; cosine: between tokens after the block (towards 1 = rank collapse)"
    if not measured:
        caption += ", not measured for this model (- in the table)"
    if show_pred:
        caption += ", pred: as the token-kernel theory predicts it (* = outside its validity)"
    if embed is not None and _measured(embed.cosine) is not None:
        caption += f"; after the embedding {num(embed.cosine)}"
        if getattr(embed, "cosine_predicted", None) is not None:
            caption += f" (pred {predicted_text(embed)})"
    if short:
        caption += "; std: score std, H: entropy, sat: saturated, cos: cosine"
    left_out = [c for c in ("min", "pred") if c in drop and (c != "pred" or predicted)]
    if left_out:
        caption += f"; left out at this width: {', '.join(left_out)}"
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, title="Attention and rank collapse",
              title_justify="left", title_style="bold", caption=caption, caption_justify="left", caption_style="dim")
    labels = {"block": "blk", "score std": "std", "entropy": "H", "min": "H min", "uniform": "uniform",
              "saturated": "sat", "cosine": "cos", "pred": "pred"}
    columns = ["block", "score std", "entropy"] + (["min"] if show_min else []) + (["uniform"] if show_uniform else []) \
        + ["saturated", "cosine"] + (["pred"] if show_pred else [])
    for col in columns:
        t.add_column(labels[col] if short else col, justify="right", no_wrap=True)
    t.add_column("flags", min_width=9 if not short else None, overflow="fold")

    def cells(a: Any) -> list[str]:
        values = {"score std": num(a.score_std), "entropy": num(a.entropy_mean), "min": num(a.entropy_min),
                  "uniform": num(a.entropy_uniform), "saturated": pct(a.saturated_frac)}
        return [values[c] for c in columns if c in values]

    def cosines(blk: int) -> tuple[str, ...]:
        return (num(cos_after.get(blk)),) + ((pred_after.get(blk, "-"),) if show_pred else ())

    blocks_seen = set()
    for a in result.attention:
        blocks_seen.add(a.block)
        t.add_row(str(a.block), *cells(a), *cosines(a.block), _verdict_cell([a.verdict]))
    for blk in sorted(set(cos_after) - blocks_seen):  # blocks without an attention row still show cosine
        t.add_row(str(blk), *["-"] * (len(columns) - 2 - show_pred), *cosines(blk), Text("-"))
    return t


def _measured(cosine: float | None) -> float | None:
    """A cosine as measured, None where it was not (None, or NaN in a document written before None)."""
    return None if cosine is None or (isinstance(cosine, float) and math.isnan(cosine)) else cosine


class AttentionTable:
    """:func:`attention_table` as a renderable that fits itself to the width without cutting a
    number: the uniform entropy moves to the caption, the headings shorten, then the min
    entropy and the predicted cosine are left out, one at a time, while it is too wide."""

    DROP_ORDER = ("uniform", "short", "min", "pred")

    def __init__(self, result: Any) -> None:
        self.result = result

    def layouts(self) -> list[Any]:
        drops = [self.DROP_ORDER[:k] for k in range(len(self.DROP_ORDER) + 1)]
        return [lambda d=d: attention_table(self.result, d) for d in drops]

    def __rich_console__(self, console: Any, options: Any):
        yield first_that_fits(self.layouts(), options.max_width)


def report(result: Any, ctx: ReportContext | None = None, extra: Sequence[RenderableType] = ()) -> Group:
    """The whole report, in reading order: header, verdict, depth chart, per-layer table, attention panel, extras."""
    ctx = ctx or ReportContext()
    parts: list[RenderableType] = [header_table(result, ctx), Text(""), verdict_panel(result, ctx)]
    if result.depth:
        parts += [Text(""), depth_chart(result)]
    parts += [Text(""), LayerTable(result, ctx.all_tensors)]
    if result.attention or result.depth:
        parts += [AttentionTable(result)]
    for e in extra:
        parts += [Text(""), e]
    return Group(*parts)


def report_text(result: Any, width: int = 100) -> str:
    """The report :func:`report` draws, as plain text ``width`` columns wide (no colour codes): what
    ``print(result)`` shows of a DiagnoseResult (the "text" renderer of the entry-point group
    "tinylm.renderers"). Anything else is drawn by ``str`` of its dataclass fields."""
    import io

    from rich.console import Console

    from diagnostics import DiagnoseResult

    if not isinstance(result, DiagnoseResult):
        raise TypeError(f"reports.render.report_text: cannot draw a {type(result).__name__}; pass a DiagnoseResult")
    out = io.StringIO()
    Console(file=out, width=width, highlight=False, color_system=None, force_terminal=False,
            legacy_windows=False).print(report(result))
    return out.getvalue()

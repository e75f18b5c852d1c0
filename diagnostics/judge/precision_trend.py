"""A GEMM's SQNR in a low-precision recipe falling against its own first record (the watch's
precision trend, :mod:`diagnostics.jobs.watch_precision`).

fp8 training diverges late (Fishman et al. 2024): the operands' range grows as training goes on
(massive activations, Sun et al. 2024; the SwiGLU product as its two weight vectors align) until
one scale no longer holds them. So each GEMM (module, fprop / dgrad / wgrad) is judged against
itself: its baseline is its judged SQNR at the first record that measured it, and it is past at a
record when

    baseline - SQNR  >  drop_db        (the history header's "precision" entry; 6 dB by default)

It is reported (``precision_drop``, a warn: the run itself is in its own precision, the recipe's
run would lose it) at the first record of each run of records past, once per run. The cause names
what grew with it: the layer's input's peak / median against its own first record (a massive
activation; into w2 / down_proj: the SwiGLU product), or the gradient's, or the share of entries
sent to zero; the fix is a finer scaling (rowwise or MXFP8) for tensorwise, Smooth-SwiGLU for the
SwiGLU product, else keeping the module in bf16. Every function reads the history dict only.
"""

from __future__ import annotations

import math
from typing import Any

from .precision import _fix, module_role

__all__ = ["precision_alerts", "record_modules", "SIGNAL"]

SIGNAL = "precision_drop"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def record_modules(rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{module: its figures} of a record's "precision" entry (none where it is missing or not of that shape)."""
    got = rec.get("precision")
    mods = got.get("modules") if isinstance(got, dict) else None
    return {k: v for k, v in mods.items() if isinstance(v, dict)} if isinstance(mods, dict) else {}


def _first(records: list[dict[str, Any]], k: int, module: str, key: str) -> tuple[int, float] | None:
    """(index, value) of the first record up to k where ``module``'s ``key`` is a finite number."""
    for j in range(k + 1):
        v = record_modules(records[j]).get(module, {}).get(key)
        if _finite(v):
            return j, float(v)
    return None


def _past(records: list[dict[str, Any]], j: int, module: str, gm: str, start: float, drop: float) -> bool:
    v = record_modules(records[j]).get(module, {}).get(gm) if j >= 0 else None
    return v is not None and (v == -math.inf or (_finite(v) and start - float(v) > drop))


def _why(records: list[dict[str, Any]], k: int, module: str, gm: str, role: str) -> str:
    """What grew with the drop: the input's or the gradient's peak / median, or the underflow."""
    now = record_modules(records[k])[module]
    parts = []
    for key, what in (("input_peak", "its input's"), ("grad_peak", "its output gradient's")):
        if key == "input_peak" and gm == "dgrad" or key == "grad_peak" and gm == "fprop":
            continue
        first = _first(records, k, module, key)
        if first is not None and _finite(now.get(key)) and first[1] > 0 and now[key] >= 4 * first[1]:
            what_in = "the SwiGLU product's" if key == "input_peak" and role == "swiglu_product" else what
            parts.append(f"{what_in} peak / median grew {now[key] / first[1]:.3g}x to {now[key]:.3g} "
                         "(a massive activation)" if key == "input_peak" else
                         f"{what_in} peak / median grew {now[key] / first[1]:.3g}x to {now[key]:.3g}")
    if _finite(now.get("underflow")) and now["underflow"] >= 0.01:
        parts.append(f"{now['underflow']:.1%} of the operands' non-zero entries flush to zero")
    return "; ".join(parts) or "the operands' range grew wider than one scale holds"


def precision_alerts(history: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """The precision_drop alerts first due at record k (module docstring), each as the fields of
    a :class:`diagnostics.judge.precursors.Alert`; none when the history has no precision trend."""
    head = history.get("precision")
    records = history.get("records") or []
    if not isinstance(head, dict) or k >= len(records):
        return []
    drop = float(head.get("drop_db", 6.0))
    recipe = str(head.get("recipe", "the recipe"))
    products = set(head.get("products") or ())
    out = []
    for module, now in record_modules(records[k]).items():
        role = "swiglu_product" if module in products else module_role(module, False)
        for gm in ("fprop", "dgrad", "wgrad"):
            first = _first(records, k, module, gm)
            if first is None or first[0] == k or not _past(records, k, module, gm, first[1], drop):
                continue
            if _past(records, k - 1, module, gm, first[1], drop):
                continue  # reported when its run began
            out.append(_alert(records, k, module, gm, first, float(now[gm]), drop, recipe, role))
    return out


def _alert(records, k, module, gm, first, value, drop, recipe, role) -> dict[str, Any]:
    step, since = int(records[k]["step"]), int(records[first[0]]["step"])
    start = first[1]
    where = " (the SwiGLU product into the down projection)" if role == "swiglu_product" else ""
    cause = (f"{recipe} SQNR of {module}{where} ({gm}) fell {start - value:.1f} dB from {start:.1f} dB at step "
             f"{since} to {value:.1f} dB: {_why(records, k, module, gm, role)}; fp8 training diverges late, as "
             "the operands' range grows (Fishman et al. 2024)")
    fix = _fix(recipe, role)
    message = (f"step {step}: {SIGNAL} at {module} ({gm}): {recipe} SQNR = {value:.1f} dB < {start - drop:.1f} "
               f"(its first record's {start:.1f} dB - {drop:g}); cause: {cause}; fix: {fix}")
    return dict(step=step, severity="warn", signal=SIGNAL, site=module, value=value, threshold=start - drop,
                rising=0, since=step, cause=cause, fix=fix, ruled_out="", message=message)

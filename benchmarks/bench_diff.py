"""Cost and calibration of ``diagnostics.diff``.

    python benchmarks/bench_diff.py [--threads N] [--repeats 5] [--batch 4] [--seq 256]
    python benchmarks/bench_diff.py --calibrate [--models small,gpt2ish,tinystories] [--csv rows.csv]
                                    [--compiled] [--only TEXT]

Cost (default): the tinystories preset and an identical copy, at --batch x --seq tokens. One
"bare" pass is a forward and backward of both models (next-token cross-entropy), no hooks; one
diff pass is ``diff(reference, candidate)`` (two forward+backward passes with every site
sketched, then the comparison). Both run in this one process, alternating, after a warm-up
each; the printed figure is the median over --repeats of diff / bare within a pair (target <= 3).
The torch thread count is printed with it.

--calibrate: pairs of executions that are equal in exact arithmetic, each compared by ``diff``
(every site, both directions), and the negative controls. Printed per pair: the largest
departure/tolerance (forward, backward) under the default ``Tolerance`` and the largest
departure over ((u_store + u_acc sqrt(w)) (1 + a l)) (the constant c would have to exceed for
the pair to pass); --csv writes every row. docs/diff.md holds the table this prints.
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tinylm  # noqa: E402
from diagnostics import DiffOptions, diff  # noqa: E402
from diagnostics.jobs.diff import diff_against  # noqa: E402
from diagnostics.judge.departure import Tolerance  # noqa: E402

MODELS = {
    "small": (dict(vocab_size=256, context_length=64, d_model=64, num_layers=4, num_heads=4, d_ff=128), 4, 64),
    "gpt2ish": (("gpt2-tiny", dict(vocab_size=256, num_layers=4)), 4, 64),
    "tinystories": ("tinystories", 4, 256),
}


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, DiffOptions]:
    spec, batch, seq = MODELS[name]
    if isinstance(spec, str):
        config = tinylm.preset(spec)
    elif isinstance(spec, tuple):
        config = tinylm.preset(spec[0], **spec[1])
    else:
        config = tinylm.ModelConfig(**spec)
    model = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(seed))
    return model.eval(), DiffOptions(batch_size=batch, seq_len=seq)


def perturb(model: torch.nn.Module, name: str, relative: float, seed: int = 0) -> torch.nn.Module:
    """A copy with parameter ``name`` moved by ``relative`` of its Frobenius norm in a random direction."""
    twin = copy.deepcopy(model)
    w = dict(twin.named_parameters())[name]
    e = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with torch.no_grad():
        w.add_((relative * w.double().norm() * e / e.norm()).to(w.dtype))
    return twin


# ----------------------------------------------------------------------------- cost


def _bare(models, tokens) -> None:
    for m in models:
        logits = m(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        m.zero_grad(set_to_none=True)


def cost(args) -> None:
    model, _ = build("tinystories")
    twin = copy.deepcopy(model)
    options = DiffOptions(batch_size=args.batch, seq_len=args.seq)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1))
    _bare((model, twin), tokens)
    diff(model, twin, tokens, options)
    ratios, bare_t, diff_t = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        _bare((model, twin), tokens)
        t1 = time.perf_counter()
        result = diff(model, twin, tokens, options)
        t2 = time.perf_counter()
        bare_t.append(t1 - t0)
        diff_t.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    print(f"tinystories x2, {args.batch}x{args.seq} tokens, torch threads {torch.get_num_threads()}")
    print(f"bare forward+backward of both: median {statistics.median(bare_t):.3f} s")
    print(f"diff:                          median {statistics.median(diff_t):.3f} s  ({result})")
    print(f"diff / bare, median over {args.repeats} pairs: {statistics.median(ratios):.2f} (target <= 3)")


# ----------------------------------------------------------------------------- calibration


def _base(row) -> float:
    """(u_store + u_acc sqrt(w)) (1 + a l) with a = Tolerance().growth: the tolerance over c."""
    t = Tolerance(forward=1.0, backward=1.0)
    return t((row.reference_dtype, row.candidate_dtype), int(row.width), row.depth, row.direction)


def _pairs(name: str, compiled: bool = False):
    """(label, thunk -> DiffResult) of the equivalent pairs on one model."""
    model, opt = build(name)
    bf = DiffOptions(batch_size=opt.batch_size, seq_len=opt.seq_len, reference_dtype="bfloat16",
                     candidate_dtype="bfloat16")
    out = [
        ("fused vs explicit attention, float32", lambda: diff_against(model, "explicit-attention", None, opt)),
        ("1 vs 2 threads, float32", lambda: diff_against(model, "cpu-threads", None, opt, threads=2)),
        ("float64 vs float32", lambda: diff(model, model, None, DiffOptions(**{**_kw(opt), "reference_dtype": "float64"}))),
        ("fused vs explicit attention, bfloat16", lambda: diff_against(model, "explicit-attention", None, bf)),
        ("1 vs 2 threads, bfloat16", lambda: diff_against(model, "cpu-threads", None, bf, threads=2)),
        ("float32 vs bfloat16", lambda: diff_against(model, "bf16", None, opt)),
        ("float32 vs float16", lambda: diff_against(model, "fp16", None, opt)),
        ("batch split in halves, float32", lambda: _batch_split(model, opt)),
    ]
    if compiled:
        out.append(("eager vs torch.compile, float32", lambda: diff_against(model, "compiled", None, opt)))
    return out


def _kw(opt: DiffOptions) -> dict:
    return dict(batch_size=opt.batch_size, seq_len=opt.seq_len)


class _Row:
    """A calibration row computed from full tensors (the batch-split pair)."""

    def __init__(self, site, direction, depth, departure, tolerance):
        self.site, self.direction, self.depth = site, direction, depth
        self.reference_dtype = self.candidate_dtype = "float32"
        self.departure, self.tolerance, self.ratio = departure, tolerance, departure / tolerance


def _capture(model, tokens, total: int) -> dict:
    """{(site, direction): tensor} of every site but the embedding (full tensors), the loss a sum over
    ``total`` tokens so that the gradients of a part are the whole batch's rows."""
    from diagnostics.jobs.fingerprint import diff_sites

    named, out, handles = dict(model.named_modules()), {}, []
    for s in diff_sites(model):
        if s.key in ("logits", "embedding"):
            continue

        def hook(m, i, o, _k=s.key):
            o = o[0] if isinstance(o, tuple) else o
            out[(_k, "forward")] = o.detach().clone()
            o.register_hook(lambda g: out.__setitem__((_k, "backward"), g.detach().clone()))
        handles.append(named[s.module].register_forward_hook(hook))
    try:
        logits = model(tokens[:, :-1])
        out[("logits", "forward")] = logits.detach().clone()
        logits.register_hook(lambda g: out.__setitem__(("logits", "backward"), g.detach().clone()))
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        (ce / total).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return out


def _batch_split(model, opt: DiffOptions):
    """The whole batch against its two halves run apart, compared on full tensors (exact departures)."""
    from diagnostics.jobs.diff import _depth
    from diagnostics.jobs.fingerprint import diff_sites

    tokens = torch.randint(0, model.config.vocab_size, (opt.batch_size, opt.seq_len + 1),
                           generator=torch.Generator().manual_seed(opt.seed))
    total = tokens[:, 1:].numel()
    whole = _capture(model, tokens, total)
    half = opt.batch_size // 2
    parts = [_capture(model, tokens[:half], total), _capture(model, tokens[half:], total)]
    order = {s.key: s.order for s in diff_sites(model)}
    L, tol, rows = model.config.num_layers, Tolerance(), []
    for key, b in whole.items():
        a = torch.cat([parts[0][key], parts[1][key]])
        dep = float((a.double() - b.double()).norm() / b.double().norm())
        depth = _depth(order[key[0]], L, key[1])
        rows.append(_Row(key[0], key[1], depth, dep, tol(("float32", "float32"), model.config.d_model, depth, key[1])))

    class _Result:
        pass
    result = _Result()
    result.rows = rows
    return result


def calibrate(args) -> None:
    rows = []
    for name in args.models.split(","):
        model, _ = build(name)
        width = model.config.d_model
        for label, thunk in _pairs(name, args.compiled):
            if args.only and args.only not in label:
                continue
            t0 = time.perf_counter()
            result = thunk()
            worst = {"forward": 0.0, "backward": 0.0}
            need = {"forward": 0.0, "backward": 0.0}
            for r in result.rows:
                r.width = width
                worst[r.direction] = max(worst[r.direction], r.ratio)
                need[r.direction] = max(need[r.direction], r.departure / _base(r))
                rows.append((name, label, r))
            print(f"{name:12s} {label:40s} max ratio fwd {worst['forward']:.3f} bwd {worst['backward']:.3f}  "
                  f"c needed fwd {need['forward']:.2f} bwd {need['backward']:.2f}  ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
        if not args.only:
            controls(name, model)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["model", "pair", "site", "direction", "depth", "reference_dtype", "candidate_dtype", "width",
                        "departure", "tolerance", "ratio"])
            for name, label, r in rows:
                w.writerow([name, label, r.site, r.direction, r.depth, r.reference_dtype, r.candidate_dtype, r.width,
                            r.departure, r.tolerance, r.ratio])


def controls(name: str, model) -> None:
    """The negative controls: a relative 1e-3 move of one matrix of block 1 in float32 and 1e-1 in bfloat16."""
    _, opt = build(name)
    block = 1
    for pname in (f"layers.{block}.attn.q_proj.weight", f"layers.{block}.attn.output_proj.weight",
                  f"layers.{block}.ffn.w1.weight", f"layers.{block}.ffn.w2.weight"):
        for relative, dtype in ((1e-3, None), (1e-1, "bfloat16")):
            o = DiffOptions(batch_size=opt.batch_size, seq_len=opt.seq_len, reference_dtype=dtype, candidate_dtype=dtype)
            r = diff(model, perturb(model, pname, relative), None, o)
            f = r.first
            where = "none" if f is None else f"{f.site} ({f.direction}) ratio {f.ratio:.1f}"
            ok = f is not None and f.block == block and f.direction == "forward"
            print(f"{name:12s} control {relative:g} {dtype or 'float32':8s} {pname:32s} first: {where} "
                  f"{'ok' if ok else 'MISSED'}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--models", default="small,gpt2ish,tinystories")
    p.add_argument("--csv")
    p.add_argument("--compiled", action="store_true", help="also eager against torch.compile (minutes on a CPU)")
    p.add_argument("--only", help="only the pairs whose label contains this text (no controls)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    calibrate(args) if args.calibrate else cost(args)


if __name__ == "__main__":
    main()

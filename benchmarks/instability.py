"""Score the watch's early warnings on the instability catalog (benchmarks/instability_runs.py).

Each run of the catalog is trained with the watch attached as a user's loop attaches it
(``Watch(model, every=10, optimizer=opt)``; without ``optimizer=`` where the constructor refuses
it) and, in the same run, the catalog's own plain hooks, which give the truth: the departure
step (the failure's onset; see instability_runs.py) and every signal at every 10th step.

Printed: per failure kind, the failing runs, how many the watch warned of before their
departure, the lead (departure step - first alert step; median and worst); per healthy run or
control any alert (false alarms); per signal the most extreme value any healthy run or control
reached beside the threshold of ``diagnostics.Thresholds()`` and the failing runs' values 20 or
more steps before their departure. For each failing run, ``diagnostics.diagnose`` on the model as
it was at the last multiple of 10 at least 20 steps before departure (does it name the kind's
precursor: a finding whose cause is one of :data:`EXPECTED` for the kind?),
and on each healthy run and control at its end (does it fail any?).

    python benchmarks/instability.py [--quick] [--workers N] [--json PATH] [--no-diagnose]

Each worker process uses one thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import instability_runs as IR  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "out" / "instability_watch.json"
LEAD = IR.LEAD

#: the --quick set: one failing run and one healthy run for a few kinds
QUICK = ("attn_logit_growth/tinylm-sdpa/fail", "fp16_overflow/fail", "adam_eps_stall/fail",
         "healthy/tinylm-pre-lr0.003", "healthy/gpt-eager-lr3e-3")

#: the diagnose causes that name each kind's precursor (a kind absent here has none a single
#: measurement of the model can show: Adam's epsilon lives in the optimizer state, underflow in the
#: training precision, a blow-up at step 2 leaves no checkpoint before it)
EXPECTED = {"attn_logit_growth": {"attn_logits", "attn_entropy"},
            "fp16_overflow": {"attn_logits", "attn_entropy", "massive_activations"},
            "init_too_large": {"init_scale"},
            "post_norm_no_warmup": {"post_norm_depth"},
            "no_norm_divergence": {"output_logits", "attn_logits", "massive_activations"}}


def _make_watch(model, opt):
    from diagnostics import Watch

    try:
        watch = Watch(model, every=IR.EVERY, optimizer=opt)
        _make_watch.with_optimizer = True
    except TypeError:  # a watch without the optimizer= keyword
        watch = Watch(model, every=IR.EVERY)
        _make_watch.with_optimizer = False
    return watch


def _alert_dict(a: Any) -> dict[str, Any]:
    keys = ("step", "severity", "signal", "site", "value", "threshold", "cause", "message")
    return {k: getattr(a, k, None) if not isinstance(getattr(a, k, None), float) else float(getattr(a, k))
            for k in keys}


def _worker(name: str) -> dict[str, Any]:
    """Train one run with the watch and the truth hooks; its losses, records, alerts, events,
    failure, and the snapshots (failing runs) or the final state (others) for diagnose."""
    torch.set_num_threads(1)
    run = IR.by_name(name)
    seen: list[dict[str, Any]] = []

    def on_record(t, model, report):
        seen.extend(_alert_dict(a) for a in getattr(report, "alerts", None) or [])

    res = IR.train(run, watch_factory=_make_watch, on_record=on_record, snapshots=run.role == "fail",
                   stop_after=30)
    watch = res.pop("watch")
    model = res.pop("model")
    every_alert = getattr(watch, "alerts", None)
    alerts = [_alert_dict(a) for a in every_alert] if every_alert is not None else seen
    failure = watch.failure
    res["alerts"] = alerts
    res["failure"] = None if failure is None else {"step": failure.step, "verdict": failure.verdict,
                                                   "site": failure.site, "message": failure.message}
    res["events"] = [e.to_dict() for e in watch.events]
    res["watch_optimizer"] = _make_watch.with_optimizer
    watch.close()
    if run.role != "fail":
        res["final_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    res["threads"] = torch.get_num_threads()
    return res


def _tokens(run: IR.Run, n: int = 32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    x, y = IR.batch(gen, n, run.ctx)
    return torch.cat([x, y[:, -1:]], dim=1)  # (n, ctx + 1) windows


def _diagnose(job: tuple[str, int | None, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """diagnose on the run's model with the given state; its findings and whether one names a precursor."""
    torch.set_num_threads(1)
    import diagnostics
    from diagnostics import DiagnoseOptions

    name, step, state = job
    run = IR.by_name(name)
    model = IR.build(run)
    model.load_state_dict(state)
    try:
        result = diagnostics.diagnose(model, _tokens(run), DiagnoseOptions(batch_size=8, seq_len=run.ctx, batches=2,
                                                                         theory="off"))
    except Exception as e:  # a diagnose that cannot run on a state is reported, not fatal
        return dict(name=name, step=step, error=f"{type(e).__name__}: {e}")
    findings = [dict(kind=f.kind, cause=f.cause, severity=f.severity, where=f.where, message=f.message)
                for f in result.findings]
    names = [f for f in findings if f["cause"] in EXPECTED.get(run.kind, set())]
    return dict(name=name, step=step, status=result.status, findings=findings, precursor=bool(names),
                precursor_findings=names)


# ----------------------------------------------------------------------------- scoring


def first_alert(res: dict[str, Any]) -> int | None:
    steps = [a["step"] for a in res["alerts"] if a.get("step") is not None]
    if res.get("failure"):
        steps.append(res["failure"]["step"])
    return min(steps) if steps else None


def score(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per kind: runs, detected before departure, leads; false alarms of healthy runs and controls."""
    kinds: dict[str, dict[str, Any]] = {}
    false_alarms = {}
    for name, res in results.items():
        run, dep = res["run"], res["departure"]
        first = first_alert(res)
        if run["role"] == "fail":
            k = kinds.setdefault(run["kind"], dict(runs=0, departed=0, detected=0, leads=[], rows=[]))
            k["runs"] += 1
            k["departed"] += dep is not None
            early = first is not None and dep is not None and first < dep
            k["detected"] += early
            if early:
                k["leads"].append(dep - first)
            k["rows"].append(dict(name=name, departure=dep, first_alert=first,
                                  signals=sorted({a.get("signal") or "?" for a in res["alerts"]})))
        elif res["alerts"] or res.get("failure"):
            false_alarms[name] = dict(first=first, signals=sorted({a.get("signal") or "?" for a in res["alerts"]}),
                                      failure=res.get("failure"))
    for k in kinds.values():
        k["lead_median"] = statistics.median(k["leads"]) if k["leads"] else None
        k["lead_worst"] = min(k["leads"]) if k["leads"] else None
    return dict(kinds=kinds, false_alarms=false_alarms)


_thresholds = IR.thresholds
signal_table = IR.signal_table


# ----------------------------------------------------------------------------- printing


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def report(results: dict[str, dict[str, Any]], scores: dict[str, Any], table: list[dict[str, Any]],
           diag: list[dict[str, Any]]) -> str:
    out = ["", "per failure kind (lead = departure step - first alert step)",
           f"  {'kind':26s} {'runs':>4s} {'departed':>8s} {'warned':>6s} {'lead med':>8s} {'worst':>6s}"]
    for kind, k in scores["kinds"].items():
        out.append(f"  {kind:26s} {k['runs']:4d} {k['departed']:8d} {k['detected']:6d} {_fmt(k['lead_median']):>8s} "
                   f"{_fmt(k['lead_worst']):>6s}")
        for row in k["rows"]:
            out.append(f"      {row['name']:40s} departure {_fmt(row['departure']):>4s}  first alert "
                       f"{_fmt(row['first_alert']):>4s}  {', '.join(row['signals'])}")
    healthy = [n for n, r in results.items() if r["run"]["role"] != "fail"]
    n_h = sum(1 for n in healthy if results[n]["run"]["role"] == "healthy")
    fa_h = [n for n in scores["false_alarms"] if results[n]["run"]["role"] == "healthy"]
    out.append(f"false alarms: {len(fa_h)} of {n_h} healthy runs; alerts on {len(scores['false_alarms']) - len(fa_h)} "
               f"of {len(healthy) - n_h} controls (a control is stable, not always good: lr_no_warmup's controls "
               "train at the same high LR)")
    for name, fa in scores["false_alarms"].items():
        out.append(f"  {name:40s} first alert step {_fmt(fa['first'])}: {', '.join(fa['signals'])}"
                   + (f"; failure {fa['failure']['verdict']} at {fa['failure']['step']}" if fa["failure"] else ""))
    out += IR.signal_lines(table)
    if diag:
        out += ["", f"diagnose: failing runs at the last multiple of 10 >= {LEAD} steps before departure; "
                    "healthy runs and controls at their end"]
        for d in diag:
            if "error" in d:
                out.append(f"  {d['name']:40s} @{_fmt(d['step'])}: error {d['error']}")
                continue
            kinds = ", ".join(sorted({f"{f['kind']}/{f['cause']}({f['severity']})" for f in d["findings"]})) or "none"
            out.append(f"  {d['name']:40s} @{_fmt(d['step'])}: {d['status']}; precursor named: {d['precursor']}; "
                       f"findings: {kinds}")
    return "\n".join(out)


def _clean(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return None
    return IR._clean(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a reduced set (a few kinds, one failing and one healthy)")
    ap.add_argument("--workers", type=int, default=1, help="processes, one thread each (default 1)")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where the results go")
    ap.add_argument("--only", default="", help="comma-separated substrings of run names")
    ap.add_argument("--no-diagnose", action="store_true", help="skip the diagnose part")
    args = ap.parse_args(argv)
    names = [r.name for r in IR.CATALOG]
    if args.quick:
        names = [n for n in names if n in QUICK]
    if args.only:
        names = [n for n in names if any(s in n for s in args.only.split(","))]
    # a failing run of a kind judged against its control needs the control
    for n in list(names):
        run = IR.by_name(n)
        if run.role == "fail" and run.kind in IR.RELATIVE_KINDS:
            ctrl = next((r.name for r in IR.CATALOG if r.control_of == n), None)
            if ctrl and ctrl not in names:
                names.insert(names.index(n) + 1, ctrl)
    print(f"{len(names)} runs, {args.workers} worker process(es), 1 thread each (OMP_NUM_THREADS=1, "
          f"torch.set_num_threads(1))", flush=True)
    start = time.perf_counter()

    def progress(n: str, res: dict[str, Any]) -> None:
        print(f"  {n:40s} {len(res['losses']):4d} steps {res['seconds']:6.1f}s  blow-up {_fmt(res['departure']):>4s}  "
              f"alerts {len(res['alerts']):3d}  first {_fmt(first_alert(res)):>4s}  threads {res['threads']}",
              flush=True)

    results = IR.run_all(names, args.workers, fn=_worker, progress=progress)
    deps = IR.departures(results)
    for n, res in results.items():
        res["departure"] = deps[n]
    jobs = []
    if not args.no_diagnose:
        for n, res in results.items():
            if res["run"]["role"] == "fail":
                dep = res["departure"]
                snaps = res.pop("snapshots", {})
                if dep is None:
                    continue
                at = max((s for s in snaps if s <= dep - LEAD), default=None)
                if at is not None:
                    jobs.append((n, at, snaps[at]))
            else:
                jobs.append((n, len(res["losses"]), res.pop("final_state")))
    for res in results.values():
        res.pop("snapshots", None), res.pop("final_state", None)
    diag = IR.run_all([j[0] for j in jobs], args.workers, fn=_DiagJob(jobs)) if jobs else {}
    diag_rows = list(diag.values())
    scores = score(results)
    table = signal_table(results, _thresholds())
    print(report(results, scores, table, diag_rows))
    print(f"\n{len(names)} runs in {time.perf_counter() - start:.0f} s on {args.workers} process(es), one thread each")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(_clean(dict(every=IR.EVERY, lead=LEAD, thresholds=_thresholds(),
                                                      runs=results, scores=scores, signals=table,
                                                      diagnose=diag_rows)), default=str))
    print(f"wrote {args.json}")
    return 0


class _DiagJob:
    """A picklable name -> diagnose job lookup for the pool."""

    def __init__(self, jobs):
        self.jobs = {j[0]: j for j in jobs}

    def __call__(self, name: str) -> dict[str, Any]:
        return _diagnose(self.jobs[name])


if __name__ == "__main__":
    sys.exit(main())

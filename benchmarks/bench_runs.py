"""``tinylm runs`` at scale and on the instability catalog.

Two parts:

* ``--big`` (default): a 10,000-step history of a 12-layer tinylm watched every 25 steps (400
  records of 74 sites, written as the watch writes ``watch.jsonl``: a real record of the model,
  its values scattered lognormally from record to record, a spike at step 9,000), read back,
  judged and reported (the text report rendered to a string), and written as the single-file
  page; prints the seconds of each part and the page's size.
* ``--pairs``: each failing run of benchmarks/instability_runs.py and its control trained with
  ``Watch(log_dir=...)`` as the catalog's benchmark attaches it (every 10 steps, given the
  optimizer), read back with ``History.read`` and put side by side with ``History.compare``;
  prints, per pair, the live watch's first alert (step, signal, site), whether the alerts read
  back equal the live ones, and the first departure the comparison finds (step, signal, site).

    python benchmarks/bench_runs.py [--big] [--pairs [NAME ...]] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _template(layers: int = 12):
    """A 12-layer tinylm's header and one real record (the watch's own, at step 0)."""
    import torch

    import tinylm
    from diagnostics import Watch

    cfg = tinylm.ModelConfig(vocab_size=64, context_length=16, d_model=32, num_layers=layers, num_heads=2, d_ff=64)
    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = Watch(model, every=25, optimizer=opt)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    with watch.step(0):
        loss = tinylm.functional.cross_entropy(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    watch.record(loss, lr=1e-3)
    watch.close()
    h = watch.history
    return {k: v for k, v in h.items() if k not in ("series", "records", "events")}, h["records"][0]


def _scatter(x, rng: random.Random, scale: float):
    if isinstance(x, dict):
        return {k: (_scatter(v, rng, scale) if k not in ("count", "rows") else v) for k, v in x.items()}
    if isinstance(x, float) and math.isfinite(x) and x != 0:
        return x * math.exp(rng.gauss(0.0, scale))
    return x


def write_big(folder: Path, steps: int = 10_000, every: int = 25, layers: int = 12) -> Path:
    """The big history's watch.jsonl (see the module docstring)."""
    from diagnostics.integrations.writers import json_safe

    header, rec = _template(layers)
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(json_safe({"type": "header", **header}))]
    for t in range(steps):
        loss = 4.0 * math.exp(-t / 4000) + 0.05 * rng.gauss(0, 1) + (6.0 if t == 9000 else 0.0)
        lines.append(json.dumps({"type": "step", "step": t, "loss": loss, "lr": 1e-3, "grad_norm": 1.0}))
        if t % every == 0:
            r = _scatter({k: v for k, v in rec.items() if k != "init"}, rng, 0.05)
            r.update(step=t, loss=loss, lr=1e-3, grad_norm=1.0, reason="interval")
            lines.append(json.dumps(json_safe({"type": "record", **r, "verdicts": []})))
    path = folder / "watch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def big(out: Path) -> None:
    from rich.console import Console

    from diagnostics import History
    from reports.runs_view import run_report, runs_page

    path = write_big(out / "big")
    t0 = time.perf_counter()
    h = History.read(out / "big")
    t1 = time.perf_counter()
    console = Console(width=120, file=io.StringIO(), color_system=None)
    console.print(run_report(h, "big"))
    t2 = time.perf_counter()
    page = runs_page([("big", h)], [])
    t3 = time.perf_counter()
    (out / "big.html").write_text(page)
    print(f"big history: {len(h.data['series']['step'])} steps, {len(h.data['records'])} records, "
          f"{len(h.data['sites'])} sites; watch.jsonl {path.stat().st_size / 1e6:.1f} MB")
    print(f"read {t1 - t0:.2f} s, judged and reported {t2 - t1:.2f} s (read + report {t2 - t0:.2f} s), "
          f"page {t3 - t2:.2f} s; page {len(page.encode()) / 1e6:.2f} MB")


def _alerts(alerts: list) -> str:
    """Alerts as JSON text (NaN as null), so that equal alerts with a NaN threshold compare equal."""
    from diagnostics.integrations.writers import json_safe

    return json.dumps(json_safe([a.to_dict() for a in alerts]))


def pairs(names: list[str], out: Path) -> None:
    import instability_runs as IR

    from diagnostics import History, Watch

    fails = [r for r in IR.CATALOG if r.role == "fail" and (not names or any(r.name.startswith(n) for n in names))]
    fails = [r for r in fails if not (out / r.name.replace("/", "_") / "control" / "watch.jsonl").is_file()]
    for run in fails:
        ctrl = next(r for r in IR.CATALOG if r.control_of == run.name)
        live, dirs = {}, {}
        t0 = time.perf_counter()
        for role, r in (("fail", run), ("control", ctrl)):
            d = out / run.name.replace("/", "_") / role
            made = []

            def factory(model, opt, d=d, made=made):
                made.append(Watch(model, every=IR.EVERY, optimizer=opt, log_dir=d))
                return made[0]

            IR.train(r, truth=False, watch_factory=factory)
            made[0].close()
            live[role], dirs[role] = made[0], d
        f, c = History.read(dirs["fail"]), History.read(dirs["control"])
        same = _alerts(f.alerts) == _alerts(live["fail"].alerts)
        comp = History.compare(f, c, labels=("fail", "control"))
        first = live["fail"].alerts[0] if live["fail"].alerts else None
        dep = comp.first
        said = "none" if first is None else f"{first.step} {first.signal} {first.site}"
        found = "none" if dep is None else f"{dep['step']} {dep['signal']} {dep['site']}"
        print(f"{run.name:42s} live first alert: {said:50s} read back equal: {same}; "
              f"first departure vs control: {found}; control outcome {c.outcome()['status']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big", action="store_true")
    p.add_argument("--pairs", nargs="*")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"threads: torch {torch.get_num_threads()}, machine {os.cpu_count()} cores (shared, loaded)")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_runs_"))
    if args.big or args.pairs is None:
        big(out)
    if args.pairs is not None:
        pairs(args.pairs, out)


if __name__ == "__main__":
    main()

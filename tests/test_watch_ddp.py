"""The watch in a DistributedDataParallel loop: two CPU processes on gloo, spawned, bounded in time.

The three lines of a single-process loop, unchanged: the watch finds the process group,
merges every site's moments over the ranks in one collective per recorded step, decides on
the ranks' mean loss (so both stop at the same step), and only rank 0 writes files. A rank
that diagnoses the DDP model alone measures the module inside, with no collective.
A child that hangs is killed and the test fails; collectives time out after 30 s.
"""

import csv
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import tinylm
from diagnostics import DiagnoseOptions, History, Watch, diagnose, probe

pytestmark = pytest.mark.distributed

CFG = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
STEPS, EVERY, NAN_AT = 6, 2, 4  # rank 1's loss is NaN at step 4 (a recorded step)
LIMIT_S = 180  # the whole spawned job (two interpreters importing torch on a busy machine)


def _model():
    return tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))


def _batch(rank, t):
    """Rank r's batch at step t: 2 + r sequences (uneven on purpose), (B, 9)."""
    return torch.randint(0, 32, (2 + rank, 9), generator=torch.Generator().manual_seed(100 * t + rank))


def _loss(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _worker(rank, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        watch = Watch(ddp, every=EVERY, log_dir=os.path.join(out, "run"))
        failure, t = None, -1
        for t in range(STEPS):
            with watch.step(t):
                loss = _loss(ddp, _batch(rank, t))
                loss.backward()
                opt.step()
                opt.zero_grad()
            if rank == 1 and t == NAN_AT:
                loss = loss * math.nan
            failure = watch.record(loss, lr=0.1).failure
            if failure:
                break
        watch.close()
        result = {"history": watch.history, "stopped_at": t, "describe": watch.describe(),
                  "failure": None if failure is None else (failure.step, failure.verdict)}
        if rank == 0:  # the other rank goes straight to the barrier: no collective may be waiting
            t0 = time.perf_counter()
            r = diagnose(ddp, options=DiagnoseOptions(batch_size=2, batches=1, seq_len=8))
            result["diagnose"] = (time.perf_counter() - t0, r.status, len(r.tensors))
        dist.barrier()
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _compiled_worker(rank, port, out):
    """A compiled DDP model (a backend that runs the traced graphs: fast on a CPU), 4 steps
    recorded every 2; saves the rank's history."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.save(_compiled_ddp(rank), os.path.join(out, f"compiled{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _compiled_ddp(rank):
    ddp = torch.compile(torch.nn.parallel.DistributedDataParallel(_model()), backend="eager")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    watch = Watch(ddp, every=2)
    for t in range(4):
        with watch.step(t):
            loss = _loss(ddp, _batch(rank, t))
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(loss)
    return watch.history


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bounded(fn, args, nprocs=2, limit_s=LIMIT_S):
    """``mp.start_processes`` of ``fn`` that kills every child still alive after ``limit_s`` and fails."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the spawned ranks did not finish within {limit_s} s (killed)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    run_bounded(_worker, (_free_port(), str(out)))
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_every_rank_gets_the_same_history_and_stops_at_the_same_step(ranks):
    _, (r0, r1) = ranks
    assert json.dumps(r0["history"]) == json.dumps(r1["history"])  # NaNs included: compared as text
    assert r0["stopped_at"] == r1["stopped_at"] == NAN_AT
    assert r0["failure"] == r1["failure"] == (NAN_AT, "non_finite")
    assert math.isnan(r0["history"]["series"]["loss"][-1])
    assert History(r0["history"]).verdicts() == History(r1["history"]).verdicts()
    assert "merged over 2 ranks" in r0["describe"] and "rank 1 writes nothing" in r1["describe"]


def test_rank_zeros_log_dir_reads_back_with_the_verdicts_every_rank_had(ranks):
    out, (r0, _) = ranks
    h = History.read(out / "run")
    assert h.notes == []
    assert json.dumps(h.data["series"]) == json.dumps(r0["history"]["series"])  # NaNs included
    assert json.dumps(h.verdicts()) == json.dumps(History(r0["history"]).verdicts())
    assert h.first_departure() == History(r0["history"]).first_departure()
    assert h.outcome()["status"] == "failed" and h.outcome()["step"] == NAN_AT  # the ranks' non-finite loss


def test_merged_counts_are_the_sum_of_the_ranks_and_the_moments_those_of_one_process(ranks):
    """Step 0 (identical weights on both ranks): the merged record equals one process probing
    both ranks' batches together, counts exactly, moments to float64 merge rounding."""
    _, (r0, _) = ranks
    rec = r0["history"]["records"][0]
    assert rec["step"] == 0
    model = _model()
    with probe(model) as run:  # one process, both ranks' sequences in one batch
        _loss(model, torch.cat([_batch(0, 0), _batch(1, 0)])).backward()
    single = run.stats
    for site, st in rec["stats"].items():
        m = single.tensors[(site, "forward")]
        assert st["count"] == m.n_total > 0, site
        assert abs(st["fwd_mean"] - m.mean) <= 1e-6 * (abs(m.mean) + m.std), site
        assert abs(st["fwd_var"] - m.var) <= 1e-5 * m.var, site
        assert st["fwd_absmax"] == m.max_abs, site
    per_rank = 0
    for rank in range(2):
        model = _model()
        with probe(model) as run:
            _loss(model, _batch(rank, 0)).backward()
        per_rank += run.stats.tensors[("token_embeddings", "forward")].n_total
    assert rec["stats"]["token_embeddings"]["count"] == per_rank


def test_rank_zero_alone_writes_the_files_once(ranks):
    out, _ = ranks
    run = out / "run"
    lines = (run / "watch.jsonl").read_text().splitlines()
    objs = [json.loads(line) for line in lines]  # every line valid JSON
    assert [o["step"] for o in objs if o["type"] == "step"] == list(range(NAN_AT + 1))  # each step once
    with open(run / "watch.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert len({len(r) for r in rows}) == 1 and len(rows) > 10
    events = [p for p in os.listdir(run) if p.startswith("events.out.tfevents")]
    assert len(events) <= 1  # one TensorBoard file (none where tensorboard is not installed)


def test_rank_zero_alone_diagnoses_the_ddp_model_without_waiting(ranks):
    _, (r0, _) = ranks
    seconds, status, n = r0["diagnose"]
    assert n > 0 and status
    assert seconds < 60


DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "distributed.md")


def test_the_torchrun_example_of_the_docs_runs_as_written(tmp_path):
    """docs/distributed.md's script, run by its torchrun command with 2 processes on gloo."""
    text = open(DOC).read()
    script = text.split("```python\n", 1)[1].split("```", 1)[0]
    command = next(line for line in text.splitlines() if line.startswith("torchrun "))
    (tmp_path / "train_ddp.py").write_text(script)
    argv = command.split()
    argv[0:1] = [sys.executable, "-m", "torch.distributed.run"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    objs = [json.loads(line) for line in (tmp_path / "runs" / "ddp" / "watch.jsonl").read_text().splitlines()]
    assert any(o["type"] == "record" for o in objs)


@pytest.mark.slow  # two interpreters tracing the model with Dynamo: a minute on a busy 2-core machine
def test_a_compiled_ddp_model_is_watched_and_merged(tmp_path):
    """torch.compile around DDP: the same three lines; every site counted, both ranks' records the same."""
    run_bounded(_compiled_worker, (_free_port(), str(tmp_path)))
    h0, h1 = (torch.load(tmp_path / f"compiled{r}.pt", weights_only=False) for r in range(2))
    assert [r["step"] for r in h0["records"]] == [0, 2]
    assert json.dumps(h0["records"]) == json.dumps(h1["records"])  # NaN lr and grad_norm: compared as text
    assert all(st["count"] > 0 for rec in h0["records"] for st in rec["stats"].values())
    assert h0["sites"] == Watch(_model()).sites

"""The watch's W&B writer in a real short run, in W&B's offline mode (no account, no network:
the run is written under tmp_path): a loop of a tiny tinylm model whose watch logs through
:class:`diagnostics.integrations.wandb.WandbWriter`, read back from the run's own files (its
``.wandb`` transaction log: history rows and summary) and held against the watch's history;
the writer in the user's current run, which it leaves open; the ImportError naming the extra.
Every test runs under a deadline and tears W&B's service process down."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import signal
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch

wandb = pytest.importorskip("wandb", reason='the wandb extra: pip install -e ".[wandb]"')

import tinylm  # noqa: E402
from diagnostics import Watch  # noqa: E402
from diagnostics.integrations.wandb import WandbWriter  # noqa: E402
from tinylm import functional as F  # noqa: E402

SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
DEADLINE_S = 120


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise TimeoutError in the test if the block runs past ``seconds`` (SIGALRM: the main
    thread only, where pytest and its xdist workers run tests; elsewhere no deadline)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"the W&B test ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, quiet and local to tmp_path; the service process torn down afterwards."""
    for k, v in dict(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", WANDB_CONSOLE="off",
                     WANDB_DISABLE_GIT="true", WANDB_DISABLE_CODE="true", WANDB_INIT_TIMEOUT="60").items():
        monkeypatch.setenv(k, v)
    try:
        with deadline(DEADLINE_S):
            yield tmp_path
    finally:
        with deadline(30):
            if wandb.run is not None:
                wandb.finish()
            wandb.teardown()


def run_records(run_dir: Path):
    """The protobuf records of an offline run's ``.wandb`` file: a 7-byte header (":W&B", a
    2-byte magic, a version byte), then LevelDB-log records in 32 KiB blocks (a 7-byte
    header: CRC, little-endian length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            yield rec


def logged(run_dir: Path) -> tuple[list[dict], dict]:
    """The run's history rows (user keys only) and its last summary, read back from its files
    once W&B's service has ended (``wandb.teardown`` waits for it: the file is whole)."""
    wandb.teardown()
    rows, summary = [], {}
    for rec in run_records(run_dir):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "summary":
            for i in rec.summary.update:
                summary[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return rows, summary


def small_model() -> tinylm.TransformerLM:
    return tinylm.TransformerLM(tinylm.ModelConfig(**SMALL), generator=torch.Generator().manual_seed(0))


def train(watch: Watch, model, steps: int, blow_up_at: int, nan_at: int) -> None:
    """A user's loop; at ``blow_up_at`` the head's weights x100 (the logits explode), at
    ``nan_at`` the loss handed to the watch is NaN (a non-finite alarm)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        x = torch.randint(0, 32, (2, 9), generator=g)
        if t == blow_up_at:
            with torch.no_grad():
                model.lm_head.weight.mul_(100.0)
        with watch.step(t):
            loss = F.cross_entropy(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(float("nan") if t == nan_at else loss, lr=1e-2)


def test_an_offline_run_holds_the_watchs_series_records_and_alarms(offline):
    model = small_model()
    writer = WandbWriter(project="tinylm-test", settings=wandb.Settings(init_timeout=60))
    watch = Watch(model, every=2, writers=[writer])
    assert writer.owns_run and wandb.run is writer.run  # no run was current: the writer opened one
    run_dir = Path(writer.run.dir).parent
    train(watch, model, steps=7, blow_up_at=4, nan_at=6)
    watch.close()
    assert wandb.run is None  # the run it opened is finished
    h = watch.history
    rows, summary = logged(run_dir)
    assert [r["watch/step"] for r in rows] == h["series"]["step"] == list(range(7))  # one row a step
    for r, loss in zip(rows[:6], h["series"]["loss"]):
        assert r["watch/loss"] == pytest.approx(loss, rel=1e-12) and r["watch/lr"] == 1e-2
        assert "watch/grad_norm" not in r  # not known in this loop: not logged
    assert rows[6]["watch/loss"] is None or math.isnan(float(rows[6]["watch/loss"]))  # NaN in W&B's JSON
    recorded = {rec["step"]: rec for rec in h["records"]}
    assert sorted(recorded) == [0, 2, 4, 6]
    for r in rows:
        rec = recorded.get(r["watch/step"])
        has = [k for k in r if k.startswith("watch/gradient_var/")]
        if rec is None:
            assert not has
            continue
        assert sorted(has) == sorted(f"watch/gradient_var/{s}" for s in h["sites"])
        for site, st in rec["stats"].items():
            assert r[f"watch/activation_var/{site}"] == pytest.approx(st["fwd_var"], rel=1e-12)
            assert r[f"watch/gradient_var/{site}"] == pytest.approx(st["grad_var"], rel=1e-12)
        for name, ratio in rec["update_ratio"].items():
            assert r[f"watch/update_ratio/{name}"] == pytest.approx(ratio, rel=1e-12)
    # the explosion at step 4: the head's verdict in the row's text and the run's first fail
    assert rows[4]["watch/not_ok"] >= 1 and "lm_head: exploding" in rows[4]["watch/verdicts"]
    assert "watch/verdicts" not in rows[2] and rows[2]["watch/not_ok"] == 0
    assert summary["watch/first_fail"].startswith("step 4: lm_head: exploding")
    # the NaN loss at step 6: the alarm's message in its row
    assert rows[6]["watch/alarm"] == h["events"][-1]["message"] and "not finite" in rows[6]["watch/alarm"]


def test_the_writer_logs_into_the_users_current_run_and_leaves_it_open(offline):
    run = wandb.init(project="tinylm-test", settings=wandb.Settings(init_timeout=60))
    run.log({"user/metric": 1.0})
    model = small_model()
    writer = WandbWriter()
    with Watch(model, every=3, writers=[writer]) as watch:
        assert writer.run is run and not writer.owns_run
        train(watch, model, steps=4, blow_up_at=-1, nan_at=-1)
    assert wandb.run is run  # still the user's, still open
    run.log({"user/metric": 2.0})
    run_dir = Path(run.dir).parent
    run.finish()
    rows, _ = logged(run_dir)
    assert [r.get("user/metric") for r in rows if "user/metric" in r] == [1.0, 2.0]
    watch_rows = [r for r in rows if "watch/step" in r]
    assert [r["watch/step"] for r in watch_rows] == [0, 1, 2, 3]
    assert [r["watch/step"] for r in watch_rows if "watch/gradient_var/lm_head" in r] == [0, 3]


def test_a_missing_wandb_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "diagnostics.integrations.wandb", raising=False)
    with pytest.raises(ImportError, match=r'pip install "tinylm\[wandb\]"'):
        importlib.import_module("diagnostics.integrations.wandb")


def test_an_alert_is_logged_and_sent_as_a_wandb_alert():
    from diagnostics.integrations.wandb import WandbWriter
    from diagnostics.judge.precursors import Alert

    class Run:
        def __init__(self):
            self.rows, self.alerts, self.summary = [], [], {}

        def define_metric(self, *a, **k):
            pass

        def log(self, row):
            self.rows.append(row)

        def alert(self, **kw):
            self.alerts.append(kw)

    run = Run()
    w = WandbWriter(run=run)
    w.open(None)
    a = Alert(30, "warn", "attention_logits", "layers.0.attn.probs", 300.0, 200.0, 3, 10, "cause", "qk-norm",
              "", "step 30: attention_logits ...")
    w.alert(a)
    w.alert(Alert(40, "fail", "attention_logits", "x", 3e3, 2e3, 4, 10, "c", "f", "", "step 40: attention_logits fail"))
    w.close()
    assert [r["watch/alert"] for r in run.rows] == ["warn: step 30: attention_logits ...",
                                                   "fail: step 40: attention_logits fail"]
    assert [k["title"] for k in run.alerts] == ["tinylm watch: attention_logits at step 30"] * 1 + \
        ["tinylm watch: attention_logits at step 40"]
    assert run.summary["watch/first_fail"] == "step 40: attention_logits fail"  # a warning is not a fail

"""A watch's log dir read back (``History.read``) and reported (``tinylm runs``): the same verdicts,
alerts, first departure and first mover the live watch had; a line cut short or damaged skipped and
said (never a traceback); a run killed with SIGKILL read back; two runs side by side (a blow-up
found at its step against its control; identical runs and runs of other seeds not parted: the
negative controls); the command's report, exit codes, exports, single-file page and live view."""

from __future__ import annotations

import base64
import html.parser
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from diagnostics import History, OptionsError, Watch
from diagnostics.judge import over_time as V
from reports.cli import main

sys.path.insert(0, os.path.dirname(__file__))
from test_watch_loop import run_loop, small_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _watched(folder: Path, blow_up_at: int | None, seed: int = 0, steps: int = 10, every: int = 1) -> Watch:
    model = small_model(seed)
    watch = Watch(model, every=every, log_dir=folder)
    run_loop(watch, model, steps, blow_up_at=blow_up_at)
    watch.close()
    return watch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run whose head blows up at step 6, its control (the same run without), and both watches."""
    base = tmp_path_factory.mktemp("runs")
    fail = _watched(base / "fail", blow_up_at=6)
    control = _watched(base / "control", blow_up_at=None)
    return base, fail, control


def _key(alerts):
    return [(a.step, a.severity, a.signal, a.site, a.message) for a in alerts]


def test_a_log_dir_reads_back_with_the_live_watchs_verdicts_alerts_and_forensics(runs):
    base, live, _ = runs
    h = History.read(base / "fail")
    assert h.notes == []
    assert h.data["series"] == live.history["series"]
    assert h.verdicts() == V.verdicts(live.history)
    assert h.stored_verdicts == h.verdicts()  # what each record line carried, judged again the same
    assert h.first_departure() == V.first_departure(live.history)
    assert h.first_mover() == V.first_mover(live.history)
    assert h.alerts == live.alerts and _key(h.alerts)
    assert [r["step"] for r in h.forensics] == [r["step"] for r in live.reports]
    assert h.outcome() == {**h.outcome(), "status": "failed", "step": 6}
    assert History.read(base / "control").outcome()["status"] == "ok"  # the negative control
    assert History.read(base / "fail" / "watch.jsonl").verdicts() == h.verdicts()  # the file itself
    page = h._repr_html_()  # in a notebook: the runs report
    assert "outcome: FAILED at step 6" in page and "alerts by signal" in page and "data:image/png;base64," in page


def _lines(folder: Path) -> list[bytes]:
    return (folder / "watch.jsonl").read_bytes().split(b"\n")[:-1]


def test_a_last_line_cut_short_and_a_damaged_line_are_skipped_and_said(runs, tmp_path):
    base, live, _ = runs
    lines = _lines(base / "fail")
    last_record = max(i for i, x in enumerate(lines) if b'"type": "record"' in x)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "watch.jsonl").write_bytes(b"\n".join(lines[:last_record]) + b"\n" + lines[last_record][:200])
    h = History.read(cut)
    assert len(h.notes) == 1 and "cut short" in h.notes[0] and f"line {last_record + 1}" in h.notes[0]
    assert len(h.data["records"]) == len(live.history["records"]) - 1
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    first_record = min(i for i, x in enumerate(lines) if b'"type": "record"' in x)
    bad = list(lines)
    a_step = max(i for i, x in enumerate(lines) if b'"type": "step"' in x) - 2
    assert b'"type": "step"' in lines[a_step]
    bad[first_record] = b'{"type": "record", "step": "x"'
    bad[a_step] = b"\x00garbage"
    (damaged / "watch.jsonl").write_bytes(b"\n".join(bad) + b"\n")
    h = History.read(damaged)
    assert [n.split(" is ")[0] for n in h.notes] == [f"line {k + 1}" for k in sorted((a_step, first_record))]
    assert len(h.data["records"]) == len(live.history["records"]) - 1
    assert len(h.data["series"]["step"]) == len(live.history["series"]["step"]) - 1
    assert h.notes and History.read(base / "fail").notes == []  # the intact file: nothing said
    old = tmp_path / "old"  # a file from a writer without the header line: read, and said
    old.mkdir()
    (old / "watch.jsonl").write_bytes(b"\n".join(lines[1:]) + b"\n")
    h = History.read(old)
    assert lines[0].startswith(b'{"type": "header"') and "no header line" in h.notes[0]
    assert h.data["sites"] == live.history["sites"] and len(h.data["records"]) == len(live.history["records"])


def test_what_is_not_a_watch_log_is_one_error_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other.json").write_text('{"format": "something"}')
    (tmp_path / "junk.jsonl").write_text("not json\n")
    for source, words in ((tmp_path / "nope", "no such file"), (tmp_path / "empty", "no watch.jsonl"),
                          (tmp_path / "other.json", "not a watch history"), (tmp_path / "junk.jsonl", "no watch line")):
        with pytest.raises(OptionsError, match=words):
            History.read(source)


def _loop_until_killed(out: str) -> None:
    """A watched run that never ends (its head blown up at step 4), in a forked process."""
    import torch

    from tinylm import functional as F

    torch.set_num_threads(1)
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = Watch(model, every=1, log_dir=out)
    g = torch.Generator().manual_seed(1)
    for t in range(10 ** 6):
        x = torch.randint(0, 32, (2, 9), generator=g)
        if t == 4:
            with torch.no_grad():
                model.lm_head.weight.mul_(100.0)
        with watch.step(t):
            loss = F.cross_entropy(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(loss, lr=1e-2)


def test_a_run_killed_with_sigkill_reads_back(tmp_path):
    import multiprocessing

    out = tmp_path / "killed"
    proc = multiprocessing.get_context("fork").Process(target=_loop_until_killed, args=(str(out),), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.is_alive():
            path = out / "watch.jsonl"
            if path.is_file() and path.read_bytes().count(b'"type": "record"') >= 8:
                break
            time.sleep(0.01)
        assert proc.is_alive(), "the watched run ended before it was killed"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL
    h = History.read(out)  # no traceback, whatever line the kill cut
    assert all("cut short" in n for n in h.notes)
    assert len(h.data["records"]) >= 8
    assert h.stored_verdicts == h.verdicts()  # the verdicts the live watch wrote, judged again the same
    assert h.outcome()["status"] == "failed" and h.outcome()["step"] == 4
    assert h.first_departure()["step"] == 4 and [a.step for a in h.alerts][:1] == [4]


def test_runs_side_by_side_part_at_the_blow_up_and_not_otherwise(runs, tmp_path):
    base, *_ = runs
    c = History.compare(base / "fail", base / "control")
    assert c.labels == ("fail", "control")
    assert (c.first["step"], c.first["site"], c.first["signal"]) == (6, "lm_head", "fwd_var")
    assert "lm_head" in str(c) and "step 6" in str(c)
    assert list(c.to_frame().columns[:3]) == ["step", "signal", "site"]
    assert json.loads(c.to_json())["version"] == 1
    # negative controls: the same run twice, and the control beside a run of another seed
    assert History.compare(base / "control", base / "control").first is None
    other = _watched(tmp_path / "seed1", blow_up_at=None, seed=1)
    c2 = History.compare(History(other.history), base / "control")
    assert c2.first is None, c2.parting["departures"][:2]
    assert History.compare(base / "fail", base / "control", alpha=0.5 - 1e-9).first is not None
    with pytest.raises(OptionsError, match="alpha"):
        History.compare(base / "fail", base / "control", alpha=0.0)


def _run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    from contextlib import redirect_stderr

    with redirect_stdout(out), redirect_stderr(err):
        code = main(["runs", *map(str, argv), "--width", "120"])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def written(runs, tmp_path_factory):
    """``tinylm runs fail control --check`` with every output: (exit code, stdout, the folder)."""
    base, *_ = runs
    d = tmp_path_factory.mktemp("written")
    code, out, _ = _run_cli(base / "fail", base / "control", "--check", "--csv", d / "r.csv", "--json", d / "r.json",
                            "--plot", d / "f.png", "--html", d / "runs.html")
    return code, out, d


def test_the_command_reports_and_exits_by_the_outcome(runs, written, tmp_path):
    base, live, _ = runs
    code, out, d = written
    assert code == 1
    assert "outcome: FAILED at step 6" in out and "first departure: step 6, lm_head exploding" in out
    assert "alerts by signal" in out and "forensics of step 6" in out and "loss and lr over steps" in out
    assert "side by side: fail vs control" in out
    assert _run_cli(base / "control", "--check")[0] == 0  # negative control
    assert _run_cli(base / "control", "--check", "--fail-on", "warned")[0] == 0
    code, _, err = _run_cli(tmp_path / "missing")
    assert code == 2 and err.count("\n") == 1 and "no such file" in err
    code, _, err = _run_cli(base / "fail", "--html", tmp_path / "x.txt")
    assert code == 2 and "--html" in err
    code, _, err = _run_cli(tmp_path)
    assert code == 2 and "no watch.jsonl" in err
    err = io.StringIO()
    from contextlib import redirect_stderr

    with redirect_stderr(err):
        assert main(["diagnose", str(base / "fail")]) == 2  # a log dir given to diagnose: pointed here
    assert f"tinylm runs {base / 'fail'}" in err.getvalue()
    import pandas as pd

    frame = pd.read_csv(d / "r.csv")
    assert set(frame["run"]) == {"fail", "control"}
    assert (frame["run"] == "fail").sum() == len(History(live.history).to_frame())
    doc = json.loads((d / "r.json").read_text())
    assert doc["schema"] == "tinylm-runs" and doc["runs"][0]["outcome"]["step"] == 6
    assert doc["comparisons"][0]["parting"]["first"]["site"] == "lm_head"
    for label in ("fail", "control"):
        assert (d / f"f-{label}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.images, self.links = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        for k in ("href", "src"):
            if k in attrs and not attrs[k].startswith("data:"):
                self.links.append(attrs[k])


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_page_is_one_offline_file_whose_figures_decode(written):
    text = (written[2] / "runs.html").read_text()
    p = _Page()
    p.feed(text)
    assert "script" not in p.tags and p.links == []  # nothing from elsewhere, nothing run
    assert len(p.images) == 2
    for src in p.images:
        head, data = src.split(",", 1)
        assert head == "data:image/png;base64"
        w, h = _png_size(base64.b64decode(data, validate=True))
        assert w > 300 and h > 300
    assert "FAILED at step 6" in text and "side by side: fail vs control" in text and "alerts by signal" in text


def test_follow_redraws_as_records_arrive_and_ends_when_told(runs, tmp_path):
    base, live, _ = runs
    lines = (base / "fail" / "watch.jsonl").read_text().splitlines(keepends=True)
    out = tmp_path / "live"
    out.mkdir()
    (out / "watch.jsonl").write_text("".join(lines[:3]))

    def writer():
        with open(out / "watch.jsonl", "a") as f:
            for line in lines[3:]:
                f.write(line[:len(line) // 2])  # a line arrives in two writes
                f.flush()
                time.sleep(0.005)
                f.write(line[len(line) // 2:])
                f.flush()

    thread = threading.Thread(target=writer)
    start = time.monotonic()
    thread.start()
    code, shown, _ = _run_cli(out, "--follow", "--interval", "0.05", "--idle", "2.5", "--for", "30")
    thread.join(timeout=30)
    assert code == 0 and time.monotonic() - start < 30
    last = live.history["series"]["step"][-1]
    assert f"step {last} " in shown and "FAILED at step 6" in shown and f"{len(lines)} lines read" in shown
    assert "reading:" not in shown  # a line caught half-written waited for its newline


def test_a_history_json_and_a_checkpoint_of_tinylm_train_read_back(tmp_path):
    from diagnostics.integrations.writers import write_json

    code = main(["train", "--preset", "tiny", "--steps", "6", "--batch-size", "2", "--watch-every", "2",
                 "--num-layers", "2", "--d-model", "32", "--context-length", "16", "-o", str(tmp_path / "m.pt"),
                 "--watch-json", str(tmp_path / "w.json"), "--quiet"])
    assert code == 0
    import torch

    stored = torch.load(tmp_path / "m.pt", weights_only=True)["history"]
    for source in (tmp_path / "w.json", tmp_path / "m.pt"):
        h = History.read(source)
        assert h.verdicts() == V.verdicts(stored) and h.first_departure() == V.first_departure(stored)
        assert h.data["series"]["loss"] == stored["series"]["loss"]
        assert "replayed" in h.notes[0]  # a JSON or checkpoint stores no alert: replayed from the records
    write_json({"format": "tinylm-watch"}, tmp_path / "bad.json")
    with pytest.raises(OptionsError, match="not a watch history"):
        History.read(tmp_path / "bad.json")


@pytest.mark.browser
def test_the_page_renders_in_headless_chromium(written, tmp_path):
    import shutil

    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no chromium installed (apt-get install chromium)")
    page = written[2] / "runs.html"
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1200,2400", page.as_uri()],
                   capture_output=True, timeout=120, check=False)
    from PIL import Image

    img = Image.open(shot).convert("L")
    assert img.size == (1200, 2400)
    w, h = img.size
    bands = [img.crop((0, y, w, y + 200)) for y in range(0, h, 200)]
    inked = [sum(b.histogram()[:200]) / (w * 200) for b in bands]
    assert inked[0] > 0.003  # the heading and the report
    assert sum(x > 0.02 for x in inked) >= 3  # the figure's panels: lines, axes, labels
    os.makedirs(ROOT / "benchmarks" / "out", exist_ok=True)
    shutil.copy(shot, ROOT / "benchmarks" / "out" / "runs_page.png")


@pytest.mark.slow  # two catalog runs of 250 steps: about two minutes on one thread
def test_an_instability_run_departs_from_its_control_where_the_live_watch_warned(tmp_path):
    """attention logit growth (LR 0.1) beside its control (LR 3e-3): the first departure is at the
    site the live watch first alerted on, no later than its step; the control is ok."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import instability_runs as IR

    watches = {}
    for role in ("fail", "control"):
        def factory(model, opt, role=role):
            watches[role] = Watch(model, every=IR.EVERY, optimizer=opt, log_dir=tmp_path / role)
            return watches[role]

        IR.train(IR.by_name(f"attn_logit_growth/tinylm-sdpa/{role}"), truth=False, watch_factory=factory)
        watches[role].close()
    fail, control = History.read(tmp_path / "fail"), History.read(tmp_path / "control")
    assert fail.alerts == watches["fail"].alerts and control.outcome()["status"] == "ok"
    first_alert = fail.alerts[0]
    c = History.compare(fail, control)
    assert c.first["site"] == first_alert.site and c.first["step"] <= first_alert.step
    row = c.alert_departures()[0]
    assert row["departed_at"] is not None and row["departed_at"] <= row["step"]


def _same_reading(h: History, live: dict, alerts: list) -> None:
    """``h`` (read back) holds what the live watch had: series, verdicts, first departure and
    mover, alerts (compared as JSON text: a NaN threshold equals itself there)."""
    from diagnostics.integrations.writers import json_safe

    def text(x):
        return json.dumps(json_safe(x), sort_keys=True)

    assert h.notes == []
    assert text(h.data["series"]) == text(live["series"])
    assert text(h.verdicts()) == text(V.verdicts(live)) == text(h.stored_verdicts)
    assert text(h.first_departure()) == text(V.first_departure(live))
    assert text(h.first_mover()) == text(V.first_mover(live))
    assert text([a.to_dict() for a in h.alerts]) == text([a.to_dict() for a in alerts])


def test_the_hugging_face_callbacks_log_dir_reads_back(tmp_path):
    pytest.importorskip("transformers", reason='the hf extra: pip install -e ".[hf]"')
    pytest.importorskip("accelerate", reason='the hf extra: pip install -e ".[hf]"')
    from diagnostics.integrations.hf import WatchCallback
    from test_watch_hf import nan_gpt2, tiny_gpt2, train

    ok = WatchCallback(every=2, log_dir=tmp_path / "ok")
    train(tiny_gpt2(), ok, tmp_path)
    ok.watch.close()
    h = History.read(tmp_path / "ok")
    _same_reading(h, ok.watch.history, ok.watch.alerts)
    assert h.outcome()["status"] != "failed"  # the negative control of the NaN run below
    bad = WatchCallback(every=2, stop="signal", log_dir=tmp_path / "nan")
    train(nan_gpt2(), bad, tmp_path)
    bad.watch.close()
    h = History.read(tmp_path / "nan")
    _same_reading(h, bad.watch.history, bad.watch.alerts)
    assert h.outcome()["status"] == "failed" and h.outcome()["step"] == bad.failure.step == 1


def test_the_lightning_callbacks_log_dir_reads_back(tmp_path):
    pytest.importorskip("lightning.pytorch", reason='the lightning extra: pip install -e ".[lightning]"')
    import torch

    from diagnostics.integrations.lightning import WatchCallback
    from test_watch_lightning import LM, batches, fit

    module = LM()
    with torch.no_grad():
        module.model.layers[0].ffn.w1.weight[0, 0] = float("nan")
    cb = WatchCallback(every=2, stop="signal", log_dir=tmp_path / "nan")
    fit(module, cb, batches(16))
    cb.watch.close()
    h = History.read(tmp_path / "nan")
    _same_reading(h, cb.watch.history, cb.watch.alerts)
    assert h.outcome()["status"] == "failed" and h.outcome()["step"] == cb.failure.step == 0


@pytest.mark.parametrize("every", [5, 1])  # a spike on a step not recorded, and on one recorded
def test_a_history_json_replays_the_alerts_the_watch_reported(tmp_path, every):
    from diagnostics.integrations.writers import json_safe, write_json

    model = small_model()
    watch = Watch(model, every=every)
    run_loop(watch, model, 20, blow_up_at=12)
    write_json(watch.history, tmp_path / "h.json")
    h = History.read(tmp_path / "h.json")
    assert any(a.signal == "spike" for a in watch.alerts)
    assert json.dumps(json_safe([a.to_dict() for a in h.alerts])) == json.dumps(
        json_safe([a.to_dict() for a in watch.alerts]))
    assert "replayed" in h.notes[0]
    broken = dict(watch.history, events=[])  # negative control: without its alarm, no spike alert
    write_json(broken, tmp_path / "b.json")
    assert not any(a.signal == "spike" for a in History.read(tmp_path / "b.json").alerts)

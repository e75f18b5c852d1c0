"""Hardened intake through the command line and the probe (docs/safety.md).

Every bad input: exit code 2, one line on stderr naming the problem, no traceback.
Nothing the user gave is executed or changed. The probe restores the model even
when the forward or backward raises midway.
"""

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# The ci profile runs 25 examples by default; thorough (500) scales the fuzz up 20-fold.
SCALE = max(1, settings.default.max_examples // 25)

import tinylm
from clihelp import assert_one_line_error
from reports.cli import main
from tinylm import checkpoint

SMALL = tinylm.ModelConfig(vocab_size=300, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
FAST = ["--batch-size", "1", "--batches", "1", "--seq-len", "4", "--no-progress", "--width", "100"]
HEADS = ["--num-heads", "2", "--rope-theta", "10000", "--context-length", "8"]


@pytest.fixture(scope="module")
def model():
    return tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))


@pytest.fixture()
def ckpt(tmp_path, model):
    path = tmp_path / "m.pt"
    checkpoint.save(path, model)
    return path


@contextmanager
def time_limit(seconds: int):
    """Fail, instead of hanging, when the body runs past ``seconds``."""
    import signal

    def hang(signum, frame):
        raise AssertionError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_cli(capsys, *argv):
    code = main(["diagnose", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def bad_files(tmp_path, model):
    """(name, path, phrase) for each kind of broken checkpoint docs/safety.md lists."""
    good = tmp_path / "good.pt"
    checkpoint.save(good, model)
    data = good.read_bytes()
    sd = model.state_dict()
    cases = []

    def add(name, phrase, content=None, state=None):
        p = tmp_path / name
        if state is not None:
            torch.save(state, p)
        elif content is not None:
            p.write_bytes(content)
        cases.append((name, p, phrase))

    add("missing.pt", "no such file")
    (tmp_path / "dir.pt").mkdir()
    cases.append(("dir.pt", tmp_path / "dir.pt", "is a directory"))
    add("empty.pt", "empty file", b"")
    add("truncated.pt", "truncated", data[: len(data) // 3])
    add("random.pt", "not a PyTorch checkpoint", os.urandom(3000))
    add("notes.txt", "text file", b"this is not a checkpoint\n")
    add("config.json", "text file", b'{"d_model": 16}')
    add("keys.pt", "missing 1 key(s)", state={k: v for k, v in sd.items() if k != "layers.0.ln2.weight"})
    add("shape.pt", "wrong shapes", state={**sd, "lm_head.weight": torch.zeros(300, 15)})
    add("ints.pt", "non-float weights", state={k: v.long() for k, v in sd.items()})
    return cases


def test_every_broken_checkpoint_is_one_line_and_exit_2(tmp_path, model, capsys):
    for name, path, phrase in bad_files(tmp_path, model):
        code, _, err = run_cli(capsys, path, *HEADS, *FAST)
        assert_one_line_error(code, err, phrase)


def test_missing_num_heads_names_the_flag(tmp_path, model, capsys):
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    code, _, err = run_cli(capsys, tmp_path / "bare.pt", *FAST)
    assert_one_line_error(code, err, "--num-heads")


def test_payload_is_refused_through_the_cli_and_never_runs(tmp_path, capsys):
    target = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {target}",))

    torch.save({"model": Payload()}, tmp_path / "evil.pt")
    code, _, err = run_cli(capsys, tmp_path / "evil.pt", *FAST)
    assert_one_line_error(code, err, "pickled Python objects", "--unsafe-load")
    assert not target.exists()


def test_whole_module_pickle_needs_unsafe_load(tmp_path, model, capsys):
    torch.save(model, tmp_path / "module.pt")
    code, _, err = run_cli(capsys, tmp_path / "module.pt", *FAST)
    assert_one_line_error(code, err, "--unsafe-load")
    code, out, err = run_cli(capsys, tmp_path / "module.pt", "--unsafe-load", *FAST)
    assert code == 0, err


def test_batch_too_large_for_memory_is_refused_before_allocating(ckpt, capsys):
    code, _, err = run_cli(capsys, ckpt, "--batch-size", "100000000", "--seq-len", "8", "--no-progress")
    assert_one_line_error(code, err, "GiB", "try --batch-size")


def _stored_config(tmp_path, model, **change):
    path = tmp_path / "sized.pt"
    torch.save({"format": "tinylm", "version": 1, "config": {**SMALL.to_dict(), **change}, "model": model.state_dict()},
               path)
    return path


#: sizes in a stored config or a flag that the allocator must never see: each is refused from the
#: estimate, before anything is allocated (exit 2, one line, within seconds, no memory taken)
SIZE_CASES = {
    "stored context_length 10^9": (dict(context_length=10**9), [], "GiB"),
    "stored context_length 10^7": (dict(context_length=10**7), [], "GiB"),
    "bare checkpoint, --context-length 10^9": (None, ["--num-heads", "2", "--rope-theta", "10000",
                                                      "--context-length", "1000000000"], "GiB"),
    "fresh model, --context-length 10^7": ("fresh", ["--context-length", "10000000"], "GiB"),
    "--width 10^9": ({}, ["--width", "1000000000"], "columns"),
}


@pytest.mark.parametrize("case", sorted(SIZE_CASES))
def test_sizes_are_refused_from_the_estimate_before_allocating(tmp_path, model, capsys, case):
    import resource
    import time

    change, flags, phrase = SIZE_CASES[case]
    if change == "fresh":
        argv = []
    elif change is None:
        torch.save(model.state_dict(), tmp_path / "bare.pt")
        argv = [tmp_path / "bare.pt"]
    else:
        argv = [_stored_config(tmp_path, model, **change)]
    argv += ["--batch-size", "1", "--batches", "1", "--no-progress", *flags]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    start = time.perf_counter()
    with time_limit(10):
        code, _, err = run_cli(capsys, *argv)
    assert time.perf_counter() - start < 5, case
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024 < 256, case  # MiB: nothing was allocated
    assert code != 3, err
    assert_one_line_error(code, err, phrase)


def test_the_library_refuses_a_stored_context_before_allocating(tmp_path, model):
    from tinylm.memory import MemoryLimitError

    path = _stored_config(tmp_path, model, context_length=10**9)
    with time_limit(10), pytest.raises(MemoryLimitError, match=r"sized.pt: .*context_length=1000000000.* GiB"):
        checkpoint.load(path)


def test_tokens_outside_vocabulary(tmp_path, ckpt, capsys):
    import numpy as np

    np.save(tmp_path / "tokens.npy", np.arange(1000, dtype=np.int64))
    code, _, err = run_cli(capsys, ckpt, "--data", tmp_path / "tokens.npy", *FAST)
    assert_one_line_error(code, err, "outside the model's vocabulary")


def test_debug_shows_the_traceback(tmp_path, capsys):
    code = main(["diagnose", str(tmp_path / "nope.pt"), "--debug"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err


def test_checkpoint_bytes_and_mtime_unchanged_after_a_full_run(tmp_path, ckpt, capsys):
    before = (ckpt.read_bytes(), ckpt.stat().st_mtime_ns)
    os.chmod(ckpt, 0o444)
    code, out, err = run_cli(capsys, ckpt, *FAST, "--json", tmp_path / "r.json", "--csv", tmp_path / "r.csv")
    assert code == 0, err
    assert (ckpt.read_bytes(), ckpt.stat().st_mtime_ns) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "r.csv", "r.json"]  # no temp files left


def test_nan_weights_report_and_check_exit_1(tmp_path, model, capsys):
    sd = dict(model.state_dict())
    sd["layers.1.attn.v_proj.weight"] = sd["layers.1.attn.v_proj.weight"].clone().fill_(float("inf"))
    torch.save(sd, tmp_path / "inf.pt")
    code, out, err = run_cli(capsys, tmp_path / "inf.pt", *HEADS, *FAST, "--check")
    assert code == 1, err
    assert "layers.1.attn.v_proj" in out


def test_no_traceback_through_a_real_subprocess(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"\x80\x04junk")
    r = subprocess.run([sys.executable, "-m", "reports", "diagnose", str(tmp_path / "junk.pt")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr


@settings(max_examples=40 * SCALE, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_checkpoints_through_the_cli(tmp_path, model, capsys, data):
    """Bit flips and truncations of a valid checkpoint: exit 0/1 with a report, or exit 2 in one line."""
    path = tmp_path / "valid.pt"
    if not path.exists():
        checkpoint.save(path, model)
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(1, len(raw) - 1))]
    else:
        for pos in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=6)):
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    fuzz = tmp_path / "fuzz.pt"
    fuzz.write_bytes(bytes(raw))
    code, out, err = run_cli(capsys, fuzz, *HEADS, *FAST)
    assert "Traceback" not in err and "internal error" not in err, err
    if code == 2:
        assert_one_line_error(code, err)
    else:
        assert code in (0, 1) and out


# --------------------------------------------------------------------------- the probe


class _BoomBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in the backward pass")


class RaisesOnThirdCall(torch.nn.Module):
    """Raises in its forward on the third call; with ``in_backward``, its backward raises instead."""

    def __init__(self, in_backward: bool = False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls, self.in_backward = 0, in_backward

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        if self.calls == 3:
            if not self.in_backward:
                raise RuntimeError("boom on the third call")
            y = _BoomBackward.apply(y)
        return y


def snapshot(model):
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()},
        "requires_grad": {k: v.requires_grad for k, v in model.named_parameters()},
        "training": {k: m.training for k, m in model.named_modules()},
        "hooks": {k: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                      len(m._backward_pre_hooks)) for k, m in model.named_modules()},
    }


def same(a, b):
    for key in ("params", "buffers"):
        if a[key].keys() != b[key].keys() or not all(torch.equal(a[key][k], b[key][k]) for k in a[key]):
            return False
    grads_equal = all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                      for x, y in zip(a["grads"].values(), b["grads"].values()))
    return grads_equal and all(a[k] == b[k] for k in ("requires_grad", "training", "hooks"))


@pytest.mark.parametrize("in_backward", [False, True], ids=["forward-raises", "backward-raises"])
def test_probe_restores_the_model_when_a_module_raises_midway(in_backward):
    from diagnostics import probe

    inner = RaisesOnThirdCall(in_backward)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), inner, torch.nn.Linear(4, 2))
    model.train()
    model[2].weight.requires_grad_(False)
    x = torch.randn(3, 4)
    for _ in range(2):  # calls 1 and 2; leaves gradients that must survive the probe
        model(x).sum().backward()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with probe(model):
            model(x).sum().backward()  # call 3: raises in the forward or in the backward
    assert inner.calls == 3
    assert same(before, snapshot(model))


def test_snapshot_comparison_detects_a_change():
    """Negative control: the comparison above notices a changed grad, mode or leftover hook."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    before = snapshot(model)
    saved = model[0].weight.grad.clone()
    model[0].weight.grad.add_(1.0)
    assert not same(before, snapshot(model))
    model[0].weight.grad.copy_(saved)
    model.eval()
    assert not same(before, snapshot(model))
    model.train()
    handle = model[0].register_forward_hook(lambda *a: None)
    assert not same(before, snapshot(model))
    handle.remove()
    assert same(before, snapshot(model))

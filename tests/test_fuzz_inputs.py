"""Hostile and careless inputs to every container the loaders read.

Each example writes one file, hands it to the loader and requires one of two outcomes:
a model (or token array), or a :class:`tinylm.errors.TinyLMError` with a one-line
message. Any other exception is the "internal error" a user must never see. The file
is byte- and mtime-identical afterwards, no case takes longer than CASE_SECONDS, and the
whole corpus adds at most PEAK_GROWTH_MIB to the process's peak resident memory. The
default run draws 160 checkpoints and 160 token files (320 cases); ``-m slow`` draws ten
times as many.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinylm
from tinylm import checkpoint
from tinylm.data import load_tokens
from tinylm.errors import TinyLMError

SMALL = tinylm.ModelConfig(vocab_size=40, context_length=8, d_model=8, num_layers=2, num_heads=2, d_ff=16)
_STATE = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0)).state_dict()

# --------------------------------------------------------------------------- strategies

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                      st.text(max_size=8))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                          max_leaves=12)
huge_or_odd = st.one_of(st.integers(-3, 3), st.sampled_from([10**6, 10**9, 2**63, -(2**63)]), st.floats(allow_nan=True),
                        st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2), st.booleans())
config_field = st.sampled_from(sorted(SMALL.to_dict()) + ["bogus"])


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["valid", "edited", "wrong_type", "junk"]))
    if kind == "valid":
        return SMALL.to_dict()
    if kind == "edited":
        cfg = SMALL.to_dict()
        for _ in range(draw(st.integers(1, 3))):
            field = draw(config_field)
            if draw(st.booleans()):
                cfg.pop(field, None)
            else:
                cfg[field] = draw(huge_or_odd)
        return cfg
    if kind == "wrong_type":
        return draw(st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=6), st.integers(), st.none()))
    return draw(json_value)


@st.composite
def states(draw):
    state = dict(_STATE)
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(state) + ["layers.9.ffn.w1.weight", "_orig_mod.lm_head.weight"]))
        how = draw(st.sampled_from(["drop", "shape", "int", "nan", "sparse", "half", "scalar", "notensor"]))
        base = state.get(key)
        base = base if isinstance(base, torch.Tensor) else torch.zeros(3, 3)
        base = base.to_dense() if base.is_sparse else base  # an earlier draw may have made this key sparse
        if how == "drop":
            state.pop(key, None)
        elif how == "shape":
            state[key] = torch.zeros(draw(st.integers(0, 5)), draw(st.integers(1, 5)))
        elif how == "int":
            state[key] = base.to(torch.int64)
        elif how == "nan":
            state[key] = torch.full_like(base, float("nan"))
        elif how == "sparse":
            state[key] = base.to_sparse()
        elif how == "half":
            state[key] = base.to(torch.float16)
        elif how == "scalar":
            state[key] = torch.tensor(1.0)
        else:
            state[key] = draw(json_leaf)
    return state


@st.composite
def checkpoints(draw):
    """(file name, bytes) of a checkpoint-like file."""
    kind = draw(st.sampled_from(["tinylm", "training", "bare", "safetensors", "bytes", "truncated", "zip"]))
    if kind in ("tinylm", "training", "bare"):
        state = draw(states())
        if kind == "bare":
            obj = state
        elif kind == "training":
            obj = {"model": state, "iteration": draw(huge_or_odd), "optimizer": draw(json_value)}
        else:
            obj = {"format": "tinylm", "version": draw(huge_or_odd), "config": draw(configs()), "model": state,
                   "iteration": draw(huge_or_odd), "history": draw(json_value)}
        buf = io.BytesIO()
        try:
            torch.save(obj, buf)
        except Exception:  # an object torch itself cannot write is not an input a user can have
            torch.save(_STATE, buf)
        return "m.pt", buf.getvalue()
    if kind == "safetensors":
        from safetensors.torch import save

        meta = {"config": draw(st.one_of(st.just(json.dumps(SMALL.to_dict())), st.text(max_size=20),
                                         st.builds(lambda v: json.dumps(v, default=str), configs()),
                                         st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)))}
        if draw(st.booleans()):
            meta["iteration"] = json.dumps(draw(huge_or_odd), default=str)
        if draw(st.booleans()):
            meta["history"] = draw(st.one_of(st.text(max_size=10), st.builds(lambda v: json.dumps(v, default=str),
                                                                             json_value)))
        state = {k: v.contiguous() for k, v in _STATE.items()}
        return "m.safetensors", save(state, metadata=meta)
    good = io.BytesIO()
    torch.save({"format": "tinylm", "version": 1, "config": SMALL.to_dict(), "model": _STATE}, good)
    data = good.getvalue()
    if kind == "truncated":
        return "m.pt", data[: draw(st.integers(0, len(data) - 1))]
    if kind == "zip":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr(draw(st.sampled_from(["archive/data.pkl", "m/data.pkl", "x"])), draw(st.binary(max_size=64)))
        return "m.pt", buf.getvalue()
    return draw(st.sampled_from(["m.pt", "m.safetensors", "m.bin"])), draw(st.binary(max_size=256))


@st.composite
def token_files(draw):
    kind = draw(st.sampled_from(["npy", "bin", "txt", "bytes"]))
    if kind == "npy":
        dtype = draw(st.sampled_from([">i2", "<i2", ">i4", "<i4", ">i8", "<i8", "u1", ">u2", "<u4", "<f4", ">f8",
                                      "?", "<c8"]))
        shape = draw(st.sampled_from([(0,), (1,), (50,), (4, 5), ()]))
        arr = np.asarray(draw(st.lists(st.integers(-5, 300), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
                         dtype=np.int64).reshape(shape).astype(dtype)
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        return "t.npy", buf.getvalue()
    if kind == "bin":
        return "t.bin", draw(st.binary(max_size=64))
    if kind == "txt":
        return "t.txt", draw(st.binary(max_size=64))
    return draw(st.sampled_from(["t.npy", "t.dat"])), draw(st.binary(max_size=64))


# --------------------------------------------------------------------------- the contract


#: the bound on the memory the whole corpus may add to the process (peak resident set): a few
#: kilobytes of file must never cost gigabytes
PEAK_GROWTH_MIB = 512
#: the bound on one case's time: a hang fails the case instead of the run
CASE_SECONDS = 60


@pytest.fixture(scope="module", autouse=True)
def bounded_memory():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    yield
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown < PEAK_GROWTH_MIB, f"the corpus grew the peak resident set by {grown:.0f} MiB"


def _one_line(e: BaseException) -> None:
    msg = str(e)
    assert msg and "\n" not in msg.strip() and "Traceback" not in msg, msg


def assert_contract(tmp_path: Path, name: str, data: bytes, fn) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    import signal

    def hang(signum, frame):
        raise AssertionError(f"{name}: no answer within {CASE_SECONDS} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(CASE_SECONDS)
    try:
        fn(path)
    except TinyLMError as e:
        _one_line(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    # anything else propagates and fails the example: an internal error
    assert path.read_bytes() == data and path.stat().st_mtime_ns == 1_000_000_000


def _load(path: Path) -> None:
    model, info = checkpoint.load(path, num_heads=2, rope_theta=10000.0, context_length=8)
    assert isinstance(model, tinylm.TransformerLM)
    assert info.iteration is None or (isinstance(info.iteration, int) and info.iteration >= 0)


def _read_tokens(path: Path) -> None:
    tokens = load_tokens(path, vocab_size=256)
    assert tokens.ndim == 1 and np.issubdtype(tokens.dtype, np.integer)
    assert len(tokens) == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < 256)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                      HealthCheck.data_too_large], derandomize=True)


@settings(max_examples=160, **SETTINGS)
@given(case=checkpoints())
def test_any_checkpoint_loads_or_is_a_one_line_error(tmp_path, case):
    assert_contract(tmp_path, *case, _load)


@settings(max_examples=160, **SETTINGS)
@given(case=token_files())
def test_any_token_file_reads_or_is_a_one_line_error(tmp_path, case):
    assert_contract(tmp_path, *case, _read_tokens)


@pytest.mark.slow
@settings(max_examples=1600, **SETTINGS)
@given(case=checkpoints())
def test_any_checkpoint_thorough(tmp_path, case):
    assert_contract(tmp_path, *case, _load)


@pytest.mark.slow
@settings(max_examples=1600, **SETTINGS)
@given(case=token_files())
def test_any_token_file_thorough(tmp_path, case):
    assert_contract(tmp_path, *case, _read_tokens)


def test_the_contract_rejects_an_internal_error(tmp_path):
    # negative control: an exception that is not a TinyLMError escapes assert_contract and fails the case
    def broken(path: Path) -> None:
        raise TypeError("'list' object is not a mapping")

    with pytest.raises(TypeError):
        assert_contract(tmp_path, "m.pt", b"x", broken)
    with pytest.raises(AssertionError):  # and a multi-line message is not one line
        _one_line(TinyLMError("first\nsecond"))

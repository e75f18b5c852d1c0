"""Hardened intake: every way a checkpoint can be wrong ends in a CheckpointError that names
the problem and the fix; nothing in a file is executed; fuzzed files never escape as tracebacks."""

import builtins
import os
import signal
import struct
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# The ci profile runs 25 examples by default; thorough (500) scales the fuzz up 20-fold.
SCALE = max(1, settings.default.max_examples // 25)

import tinylm
from tinylm.memory import MemoryLimitError, check_fits, estimate_bytes
from tinylm import checkpoint
from tinylm.errors import CheckpointError, TinyLMError, UnsafeCheckpointError

SMALL = tinylm.ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
FLAGS = dict(num_heads=2, rope_theta=10000.0, context_length=8)


@pytest.fixture(scope="module")
def model():
    return tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def valid_bytes(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("valid")
    checkpoint.save(d / "m.pt", model)
    checkpoint.save(d / "m.safetensors", model)
    torch.save(model.state_dict(), d / "bare.pt")
    return {name: (d / name).read_bytes() for name in ("m.pt", "m.safetensors", "bare.pt")}


def write(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def save_state(tmp_path, state, name="s.pt"):
    torch.save(state, tmp_path / name)
    return tmp_path / name


def assert_refused(path, *phrases, **flags):
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path, **flags)
    msg = str(err.value)
    assert "\n" not in msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


class Payload:
    """A pickle whose loading would create a file: the classic code-execution payload."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_code_execution_payload_is_refused_and_never_runs(tmp_path):
    target = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    torch.save({"model": Payload(target)}, path)
    msg = assert_refused(path, "executable" if False else "pickled Python objects", "system", "unsafe=True")
    assert not target.exists()
    assert "state_dict()" in msg  # says how to convert


def test_whole_module_pickle_is_refused_unless_unsafe(tmp_path, model):
    path = tmp_path / "module.pt"
    torch.save(model, path)
    with pytest.raises(UnsafeCheckpointError, match="tinylm.config.ModelConfig|tinylm.model.TransformerLM"):
        checkpoint.load(path)
    with pytest.warns(UserWarning, match="unsafe=True"):
        m2, info = checkpoint.load(path, unsafe=True)
    assert info.format == "module-pickle"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))


def test_missing_file_and_directory(tmp_path):
    assert_refused(tmp_path / "nope.pt", "no such file")
    assert_refused(tmp_path, "is a directory")


def test_unreadable_file(tmp_path, model, monkeypatch):
    path = tmp_path / "m.pt"
    checkpoint.save(path, model)
    real_open = builtins.open

    def denying_open(file, mode="r", *a, **k):
        if os.fspath(file) == os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", denying_open)  # root ignores chmod, so deny at open()
    assert_refused(path, "permission denied", "chmod")
    monkeypatch.setattr(builtins, "open", real_open)
    monkeypatch.setattr(checkpoint.os, "access", lambda p, m: False)
    assert_refused(path, "permission denied")


def test_empty_truncated_random_text_json(tmp_path, valid_bytes):
    assert_refused(write(tmp_path, "e.pt", b""), "empty file")
    b = valid_bytes["m.pt"]
    assert_refused(write(tmp_path, "t.pt", b[: len(b) // 2]), "truncated")
    assert_refused(write(tmp_path, "r.pt", os.urandom(4096)), "not a PyTorch checkpoint")
    assert_refused(write(tmp_path, "x.pt", b"hello, world\n" * 20), "text file")
    assert_refused(write(tmp_path, "j.json", b'{"vocab_size": 10}'), "text file")


def test_corrupt_safetensors_header(tmp_path, valid_bytes):
    b = bytearray(valid_bytes["m.safetensors"])
    n = struct.unpack("<Q", b[:8])[0]
    b[8 + n // 2 : 8 + n // 2 + 8] = b"@@@@@@@@"
    assert_refused(write(tmp_path, "h.safetensors", bytes(b)), "corrupt safetensors")
    assert_refused(write(tmp_path, "t.safetensors", valid_bytes["m.safetensors"][:-64]), "corrupt safetensors")


def test_state_dict_key_and_shape_mismatches(tmp_path, model):
    sd = model.state_dict()
    missing = {k: v for k, v in sd.items() if k != "layers.1.attn.q_proj.weight"}
    assert_refused(save_state(tmp_path, missing), "missing 1 key(s): layers.1.attn.q_proj.weight", **FLAGS)
    extra = {**sd, "layers.0.attn.bias": torch.zeros(2)}
    assert_refused(save_state(tmp_path, extra), "unexpected 1 key(s): layers.0.attn.bias", **FLAGS)
    wrong = {**sd, "layers.0.ffn.w2.weight": torch.zeros(16, 31)}
    assert_refused(save_state(tmp_path, wrong), "layers.0.ffn.w2.weight (16, 31) (expected (16, 32))", **FLAGS)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_non_float_weights(tmp_path, model, dtype):
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    assert_refused(save_state(tmp_path, sd), "non-float weights", str(dtype), **FLAGS)


@pytest.mark.parametrize(
    "change, phrase",
    [({"num_heads": 3}, "d_model must be divisible by num_heads"), ({"num_heads": 16}, "odd")],
)
def test_stored_config_that_fails_validation(tmp_path, model, change, phrase):
    path = tmp_path / "m.pt"
    checkpoint.save(path, model)
    obj = torch.load(path, weights_only=True)
    obj["config"].update(change)
    torch.save(obj, path)
    assert_refused(path, "stored config is invalid", phrase)


def test_not_a_state_dict(tmp_path):
    assert_refused(save_state(tmp_path, [1, 2, 3]), "holds a list")
    assert_refused(save_state(tmp_path, {}), "not a model state dict")
    assert_refused(save_state(tmp_path, {"w": torch.ones(2)}), "token_embeddings.weight", **FLAGS)


def test_nonfinite_weights_are_not_an_error(tmp_path, model):
    sd = dict(model.state_dict())
    sd["layers.1.ffn.w1.weight"] = sd["layers.1.ffn.w1.weight"].clone()
    sd["layers.1.ffn.w1.weight"][0, 0] = float("nan")
    m, info = checkpoint.load(save_state(tmp_path, sd), **FLAGS)
    assert info.nonfinite == ["layers.1.ffn.w1.weight"]


def test_loading_never_writes_the_file(tmp_path, model):
    path = tmp_path / "m.pt"
    checkpoint.save(path, model)
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    os.chmod(path, 0o444)  # a read-only file loads
    checkpoint.load(path)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


def test_memory_check_names_need_supply_and_a_batch_that_fits():
    c = tinylm.preset("tinystories")
    have = int(1.5 * estimate_bytes(c, 8, 256)) + 1
    assert check_fits(c, 8, 256, available=have) <= have
    with pytest.raises(MemoryLimitError, match=r"batch 64 x 256 would need about .* GiB .* try batch_size=8$"):
        check_fits(c, 64, 256, available=have)
    with pytest.raises(MemoryLimitError, match="shorter seq_len=N"):
        check_fits(c, 1, 256, available=1000)


# --------------------------------------------------------------------------- fuzzing


@contextmanager
def time_limit(seconds: int):
    def on_alarm(signum, frame):
        raise TimeoutError(f"case took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def corrupt(data: bytes, kind: str, draw) -> bytes:
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=2048))
    if kind == "truncate":
        return data[: draw(st.integers(1, len(data) - 1))]
    flips = draw(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 7)), min_size=1, max_size=8))
    b = bytearray(data)
    for pos, bit in flips:
        b[pos] ^= 1 << bit
    return bytes(b)


@settings(max_examples=320 * SCALE, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_checkpoints_load_or_fail_cleanly(tmp_path, valid_bytes, data):
    """Random bytes, bit flips and truncations of each format: a model or a CheckpointError, within 10 s."""
    name = data.draw(st.sampled_from(sorted(valid_bytes)))
    kind = data.draw(st.sampled_from(["random", "truncate", "flip"]))
    path = write(tmp_path, "fuzz" + os.path.splitext(name)[1], corrupt(valid_bytes[name], kind, data.draw))
    with time_limit(10):
        try:
            model, info = checkpoint.load(path, **FLAGS)
        except TinyLMError as e:
            assert str(e) and "\n" not in str(e)
        else:
            assert isinstance(model, tinylm.TransformerLM)

"""tinylm's own contract: the memory estimate against the tensors a model really holds, and the refusals.

``model_bytes`` is exact (every parameter and buffer of a meta-built model, counted by
torch); ``estimate_bytes`` is the formula its module documents, and it covers what
autograd really keeps for the backward pass of a small model; ``check_fits`` names the
largest batch size that fits; the host's supply is read from /proc and cgroup files,
faked here so every branch is reached. Properties of tinylm itself: ``tinylm_only``.
"""

from __future__ import annotations

import builtins
import io
import resource

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.contract import assert_refused
from props.record import prop
from props.strategies import generator, model_configs
from tinylm import memory
from tinylm.config import ModelConfig
from tinylm.functional import cross_entropy
from tinylm.memory import (MemoryLimitError, available_bytes, check_fits, check_model_fits, estimate_bytes,
                           model_bytes)
from tinylm.model import TransformerLM

pytestmark = pytest.mark.tinylm_only

CFG = ModelConfig(vocab_size=1000, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=192)
GIB = 2**30




@prop("model_bytes = the bytes of every parameter (at the dtype asked) and buffer of the model built on meta; objects = L x 64 KiB")
@settings(max_examples=25, deadline=None)
@given(cfg=model_configs(max_layers=3, max_vocab=40), dtype=st.sampled_from([None, torch.float32, torch.bfloat16, torch.float64]))
def test_model_bytes_are_the_models_tensors(cfg, dtype):
    m = TransformerLM(cfg, device="meta", dtype=dtype)
    params = {id(p): p for p in m.parameters()}
    assert m.num_parameters() == memory._params(cfg) == sum(p.numel() for p in params.values())
    measured = sum(p.numel() * p.element_size() for p in params.values()) + sum(b.numel() * b.element_size() for b in m.buffers())
    tensors, objects = model_bytes(cfg, dtype)
    assert tensors == measured and type(tensors) is int and type(objects) is int, (tensors, measured)
    assert objects == cfg.num_layers * memory.BLOCK_OBJECT_BYTES and memory.BLOCK_OBJECT_BYTES >= 47 * 1024


def _saved_bytes(cfg: ModelConfig, B: int, T: int) -> int:
    """Bytes of the distinct tensors autograd saves for one forward+backward of TransformerLM(cfg) at (B, T)."""
    model = TransformerLM(cfg, generator(0))
    seen: dict[tuple, int] = {}

    def pack(t):
        if t.layout == torch.strided and t.device.type == "cpu":
            seen[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=generator(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(model(tokens), tokens)
    loss.backward()
    return sum(seen.values())


@prop("estimate_bytes is its documented formula (5V + L(10d + 3d_ff + 4HT) per token, 3P, the RoPE tables; forward only a third and P), "
      "scales with the dtype's size, and covers what autograd saves plus weights and gradients")
@pytest.mark.parametrize("B, T, ffn, norm, tie", [(2, 16, "swiglu", "pre", False), (3, 32, "silu", "post", True),
                                                  (1, 64, "swiglu", "none", False)])
def test_estimate(B, T, ffn, norm, tie):
    c = CFG.replace(ffn=ffn, norm=norm, tie_embeddings=tie)
    P = TransformerLM(c, device="meta").num_parameters()
    per_token = 5 * c.vocab_size + c.num_layers * (10 * c.d_model + 3 * c.d_ff + 4 * c.num_heads * T)
    R = c.num_layers * 2 * c.context_length * c.head_dim * 4  # the float32 RoPE tables
    assert estimate_bytes(c, B, T) == 4 * (per_token * B * T + 3 * P) + R
    assert estimate_bytes(c, B, T, torch.bfloat16) == 2 * (per_token * B * T + 3 * P) + R
    assert estimate_bytes(c, B, T, torch.float64, backward=False) == 8 * (per_token // 3 * B * T + P) + R
    assert estimate_bytes(c, B, T, backward=False) < estimate_bytes(c, B, T)
    measured = _saved_bytes(c, B, T) + 2 * 4 * P  # what backward keeps, the weights and their gradients
    assert measured <= estimate_bytes(c, B, T), (measured, estimate_bytes(c, B, T))


def test_check_fits_names_the_largest_batch_that_fits():
    need = check_fits(CFG, 8, 32, available=10**12)
    assert need == int(1.5 * estimate_bytes(CFG, 8, 32))
    need64 = int(1.5 * estimate_bytes(CFG, 8, 32, torch.float64))
    assert check_fits(CFG, 8, 32, torch.float64, available=need64) == need64
    for b in range(1, 41):  # at every supply from just enough for b to one byte short of b + 1, the answer is b
        for have in (int(1.5 * estimate_bytes(CFG, b, 32)), int(1.5 * estimate_bytes(CFG, b + 1, 32)) - 1):
            with pytest.raises(MemoryLimitError, match=rf"; try batch_size={b}$"):
                check_fits(CFG, 41, 32, available=have)
    for have in (int(1.5 * estimate_bytes(CFG, 5, 32)), int(1.5 * estimate_bytes(CFG, 5, 32)) + 1,
                 int(1.5 * estimate_bytes(CFG, 1, 32)), int(1.5 * estimate_bytes(CFG, 1, 32)) - 1, 0):
        fits = max([b for b in range(1, 101) if 1.5 * estimate_bytes(CFG, b, 32) <= have], default=0)
        hint = f"try batch_size={fits}" if fits else "use a shorter seq_len=N or a smaller model"
        need = int(1.5 * estimate_bytes(CFG, 100, 32))
        assert_refused(MemoryLimitError, f"batch 100 x 32 would need about {need / GIB:.1f} GiB but {have / GIB:.1f} GiB is available; {hint}",
                check_fits, CFG, 100, 32, available=have)
    half = int(1.5 * estimate_bytes(CFG, 6, 32, torch.float16))
    with pytest.raises(MemoryLimitError, match=r"try batch_size=6$"):
        check_fits(CFG, 7, 32, torch.float16, available=half)


def test_check_fits_reads_the_host_when_not_told(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: int(1.5 * estimate_bytes(CFG, 2, 8)))
    assert check_fits(CFG, 2, 8) == int(1.5 * estimate_bytes(CFG, 2, 8))
    with pytest.raises(MemoryLimitError, match=r"try batch_size=2$"):
        check_fits(CFG, 3, 8)
    tensors, objects = model_bytes(CFG)
    monkeypatch.setattr(memory, "available_bytes", lambda: tensors + objects)
    check_model_fits(CFG)
    monkeypatch.setattr(memory, "available_bytes", lambda: tensors + objects - 1)
    with pytest.raises(MemoryLimitError):
        check_model_fits(CFG)


def test_check_model_fits():
    tensors, objects = model_bytes(CFG)
    check_model_fits(CFG, available=tensors + objects)
    check_model_fits(CFG, device="meta", available=objects)  # tensors off the host cost the host nothing
    check_model_fits(CFG, device=torch.device("cuda", 0), available=objects)
    check_model_fits(CFG, device="cpu:0", available=tensors + objects)
    with pytest.raises(MemoryLimitError):  # "cpu:0" is the host too
        check_model_fits(CFG, device="cpu:0", available=tensors + objects - 1)
    t64, _ = model_bytes(CFG, torch.float64)
    msg = ("a model with vocab_size=1000, context_length=64, d_model=64, num_layers=2, d_ff=192 would need about "
           f"{(t64 + objects) / GIB:.3g} GiB but {(tensors + objects) / GIB:.3g} GiB is available; check these sizes "
           "(a stored config or an override) and use a smaller model")
    assert_refused(MemoryLimitError, msg, check_model_fits, CFG, torch.float64, available=tensors + objects)
    assert_refused(MemoryLimitError, msg.replace(f"{(t64 + objects) / GIB:.3g}", f"{objects / GIB:.3g}").replace(
        f"{(tensors + objects) / GIB:.3g} GiB is", f"{(objects - 1) / GIB:.3g} GiB is"),
        check_model_fits, CFG, torch.float64, "meta", objects - 1)
    assert_refused(MemoryLimitError, msg.replace(f"{(t64 + objects) / GIB:.3g}", f"{(tensors + objects) / GIB:.3g}").replace(
        f"{(tensors + objects) / GIB:.3g} GiB is", f"{(tensors + objects - 1) / GIB:.3g} GiB is"),
        check_model_fits, CFG, None, "cpu", tensors + objects - 1)


def _fake_files(monkeypatch, files: dict[str, str]) -> None:
    def fake_open(path, *args, **kwargs):
        if str(path) in files:
            return io.StringIO(files[str(path)])
        raise FileNotFoundError(path)

    monkeypatch.setattr(memory, "open", fake_open, raising=False)


def test_read_int(tmp_path):
    (tmp_path / "a").write_text("123\n")
    (tmp_path / "b").write_text("max\n")
    assert memory._read_int(str(tmp_path / "a")) == 123
    assert memory._read_int(str(tmp_path / "b")) is None and memory._read_int(str(tmp_path / "c")) is None


@pytest.mark.parametrize("v2, v1, expected", [
    (("1000", "300"), None, [700]),
    (("1000", "3000"), None, [0]),
    (("1000", None), None, [1000]),
    (("max", "5"), None, []),
    ((str(1 << 60), "5"), None, []),
    (((1 << 60) - 1, "5"), None, [(1 << 60) - 6]),
    (None, ("800", "100"), [700]),
    (("1000", "300"), ("800", "100"), [700, 700]),
])
def test_cgroup_limits(monkeypatch, v2, v1, expected):
    files = {}
    for pair, (cap, use) in ((v2, ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")),
                             (v1, ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))):
        if pair is not None:
            files[cap] = str(pair[0])
            if pair[1] is not None:
                files[use] = pair[1]
    _fake_files(monkeypatch, files)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert memory._limits() == expected


def test_address_space_limit(monkeypatch):
    _fake_files(monkeypatch, {"/proc/self/statm": "10 2 3 0 0 0 0\n"})
    page = memory.os.sysconf("SC_PAGE_SIZE")
    seen = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (seen.append(which), (100 * page, resource.RLIM_INFINITY))[1])
    assert memory._limits() == [90 * page] and seen == [resource.RLIMIT_AS]
    monkeypatch.setattr(resource, "getrlimit", lambda which: (5 * page, resource.RLIM_INFINITY))
    assert memory._limits() == [0]
    _fake_files(monkeypatch, {})
    assert memory._limits() == []  # statm unreadable: no rlimit figure, no error


def test_available_bytes(monkeypatch):
    _fake_files(monkeypatch, {"/proc/meminfo": "MemTotal:  64 kB\nMemFree:  8 kB\nMemAvailable:  32 kB\n"})
    monkeypatch.setattr(memory, "_limits", lambda: [])
    assert available_bytes() == 32 * 1024
    monkeypatch.setattr(memory, "_limits", lambda: [40 * 1024, 20 * 1024])
    assert available_bytes() == 20 * 1024
    _fake_files(monkeypatch, {"/proc/meminfo": "MemTotal:  64 kB\n"})
    monkeypatch.setattr(memory, "_limits", lambda: [])
    os_ = memory.os
    assert available_bytes() == os_.sysconf("SC_PAGE_SIZE") * os_.sysconf("SC_PHYS_PAGES")
    _fake_files(monkeypatch, {})

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(os_, "sysconf", no_sysconf)
    assert available_bytes() == 1 << 62


def test_available_bytes_on_this_host():
    have = available_bytes()
    assert isinstance(have, int) and 0 < have <= builtins.max(memory.os.sysconf("SC_PAGE_SIZE") * memory.os.sysconf("SC_PHYS_PAGES"), 1)

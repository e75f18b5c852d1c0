"""tinylm's own contract: token files read as written, batches as CS336's ``get_batch``, the built-in corpus.

Round trips (a ``.npy`` / ``.bin`` / ``.txt`` file reads back as the ids written), batch
shapes, dtypes, ranges and determinism, and the one-line ``DataError`` for each way a
file can be unusable. Properties of tinylm itself, so marked ``tinylm_only``.
"""

from __future__ import annotations

import os
import pickle
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.contract import assert_refused
from props.record import prop
from props.strategies import generator
from tinylm import data
from tinylm.data import DataError, check_vocab, get_batch, load_tokens, random_tokens, stdlib_corpus

pytestmark = pytest.mark.tinylm_only




@prop("get_batch: (B, T) int64 windows of consecutive tokens, y = x shifted by one, starts in [0, n - T - 1]; seeded = reproducible")
@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 60), B=st.integers(1, 6), seed=st.integers(0, 2**31), data_=st.data())
def test_get_batch_windows(n, B, seed, data_):
    T = data_.draw(st.integers(1, n - 1))
    tokens = (np.arange(n, dtype=np.int64) * 7919) % 1000003  # distinct ids: a window's position is its first id
    x, y = get_batch(tokens, B, T, generator(seed))
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
    index = {int(v): i for i, v in enumerate(tokens)}
    for b in range(B):
        s = index[int(x[b, 0])]
        assert 0 <= s <= n - T - 1
        assert x[b].tolist() == tokens[s:s + T].tolist() and y[b].tolist() == tokens[s + 1:s + T + 1].tolist()
    x2, y2 = get_batch(tokens, B, T, generator(seed))
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_get_batch_reaches_every_start():
    """With n - T = 3 possible starts and 200 draws, a start is missed with probability 3 (2/3)^200 < 1e-34."""
    tokens = np.arange(7)
    x, _ = get_batch(tokens, 200, 4, generator(1))
    assert sorted(set(x[:, 0].tolist())) == [0, 1, 2]
    x, y = get_batch(np.arange(5, dtype=np.uint16), 3, 4, generator(2))  # n = T + 1: the only window
    assert x.tolist() == [[0, 1, 2, 3]] * 3 and y.tolist() == [[1, 2, 3, 4]] * 3 and x.dtype == torch.int64


def test_get_batch_device_and_short_data():
    x, y = get_batch(np.arange(10), 2, 3, generator(0), device="meta")
    assert x.device.type == "meta" and y.device.type == "meta"
    assert_refused(DataError, "4 tokens are fewer than context_length + 1 = 5; use more data or a shorter context_length=N",
            get_batch, np.arange(4), 2, 4, generator(0))


@prop("random_tokens: (B, T) int64 ids uniform over [0, V), both ends reached, seeded = reproducible")
@settings(max_examples=10)
@given(V=st.integers(1, 4), B=st.integers(1, 3), T=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_random_tokens(V, B, T, seed):
    t = random_tokens(V, B, T, generator(seed))
    assert t.shape == (B, T) and t.dtype == torch.int64 and int(t.min()) >= 0 and int(t.max()) < V
    assert torch.equal(t, random_tokens(V, B, T, generator(seed)))
    big = random_tokens(V, 40, 40, generator(seed))  # 1600 draws: an id is missed with probability < 4 (3/4)^1600
    assert sorted(set(big.flatten().tolist())) == list(range(V))


@prop("a token file reads back as the ids written: .npy (any integer dtype, memory-mapped), .bin (uint16), .txt (bytes)")
@settings(max_examples=10, deadline=None)
@given(ids=st.lists(st.integers(0, 65535), min_size=1, max_size=50),
       dtype=st.sampled_from([np.int64, np.int32, np.uint16]))
def test_token_files_round_trip(tmp_path_factory, ids, dtype):
    d = tmp_path_factory.mktemp("tok")
    arr = np.array(ids, dtype=dtype)
    np.save(d / "t.npy", arr)
    got = load_tokens(d / "t.npy", vocab_size=65536)
    assert isinstance(got, np.memmap) and got.dtype == arr.dtype and got.tolist() == ids
    arr.astype("<u2").tofile(d / "t.BIN")  # the suffix in any case
    got = load_tokens(str(d / "t.BIN"))
    assert isinstance(got, np.memmap) and got.dtype == np.uint16 and got.tolist() == ids and not got.flags.writeable
    text = bytes(i % 256 for i in ids)
    (d / "t.txt").write_bytes(text)
    got = load_tokens(d / "t.txt", vocab_size=256)
    assert got.dtype == np.uint8 and bytes(got) == text and not got.flags.writeable


def test_token_files_refused(tmp_path):
    p = tmp_path / "none.npy"
    assert_refused(DataError, f"{p}: no such file; check the path", load_tokens, p)
    assert_refused(DataError, f"{tmp_path}: is a directory; pass a .npy, .bin or .txt file", load_tokens, tmp_path)
    (tmp_path / "e.bin").write_bytes(b"")
    assert_refused(DataError, f"{tmp_path / 'e.bin'}: empty file; pass a file with tokens in it", load_tokens, tmp_path / "e.bin")
    (tmp_path / "o.bin").write_bytes(b"abc")
    assert_refused(DataError, f"{tmp_path / 'o.bin'}: odd byte count; a .bin token file is raw uint16 (2 bytes per token)",
            load_tokens, tmp_path / "o.bin")
    (tmp_path / "t.csv").write_text("1,2")
    assert_refused(DataError, f"{tmp_path / 't.csv'}: unknown suffix '.csv'; use .npy, .bin (uint16) or .txt", load_tokens,
            tmp_path / "t.csv")
    (tmp_path / "t.txt").write_text("hello")
    assert_refused(DataError, f"{tmp_path / 't.txt'}: text is tokenised as bytes (ids 0..255) but vocab_size=255; "
            "use a model with vocab_size >= 256 or pre-tokenised .npy/.bin data", load_tokens, tmp_path / "t.txt", 255)
    assert bytes(load_tokens(tmp_path / "t.txt")) == b"hello"  # no vocab_size: no check
    (tmp_path / "pickle.npy").write_bytes(pickle.dumps([1, 2, 3]))  # a pickle under a .npy name is never unpickled
    try:
        np.load(tmp_path / "pickle.npy", allow_pickle=False)
    except ValueError as e:
        why = str(e).splitlines()[0]
    assert len(why) > 100
    assert_refused(DataError, f"{tmp_path / 'pickle.npy'}: not a readable .npy array ({why[:100]}); write tokens with np.save(path, "
            "array)", load_tokens, tmp_path / "pickle.npy")
    (tmp_path / "bad.npy").write_bytes(b"not numpy at all")
    with pytest.raises(DataError, match=r"not a readable \.npy array \(.+\); write tokens with np\.save\(path, array\)$"):
        load_tokens(tmp_path / "bad.npy")
    np.save(tmp_path / "obj.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match=r"obj\.npy: not a readable \.npy array"):  # never unpickled
        load_tokens(tmp_path / "obj.npy")
    np.save(tmp_path / "f.npy", np.array([0.5, 2.0], dtype=np.float32))
    assert_refused(DataError, f"{tmp_path / 'f.npy'}: holds a 1-D float32 array (values 0.5 .. 2.0); tokens must be a 1-D "
            "integer array (np.save(path, ids.astype(np.int64)))", load_tokens, tmp_path / "f.npy")
    np.save(tmp_path / "m.npy", np.zeros((2, 2), dtype=np.int64))
    assert_refused(DataError, f"{tmp_path / 'm.npy'}: holds a 2-D int64 array; tokens must be a 1-D "
            "integer array (np.save(path, ids.astype(np.int64)))", load_tokens, tmp_path / "m.npy")
    np.save(tmp_path / "b.npy", np.array([True, False]))
    assert_refused(DataError, f"{tmp_path / 'b.npy'}: holds a 1-D bool array; tokens must be a 1-D "
            "integer array (np.save(path, ids.astype(np.int64)))", load_tokens, tmp_path / "b.npy")
    np.save(tmp_path / "z.npy", np.zeros(0))
    assert_refused(DataError, f"{tmp_path / 'z.npy'}: holds a 1-D float64 array; tokens must be a 1-D "
            "integer array (np.save(path, ids.astype(np.int64)))", load_tokens, tmp_path / "z.npy")


def test_unreadable_token_file(tmp_path, monkeypatch):
    p = tmp_path / "t.bin"
    p.write_bytes(b"\x01\x00")
    monkeypatch.setattr(os, "access", lambda path, mode: mode != os.R_OK)  # as an unprivileged user without read rights
    assert_refused(DataError, f"{p}: not readable (permission denied); fix its permissions", load_tokens, p)


def test_vocabulary_check(tmp_path):
    np.save(tmp_path / "t.npy", np.array([0, 3, 9], dtype=np.int64))
    assert_refused(DataError, f"{tmp_path / 't.npy'}: token id 9 is outside the model's vocabulary [0, 9); "
            "the data was tokenised for another vocabulary", load_tokens, tmp_path / "t.npy", 9)
    assert load_tokens(tmp_path / "t.npy", 10).tolist() == [0, 3, 9]
    assert_refused(DataError, "ids: token id -1 is outside the model's vocabulary [0, 4); the data was tokenised for another vocabulary",
            check_vocab, np.array([-1, 2]), 4, "ids")
    assert_refused(DataError, "tokens: token id 4 is outside the model's vocabulary [0, 4); the data was tokenised for another vocabulary",
            check_vocab, np.array([-1, 4]), 4)
    assert_refused(DataError, "tokens: no tokens", check_vocab, np.zeros(0, dtype=np.int64), 4)
    np.save(tmp_path / "e.npy", np.zeros(0, dtype=np.int64))
    assert_refused(DataError, f"{tmp_path / 'e.npy'}: no tokens", load_tokens, tmp_path / "e.npy", 4)
    check_vocab(np.array([0, 3]), 4)


def test_stdlib_corpus_reads_sorted_sources_without_tests(tmp_path, monkeypatch):
    files = {"b.py": b"B" * 5, "a.py": b"A" * 3, "test/t.py": b"T", "pkg/tests/u.py": b"U", "idlelib/i.py": b"I",
             "site-packages/s.py": b"S", "dist-packages/d.py": b"D", "pkg/m.py": b"M" * 4, "c.txt": b"C"}
    for rel, body in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(body)
    (tmp_path / "_gone.py").symlink_to(tmp_path / "gone.py")  # unreadable, and first in order: skipped
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    whole = stdlib_corpus()
    assert whole.dtype == np.uint8 and bytes(whole) == b"AAABBBBBMMMM"
    assert bytes(stdlib_corpus(4)) == b"AAAB" and bytes(stdlib_corpus(3)) == b"AAA" and bytes(stdlib_corpus(9)) == b"AAABBBBBM"
    read, real = [], Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: (read.append(self.name), real(self))[1])
    assert bytes(stdlib_corpus(8)) == b"AAABBBBB" and read == ["_gone.py", "a.py", "b.py"]  # stops once it has enough
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(empty)})
    assert_refused(DataError, f"no .py files found under {empty}; use a token file instead (data=PATH)", stdlib_corpus)


def test_stdlib_corpus_default_size(tmp_path, monkeypatch):
    (tmp_path / "big.py").write_bytes(bytes(range(256)) * 31250 + b"tail")  # 8_000_004 bytes
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    c = stdlib_corpus()
    assert c.dtype == np.uint8 and len(c) == 8_000_000 and bytes(c[-3:]) == bytes([253, 254, 255])


def test_data_error_is_the_users_error():
    assert issubclass(DataError, data.TinyLMError)

"""Sizes from a file or a flag are checked before anything is built: no few-kilobyte file costs gigabytes."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import tinylm
from tinylm import checkpoint
from tinylm.data import DataError, load_tokens
from tinylm.errors import CheckpointError
from tinylm.memory import MemoryLimitError, check_model_fits, model_bytes

SMALL = tinylm.ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True}, {"norm": "post", "ffn": "silu", "positions": "none"},
                                     {"norm": "none"}])
def test_model_bytes_counts_every_parameter_and_the_rope_tables(changes):
    config = SMALL.replace(**changes)
    m = tinylm.TransformerLM(config)
    tensors, objects = model_bytes(config)
    params = sum(p.numel() for p in m.parameters()) * 4  # a tied matrix once
    buffers = sum(b.numel() * b.element_size() for b in m.buffers())
    assert tensors == params + buffers
    assert objects == config.num_layers * 64 * 1024


@pytest.mark.parametrize("changes", [{"num_layers": 10**6}, {"context_length": 10**9}, {"d_model": 2**20, "d_ff": 8}])
def test_an_absurd_config_is_refused_before_any_allocation(changes):
    config = SMALL.replace(**changes)
    t = time.perf_counter()
    with pytest.raises(MemoryLimitError, match="would need about .* GiB but .* GiB is available"):
        tinylm.TransformerLM(config)
    assert time.perf_counter() - t < 1.0  # refused from arithmetic, not from a failed allocation


def test_the_check_refuses_only_what_does_not_fit():
    check_model_fits(SMALL, available=10**9)  # fits: no error
    need = sum(model_bytes(SMALL))
    with pytest.raises(MemoryLimitError):
        check_model_fits(SMALL, available=need - 1)  # negative control: one byte short
    check_model_fits(SMALL, device="meta", available=model_bytes(SMALL)[1])  # meta: only the objects count


def _edited(tmp_path, edit):
    path = tmp_path / "m.pt"
    checkpoint.save(path, tinylm.TransformerLM(SMALL))
    obj = torch.load(path, weights_only=True)
    edit(obj)
    torch.save(obj, path)
    return path


@pytest.mark.parametrize("field, value", [("num_layers", 10**6), ("d_model", 10**9), ("vocab_size", 7), ("d_ff", 64)])
def test_a_stored_config_that_contradicts_the_weights_is_refused_fast(tmp_path, field, value):
    path = _edited(tmp_path, lambda o: o.__setitem__("config", {**o["config"], field: value}))
    before = path.read_bytes()
    t = time.perf_counter()
    with pytest.raises(CheckpointError, match=f"{field}={value} but the weights show"):
        checkpoint.load(path)
    assert time.perf_counter() - t < 2.0
    assert path.read_bytes() == before


@pytest.mark.parametrize("config", [[1, 2, 3], "hello", 7])
def test_a_stored_config_of_the_wrong_type_is_a_checkpoint_error(tmp_path, config):
    path = _edited(tmp_path, lambda o: o.__setitem__("config", config))
    with pytest.raises(CheckpointError, match=f"stored config is a {type(config).__name__}, not a dict"):
        checkpoint.load(path)


@pytest.mark.parametrize("stored, read", [(12, 12), ("12", None), (-1, None), (2.5, None), (True, None)])
def test_a_stored_iteration_reads_as_a_count_or_as_unknown(tmp_path, stored, read):
    path = _edited(tmp_path, lambda o: o.__setitem__("iteration", stored))
    assert checkpoint.load(path)[1].iteration == read


@pytest.mark.parametrize("dtype", [">i4", "<i8", ">u2", "u1", ">i8"])
def test_token_files_in_any_byte_order_and_integer_dtype(tmp_path, dtype):
    ids = (np.arange(100) * 7 % 50).astype(dtype)
    np.save(tmp_path / "t.npy", ids)
    assert np.array_equal(np.asarray(load_tokens(tmp_path / "t.npy", vocab_size=50), dtype=np.int64), ids.astype(np.int64))


def test_a_float_token_file_is_refused_with_the_range_found(tmp_path):
    np.save(tmp_path / "t.npy", np.linspace(0, 3, 10, dtype=np.float32))
    with pytest.raises(DataError, match=r"float32 array \(values 0.0 .. 3.0\)"):
        load_tokens(tmp_path / "t.npy")


def test_text_is_memory_mapped_not_read_whole(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"hello world")
    tokens = load_tokens(tmp_path / "t.txt", vocab_size=256)
    assert isinstance(tokens, np.memmap) and bytes(np.asarray(tokens)) == b"hello world"


def _safetensors_with(tmp_path, **metadata):
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    state = {k: v.contiguous() for k, v in tinylm.TransformerLM(SMALL).state_dict().items()}
    save_file(state, str(path), metadata={"config": __import__("json").dumps(SMALL.to_dict()), **metadata})
    return path


def test_deeply_nested_metadata_is_refused_not_recursed(tmp_path):
    path = _safetensors_with(tmp_path, note="[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nests 100000 levels deep"):
        checkpoint.load(path)


def test_metadata_within_bounds_still_reads(tmp_path):
    # negative control for the bound: nesting and strings with brackets inside are read as JSON
    path = _safetensors_with(tmp_path, note='{"a": [[1, 2], {"b": "]]]}}\\\\\\"["}]}')
    assert checkpoint.load(path)[1].extra["note"] == {"a": [[1, 2], {"b": ']]]}}\\"['}]}


def test_sparse_weights_are_refused(tmp_path):
    path = tmp_path / "m.pt"
    state = tinylm.TransformerLM(SMALL).state_dict()
    state["layers.0.ffn.w1.weight"] = state["layers.0.ffn.w1.weight"].to_sparse()
    torch.save({"format": "tinylm", "version": 1, "config": SMALL.to_dict(), "model": state}, path)
    with pytest.raises(CheckpointError, match="sparse or non-dense weights: layers.0.ffn.w1.weight"):
        checkpoint.load(path)


def test_a_sparse_head_in_a_bare_state_dict_is_refused_by_name(tmp_path):
    # without a stored config the shapes are read first, and a sparse lm_head has no storage to compare
    path = tmp_path / "bare.pt"
    state = tinylm.TransformerLM(SMALL).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"].to_sparse()
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="sparse or non-dense weights: lm_head.weight"):
        checkpoint.load(path, num_heads=SMALL.num_heads, context_length=SMALL.context_length,
                        rope_theta=SMALL.rope_theta)


def test_seeds_beyond_64_bits_are_refused():
    from diagnostics.options import DiagnoseOptions, OptionsError
    from tinylm.train import TrainError, TrainOptions

    with pytest.raises(OptionsError, match=r"seed=\d+: must be an integer in \[0, 9223372036854775807\]"):
        DiagnoseOptions(seed=2**64)
    with pytest.raises(TrainError, match="seed="):
        TrainOptions(steps=1, seed=2**70)
    DiagnoseOptions(seed=2**63 - 1)


def test_available_memory_respects_an_address_space_limit():
    import subprocess
    import sys

    code = ("import resource, tinylm.memory as m; full = m.available_bytes(); "
            "resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.getrlimit(resource.RLIMIT_AS)[1])); "
            "low = m.available_bytes(); print(full > low, low <= 8 << 30)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]


def test_a_damaged_sampler_state_is_a_checkpoint_error():
    from tinylm.train import TrainOptions, _sampler_generator

    with pytest.raises(CheckpointError, match="sampler state is damaged"):
        _sampler_generator(TrainOptions(steps=1), torch.zeros(7, dtype=torch.uint8))
    good = torch.Generator().manual_seed(5).get_state()
    assert torch.equal(_sampler_generator(TrainOptions(steps=1), good).get_state(), good)


@pytest.mark.parametrize("w", [torch.full((4, 3), float("nan")), torch.full((4, 3), float("inf")),
                               torch.full((4, 3), 1e30), torch.full((4, 3), 1e-30)])
def test_spectral_statistics_of_any_matrix_are_a_number_or_missing(w):
    import math

    from diagnostics.measure.probe import spectral_stats

    top, rank = spectral_stats(w)
    if torch.isfinite(w).all():  # scaled before the Gram product: no overflow, no underflow
        assert math.isclose(top, float(torch.linalg.matrix_norm(w.double(), ord=2)), rel_tol=1e-6)
        assert math.isclose(rank, 1.0, rel_tol=1e-6)
    else:
        assert math.isnan(top) and math.isnan(rank)


def test_a_probe_of_a_model_with_huge_or_inf_weights_still_measures():
    import math

    from diagnostics import ProbeOptions, probe

    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.layers[0].ffn.w1.weight[0, 0] = float("inf")
        model.layers[1].ffn.w1.weight.mul_(1e25)  # finite, but its float32 Gram matrix would overflow
    x = torch.randint(0, 50, (2, 8))
    with probe(model, ProbeOptions(spectral=True)) as run:
        model(x).float().sum().backward()
    params = run.stats.params
    assert params["layers.0.ffn.w1.weight"].spectral_norm is None  # not finite: not computed
    assert math.isfinite(params["layers.1.ffn.w1.weight"].spectral_norm) and params["layers.1.ffn.w1.weight"].spectral_norm > 1e24
    assert math.isfinite(params["layers.0.ffn.w2.weight"].spectral_norm)

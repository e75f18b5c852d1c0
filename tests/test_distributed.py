"""merge_distributed over gloo with two spawned CPU processes equals one process on the concatenated batch."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tinylm
from diagnostics import OptionsError, ProbeStats, merge_distributed, probe

CFG = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)


def _tokens():
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(7))


def _run(model, x):
    with probe(model) as run:
        model(x[:, :-1]).sum().backward()  # a sum of logits: per-example gradients do not depend on the batch
    return run.stats


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0))
        stats = _run(model, _tokens()[2 * rank: 2 * rank + 2])
        merged = merge_distributed(stats)
        torch.save(merged.to_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.slow  # spawns two interpreters that each import torch
def test_gloo_two_ranks_equal_one_process(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = ProbeStats.from_dict(torch.load(tmp_path / "rank0.pt", weights_only=False))
    r1 = ProbeStats.from_dict(torch.load(tmp_path / "rank1.pt", weights_only=False))
    single = _run(tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0)), _tokens())
    assert r0.tensors == r1.tensors  # every rank gets the same figures
    assert r0.tensors.keys() == single.tensors.keys()
    for k, m in single.tensors.items():
        d = r0.tensors[k]
        assert d.count == m.count and d.n_zero == m.n_zero and d.max_abs == m.max_abs, k
        # the ranks' halves merged (Chan, float64) against one pass over both halves (float32 rows)
        assert abs(d.mean - m.mean) <= 1e-6 * (abs(m.mean) + m.std), k
        assert abs(d.var - m.var) <= 1e-5 * m.var, k


def test_needs_an_initialised_group():
    with pytest.raises(OptionsError, match="not initialised"):
        merge_distributed(ProbeStats())

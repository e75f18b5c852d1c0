"""Checkpoints: every format round-trips bit-identically; configs are inferred from shapes."""

import subprocess
import sys

import pytest
import torch

import tinylm
from tinylm import checkpoint

SMALL = tinylm.ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
FLAGS = dict(num_heads=2, rope_theta=10000.0, context_length=8)


def model_of(config=SMALL, seed=0, dtype=None):
    m = tinylm.TransformerLM(config, generator=torch.Generator().manual_seed(seed))
    return m.to(dtype) if dtype else m


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True}, {"norm": "post", "ffn": "silu", "positions": "none"}])
def test_tinylm_format_round_trip_is_bit_identical(tmp_path, suffix, changes):
    m = model_of(SMALL.replace(**changes))
    path = tmp_path / f"m{suffix}"
    checkpoint.save(path, m, iteration=7)
    m2, info = checkpoint.load(path)
    assert same_weights(m, m2)
    assert m2.config == m.config
    assert info.config_source == "stored" and info.iteration == 7
    x = torch.randint(0, 50, (2, 8))
    assert torch.equal(m.eval()(x), m2(x))
    if m.config.tie_embeddings:
        assert m2.lm_head.weight is m2.token_embeddings.weight


def test_bfloat16_weights_keep_their_dtype(tmp_path):
    m = model_of(dtype=torch.bfloat16)
    checkpoint.save(tmp_path / "m.pt", m)
    m2, _ = checkpoint.load(tmp_path / "m.pt")
    assert same_weights(m, m2)


def test_bare_state_dict_with_compile_prefix_loads(tmp_path):
    m = model_of()
    torch.save({"_orig_mod." + k: v for k, v in m.state_dict().items()}, tmp_path / "bare.pt")
    m2, info = checkpoint.load(tmp_path / "bare.pt", **FLAGS)
    assert info.format == "state_dict" and info.config_source == "inferred"
    assert same_weights(m, m2) and m2.config == SMALL


def test_training_checkpoint_loads(tmp_path):
    m = model_of()
    opt = torch.optim.AdamW(m.parameters())
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "iteration": 123}, tmp_path / "ck.pt")
    m2, info = checkpoint.load(tmp_path / "ck.pt", **FLAGS)
    assert info.format == "training" and info.iteration == 123 and info.has_optimizer
    assert same_weights(m, m2)


@pytest.mark.parametrize("missing", ["num_heads", "context_length", "rope_theta"])
def test_missing_setting_names_its_argument(tmp_path, missing):
    torch.save(model_of().state_dict(), tmp_path / "bare.pt")
    flags = {k: v for k, v in FLAGS.items() if k != missing}
    with pytest.raises(tinylm.MissingOptionError, match=f"pass {missing}="):
        checkpoint.load(tmp_path / "bare.pt", **flags)


def test_rope_theta_not_needed_without_rope(tmp_path):
    torch.save(model_of(SMALL.replace(positions="none")).state_dict(), tmp_path / "bare.pt")
    m, _ = checkpoint.load(tmp_path / "bare.pt", num_heads=2, context_length=8, positions="none")
    assert m.config.positions == "none"


@pytest.mark.parametrize(
    "changes", [{"norm": "pre"}, {"norm": "post"}, {"norm": "none"}, {"ffn": "silu"}, {"tie_embeddings": True}, {"num_layers": 3}]
)
def test_config_inferred_from_shapes(changes):
    c = SMALL.replace(**changes)
    state = model_of(c).state_dict()
    if c.tie_embeddings:
        del state["lm_head.weight"]
    assert checkpoint.infer_config(state, **FLAGS) == c


def test_save_is_atomic_on_failure(tmp_path):
    path = tmp_path / "m.pt"
    path.write_bytes(b"previous")

    def boom(tmp):
        open(tmp, "wb").write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        checkpoint.atomic_write(path, boom)
    assert path.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"]  # no temp file left behind


def test_cli_init_writes_a_checkpoint_load_reads_back_identically(tmp_path):
    out = tmp_path / "m.pt"
    r = subprocess.run([sys.executable, "-m", "reports", "init", "--preset", "tiny", "--seed", "5", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m, info = checkpoint.load(out)
    assert info.format == "tinylm" and m.config == tinylm.preset("tiny")
    assert same_weights(m, model_of(tinylm.preset("tiny"), seed=5))
    again = subprocess.run([sys.executable, "-m", "reports", "init", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr


def test_a_bare_state_dict_of_grouped_query_attention_gives_its_kv_heads():
    """k_proj's rows / d_k are the K/V heads once num_heads is given; a plain model keeps None."""
    import dataclasses

    from tinylm.checkpoint import infer_config

    cfg = dataclasses.replace(tinylm.preset("tiny"), num_kv_heads=2)
    state = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0)).state_dict()
    given = dict(num_heads=cfg.num_heads, rope_theta=cfg.rope_theta, context_length=cfg.context_length)
    assert infer_config(state, **given).num_kv_heads == 2
    plain = tinylm.TransformerLM(tinylm.preset("tiny"), generator=torch.Generator().manual_seed(0)).state_dict()
    assert infer_config(plain, **given).num_kv_heads is None

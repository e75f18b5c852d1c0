"""How close tinylm, loaded from a Hugging Face directory, computes to ``transformers`` itself.

For each architecture and seed: a randomly initialised ``transformers`` model (d 64, 2 layers,
4 heads, vocab 1000; every parameter drawn from N(0, 0.1^2), norm gains from 1 + N(0, 0.2^2)) is
saved with ``save_pretrained``, read back with ``tinylm.hf.load``, and both compute float32 logits
of the same tokens and the gradient of every parameter for the loss sum(logits * R) (R fixed
Gaussian). Printed: the relative error max|a - b| / max|b| of the logits and the largest over
parameters of the same for gradients. A second table lengthens the sequence to show where the
remaining difference comes from (RoPE angles: transformers computes them in float32, tinylm in
float64).

    python benchmarks/hf_equivalence.py            # the numbers in docs/hf.md
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

import tinylm
from tinylm import hf

V, D, L, H, FF = 1000, 64, 2, 4, 128


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def build(arch: str, context: int, tied: bool):
    import transformers

    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
                                       num_attention_heads=H, num_key_value_heads=H, max_position_embeddings=context,
                                       rms_norm_eps=1e-5, tie_word_embeddings=tied)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=context,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg)


def errors(arch: str, seed: int, T: int, tied: bool) -> tuple[float, float, str]:
    """(logits error, worst gradient error, the parameter it belongs to)."""
    theirs = randomise(build(arch, max(T, 32), tied), seed).train()
    theirs.tie_weights()
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(Path(tmp) / "m")
        ours, _ = hf.load(Path(tmp) / "m")
    ours.train()
    g = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, V, (2, T), generator=g)
    weights = torch.randn(2, T, V, generator=g)
    a, b = ours(tokens), theirs(tokens).logits
    (a * weights).sum().backward()
    (b * weights).sum().backward()
    mine = hf.to_hf_state({k: p.grad for k, p in ours.named_parameters()}, ours.config)
    grads = {k: rel(mine[k], p.grad) for k, p in theirs.named_parameters()}
    worst = max(grads, key=grads.get)
    return rel(a, b), grads[worst], worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    archs = ["llama"]
    if "norm_kind" in {f.name for f in dataclasses.fields(tinylm.ModelConfig)}:
        archs.append("gpt2")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, float32, CPU, 1 thread")
    print(f"{'arch':6} {'tied':5} {'T':>5} {'logits max':>11} {'grad max':>10}  worst gradient")
    for arch in archs:
        for tied in (False, True):
            runs = [errors(arch, s, 16, tied) for s in range(args.seeds)]
            lg = max(r[0] for r in runs)
            gw = max(runs, key=lambda r: r[1])
            print(f"{arch:6} {str(tied):5} {16:>5} {lg:11.2e} {gw[1]:10.2e}  {gw[2]}")
    print("sequence length (seed 0, untied):")
    for arch in archs:
        for T in (16, 128, 1024):
            lg, gr, name = errors(arch, 0, T, False)
            print(f"{arch:6} {'False':5} {T:>5} {lg:11.2e} {gr:10.2e}  {name}")
    print(f"llama at 1024 tokens with tinylm's RoPE tables from float32 angles, as transformers computes them: "
          f"logits error {float32_angles_error(1024):.2e}")
    print(f"negative control, q/k rows not permuted (llama, seed 0): logits error {unpermuted_error(0):.2e}")
    return 0


def float32_angles_error(T: int, seed: int = 0) -> float:
    """The logits error at T tokens once tinylm's cos/sin tables are filled from float32 angles
    (inv_freq and positions in float32, as transformers does) instead of float64 ones."""
    from tinylm.layers import RotaryPositionalEmbedding

    theirs = randomise(build("llama", T, False), seed).eval()
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(Path(tmp) / "m")
        ours, _ = hf.load(Path(tmp) / "m")
    for m in ours.modules():
        if isinstance(m, RotaryPositionalEmbedding):
            inv_freq = 1.0 / (m.theta ** (torch.arange(0, m.d_k, 2).float() / m.d_k))  # (d_k/2,) float32
            angles = torch.arange(m.max_seq_len).float()[:, None] * inv_freq  # (T_max, d_k/2) float32
            m.cos.copy_(angles.cos())
            m.sin.copy_(angles.sin())
    tokens = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1000 + seed))
    with torch.no_grad():
        return rel(ours(tokens), theirs(tokens).logits)


def unpermuted_error(seed: int) -> float:
    """The logits error when q and k are copied as they are (adjacent pairs taken for rotate_half pairs)."""
    theirs = randomise(build("llama", 32, False), seed).eval()
    config = hf.config_from_hf(theirs.config.to_dict())
    state = hf.from_hf_state(theirs.state_dict(), config)
    for i in range(L):
        for x in "qk":
            state[f"layers.{i}.attn.{x}_proj.weight"] = theirs.state_dict()[f"model.layers.{i}.self_attn.{x}_proj.weight"]
    ours = tinylm.TransformerLM(config)
    ours.load_state_dict(state)
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1000 + seed))
    with torch.no_grad():
        return rel(ours.eval()(tokens), theirs(tokens).logits)


if __name__ == "__main__":
    raise SystemExit(main())

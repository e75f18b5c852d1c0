"""Measurement shared by the token-kernel tests: seeded models on uniform random tokens, probed."""

from __future__ import annotations

import torch

import tinylm
from diagnostics import ProbeOptions, probe


def forward_moments(cfg: tinylm.ModelConfig, seeds: int, batch: int, seq: int):
    """Per seed s (init and tokens drawn from seed s): {tensor: [forward variance]}, {residual point:
    [mean token cosine]}, and the last seed's model."""
    var: dict[str, list[float]] = {}
    cos: dict[str, list[float]] = {}
    opts = ProbeOptions(backward=False, attention=False, params=False)
    for s in range(seeds):
        gen = torch.Generator().manual_seed(s)
        model = tinylm.TransformerLM(cfg, generator=gen)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        with torch.no_grad(), probe(model, opts) as run:
            model(tokens)
        for (name, _), m in run.stats.tensors.items():
            var.setdefault(name, []).append(m.var)
        for name, m in run.stats.cosine.items():
            cos.setdefault(name, []).append(m.mean)
    return var, cos, model


def backward_variances(cfg: tinylm.ModelConfig, seeds: int, batch: int, seq: int):
    """Per seed s (init and tokens drawn from seed s; next-token cross-entropy on seq + 1 tokens):
    {tensor: [gradient variance]}, and the last seed's model."""
    var: dict[str, list[float]] = {}
    opts = ProbeOptions(backward=True, attention=False, params=False, cosine=False)
    for s in range(seeds):
        gen = torch.Generator().manual_seed(s)
        model = tinylm.TransformerLM(cfg, generator=gen)
        data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        with probe(model, opts) as run:
            tinylm.functional.cross_entropy(model(data[:, :-1]).float(), data[:, 1:]).backward()
        for (name, direction), m in run.stats.tensors.items():
            if direction == "backward":
                var.setdefault(name, []).append(m.var)
    return var, model

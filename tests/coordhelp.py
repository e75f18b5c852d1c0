"""Models for the coordinate-check tests: tinylm in muP, in SP and with each classic mistake."""

from __future__ import annotations

import torch

import tinylm
from tinylm import ModelConfig, TransformerLM

BASE = 32
MISTAKES = ("attention", "hidden_lr", "readout", "embedding_lr", "init_std")


def tinylm_config(width: int, parametrization: str = "mup", layers: int = 2, vocab: int = 128) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, context_length=32, d_model=width, num_layers=layers, num_heads=4,
                       d_ff=2 * width, parametrization=parametrization,
                       mup_base_width=BASE if parametrization == "mup" else None)


def tinylm_case(case: str, layers: int = 2, lr: float = 1e-2):
    """(make_model, make_optimizer) of tinylm: "mup", "sp", or muP with one mistake of MISTAKES."""
    parametrization = "sp" if case == "sp" else "mup"

    def make_model(width):
        model = TransformerLM(tinylm_config(width, parametrization, layers))
        if case == "attention":  # 1/sqrt(d_head) attention in an otherwise muP model
            for block in model.layers:
                block.attn.query_multiplier = 1.0
        if case == "readout":
            model.output_multiplier = 1.0
        if case == "init_std":  # hidden weights N(0, 0.02^2) at every width
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if tinylm.mup.classify(model).get(name) == "hidden":
                        p.normal_(0.0, 0.02)
        return model

    def make_optimizer(model, width):
        if case in ("sp", "hidden_lr"):
            return torch.optim.Adam(model.parameters(), lr=lr)
        groups = tinylm.mup.param_groups(model, lr)
        if case == "embedding_lr":
            for g in groups:
                if g["name"] == "embedding":
                    g["lr"] = lr / model.config.width_mult
        return torch.optim.Adam(groups, lr=lr)

    return make_model, make_optimizer

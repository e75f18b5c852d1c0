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


# --- a plain-PyTorch GPT (nanoGPT's layout) with muP written by hand, and each mistake -------------

import math  # noqa: E402

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads, scale, eager):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.heads, self.scale, self.eager = heads, scale, eager

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.eager:
            att = (q @ k.transpose(-2, -1)) * self.scale
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width, heads, scale, eager):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = CausalSelfAttention(width, heads, scale, eager), MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    """GPT in plain PyTorch. ``mup``: 1/d_head attention (sqrt(d_base_head)/d_head), logits times
    base/width, readout init variance 1/base; else SP (1/sqrt(d_head), no multiplier, 1/fan_in)."""

    def __init__(self, width, *, mup=True, attention_mup=None, readout_mult=None, init_fixed=False, eager=False,
                 vocab=128, heads=4, layers=1, context=32, base=BASE, readout=None):
        super().__init__()
        attention_mup = mup if attention_mup is None else attention_mup
        d_head, base_head = width // heads, base // heads
        scale = math.sqrt(base_head) / d_head if attention_mup else 1 / math.sqrt(d_head)
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads, scale, eager) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = readout if readout is not None else nn.Linear(width, vocab, bias=False)
        self.mult = (base / width) if (mup if readout_mult is None else readout_mult) and readout is None else 1.0
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith("h.") and p.dim() == 2:
                    p.normal_(0.0, 0.02 if init_fixed else 1 / math.sqrt(p.shape[1]))
                elif name.endswith("bias"):
                    p.zero_()
            if readout is None:
                self.lm_head.weight.normal_(0.0, 1 / math.sqrt(base if mup else width))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) * self.mult


def plain_case(case: str, lr: float = 1e-2, eager: bool = False):
    """(make_model, make_optimizer) of PlainGPT: "mup", "sp" or muP with one of MISTAKES."""
    mup = case != "sp"

    def make_model(width):
        return PlainGPT(width, mup=mup, attention_mup=mup and case != "attention",
                        readout_mult=mup and case != "readout", init_fixed=case == "init_std", eager=eager)

    def make_optimizer(model, width):
        m = width / BASE
        hidden = [p for n, p in model.named_parameters() if n.startswith("h.") and p.dim() == 2]
        ids = {id(p) for p in hidden}
        emb = [model.wte.weight, model.wpe.weight]
        rest = [p for p in model.parameters() if id(p) not in ids and all(p is not e for e in emb)]
        hidden_lr = lr if case in ("sp", "hidden_lr") else lr / m
        emb_lr = lr / m if case == "embedding_lr" else lr
        return torch.optim.Adam([{"params": hidden, "lr": hidden_lr}, {"params": emb, "lr": emb_lr},
                                 {"params": rest, "lr": lr}])

    return make_model, make_optimizer


def mup_package_case(case: str, lr: float = 1e-2):
    """(make_model, make_optimizer) of a GPT built with the mup package's own layers: MuReadout,
    set_base_shapes, MuAdam ("mup"), or the same model in SP (base shapes None: width_mult 1)."""
    import mup

    def build(width):
        readout = mup.MuReadout(width, 128, bias=False)
        return PlainGPT(width, mup=case == "mup", readout=readout)

    def make_model(width):
        model = build(width)
        if case == "mup":
            mup.set_base_shapes(model, build(BASE), delta=build(2 * BASE))
        else:
            mup.set_base_shapes(model, None)
        return model

    def make_optimizer(model, width):
        return mup.MuAdam(model.parameters(), lr=lr)

    return make_model, make_optimizer

"""The Maximal Update Parametrization (muP) of a tinylm model: its init and its learning rates.

muP (Yang et al. 2022, "Tensor Programs V") makes a model's training dynamics independent of
its width, so the hyperparameters tuned at a small base width transfer to a large one. With
width_mult m = d_model / mup_base_width (``ModelConfig.width_mult``), a tinylm model with
``parametrization="mup"`` follows these rules (Adam; "hidden" = every Linear weight but the
readout, i.e. q/k/v/output_proj and the FFN's matrices):

==================  =====================================  =========================  =====================
parameter           init (scheme S evaluated at base fans)  forward multiplier         Adam lr  (SGD lr)
==================  =====================================  =========================  =====================
embeddings          S, unchanged: var constant in width    1                          lr       (lr m)
hidden weights      S's std times 1/sqrt(m): var ~ 1/fan_in 1                          lr / m   (lr)
readout (lm_head)   S at the base fan_in: var constant     logits = lm_head(x) / m    lr       (lr m)
attention logits    --                                     q.k sqrt(d_base_head)/d_k  --
norm gains, biases  S, unchanged                           1                          lr       (lr m)
==================  =====================================  =========================  =====================

"S evaluated at base fans": the scheme's rule is computed for a parameter whose width
dimensions (d_model, d_ff, the heads' width: every dimension but the vocabulary and the
context) are divided by m, so at m = 1 every rule is the standard model's, exactly, and a
fixed-std scheme (gpt2's 0.02) becomes 0.02 / sqrt(m) for hidden weights. The SGD column is
``mup.MuSGD``'s rule (vector-like parameters lr m, matrix-like lr times fan_out/fan_in mult).
Options: ``mup_readout_zero_init`` (lm_head starts at 0), ``mup_query_zero_init`` (q_proj
starts at 0) and depth-muP (``mup_base_depth``: CompleteP with alpha = 1, every residual branch
times L_base / L; under Adam the learning rates above carry over unchanged at alpha = 1).

:func:`param_groups` gives a torch optimizer the per-parameter learning rates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from .errors import ConfigError
from .layers import Embedding, Linear
from .validate import choice, fail, number

__all__ = ["scheme", "param_groups", "classify", "OPTIMIZERS"]

OPTIMIZERS = ("adam", "sgd")
READOUT = "lm_head.weight"


def _config(model: nn.Module):
    return getattr(model, "config", None)


def is_mup(model: nn.Module) -> bool:
    """Whether ``model`` is a tinylm model in muP."""
    return getattr(_config(model), "parametrization", "sp") == "mup"


def _scaled(dist, c: float, why: str):
    """``dist`` with every draw multiplied by ``c`` (a constant 0 stays 0)."""
    if dist.family == "constant":
        return dataclasses.replace(dist, value=dist.value * c, why=dist.why + why)
    return dataclasses.replace(dist, std=dist.std * c, low=dist.low * c, high=dist.high * c, why=dist.why + why)


def _zero(dist, why: str):
    return dataclasses.replace(dist, family="constant", value=0.0, std=0.0, why=why)


def scheme(config, base):
    """The muP version of the init scheme ``base`` (a function ParamSite -> Dist) for ``config``:
    the table in the module docstring. Identical to ``base`` when ``config.width_mult`` is 1 and
    no zero-init option is set."""
    m = config.width_mult

    def rule(site):
        # width dimensions: every fan but an embedding's fan_in (1) and the readout's fan_out (V)
        fan_in = site.fan_in if site.kind == "embedding" else site.fan_in / m
        fan_out = site.fan_out if site.name == READOUT else site.fan_out / m
        base_site = dataclasses.replace(site, fan_in=fan_in, fan_out=fan_out, d_model=site.d_model / m)
        dist = base(base_site)
        if site.kind != "linear_weight":
            return dist  # embeddings, norms, biases: constant in width
        if site.name == READOUT:
            if config.mup_readout_zero_init:
                return _zero(dist, "muP: readout zero-initialised")
            return dist  # variance constant in width; the forward's 1/m does the rest
        if config.mup_query_zero_init and site.name.endswith("attn.q_proj.weight"):
            return _zero(dist, "muP: queries zero-initialised")
        if m == 1.0:
            return dist
        return _scaled(dist, 1.0 / math.sqrt(m), f"; muP: times 1/sqrt(width_mult={m:g}) (variance ~ 1/fan_in)")

    return rule


def classify(model: nn.Module) -> dict[str, str]:
    """{parameter name: role} of a tinylm model, each distinct parameter once: "embedding",
    "hidden", "readout", "vector" (norm gains, biases, anything with one width dimension)."""
    owner: dict[int, nn.Module] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
    roles = {}
    for name, p in model.named_parameters():
        mod = owner[id(p)]
        if isinstance(mod, Embedding):
            roles[name] = "embedding"
        elif isinstance(mod, Linear) and name.endswith("weight"):
            roles[name] = "readout" if name == READOUT else "hidden"
        else:
            roles[name] = "vector"
    return roles


def _factor(role: str, optimizer: str, m: float) -> float:
    if optimizer == "adam":
        return 1.0 / m if role == "hidden" else 1.0
    return 1.0 if role == "hidden" else m


def param_groups(model: nn.Module, lr: float, optimizer: str = "adam") -> list[dict[str, Any]]:
    """Parameter groups for ``torch.optim.Adam``/``AdamW`` (``optimizer="adam"``) or ``SGD``
    (``"sgd"``) with each parameter's muP learning rate (module docstring): one group per role,
    each ``{"params", "lr", "lr_scale", "name"}`` (``lr_scale``: the group's lr over ``lr``, for a
    schedule to multiply). A model in "sp" (or any other module) gets one group at
    ``lr``. Under Adam: hidden matrices lr / width_mult, everything else lr; under SGD: hidden
    matrices lr, embeddings, readout, norm gains and biases lr * width_mult.

    Example::

        opt = torch.optim.AdamW(tinylm.mup.param_groups(model, 3e-3), weight_decay=0.0)
    """
    number("lr", lr, low=0.0, strict_low=True, error=ConfigError)
    choice("optimizer", optimizer, OPTIMIZERS, error=ConfigError)
    if not isinstance(model, nn.Module):
        fail("model", type(model).__name__, "be an nn.Module", error=ConfigError)
    if not is_mup(model):
        return [{"params": list(model.parameters()), "lr": lr, "lr_scale": 1.0, "name": "all"}]
    m = model.config.width_mult
    named = dict(model.named_parameters())
    groups: dict[str, dict[str, Any]] = {}
    for name, role in classify(model).items():
        scale = _factor(role, optimizer, m)
        group = groups.setdefault(role, {"params": [], "lr": lr * scale, "lr_scale": scale, "name": role})
        group["params"].append(named[name])
    return list(groups.values())


def optimizer(model: nn.Module, lr: float, kind: str = "adam", **kwargs) -> torch.optim.Optimizer:
    """``torch.optim.Adam`` (``kind="adam"``) or ``SGD`` over :func:`param_groups`."""
    groups = param_groups(model, lr, kind)
    return torch.optim.Adam(groups, lr=lr, **kwargs) if kind == "adam" else torch.optim.SGD(groups, lr=lr, **kwargs)

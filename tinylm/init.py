"""Named initialization schemes, each declaring the distribution it draws every parameter from.

A scheme is a function from a :class:`ParamSite` (which parameter, of which
module kind, with which fans) to a :class:`Dist` (family, std, bounds, and why).
``apply`` samples every parameter from its declared ``Dist``; ``declare`` returns
the declarations without touching the model, so diagnostics can compare a
checkpoint with them and theory can predict from them. One mechanism serves all
schemes; a scheme only states its rules.

The rules of the built-in schemes (d_in, d_out: a Linear's fans; d: d_model;
L: number of blocks; "residual outputs": attn.output_proj and ffn.w2):

==============  ==========================================================  ============================
scheme          Linear weights                                              Embeddings / norm gain
==============  ==========================================================  ============================
cs336           N(0, 2/(d_in+d_out)) truncated at +-3 sigma                 N(0,1) truncated [-3,3] / 1
kaiming         N(0, 2/d_in) truncated at +-3 sigma                         as cs336
torch-default   U(-1/sqrt(d_in), 1/sqrt(d_in)) (nn.Linear's default)        N(0,1) (nn.Embedding's) / 1
gpt2            N(0, 0.02^2); residual outputs N(0, (0.02/sqrt(2L))^2)      N(0, 0.02^2) / 1
small-init      N(0, 2/(5d)); residual outputs std 2/(L sqrt(d))            N(0, 2/(5d)) / 1
zero-residual   as cs336, but residual outputs are 0 (blocks start as id.)  as cs336
==============  ==========================================================  ============================

"Embeddings" covers both tables: the token embedding and, with learned positions, the
position embedding (``position_embeddings``), which every scheme draws like the token
table (gpt2: N(0, 0.02^2), as GPT-2 does; cs336: N(0,1) truncated [-3,3]; and so on).
The norm gain is RMSNorm's or LayerNorm's ``weight``: the block norms' and, with
``ModelConfig.qk_norm``, the attention's ``q_norm`` and ``k_norm`` (d_k entries; 1 under every
scheme, their LayerNorm bias 0).

Biases (only present with ``ModelConfig.bias``): every Linear bias is 0, except
torch-default's U(-1/sqrt(d_in), 1/sqrt(d_in)) (nn.Linear's default); LayerNorm's bias
is 0 under every scheme.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NoReturn

import torch
from torch import nn

from .errors import ConfigError
from .validate import check, fail, refuse
from .layers import Embedding, LayerNorm, Linear, RMSNorm

__all__ = [
    "Dist",
    "ParamSite",
    "Scheme",
    "SCHEMES",
    "register",
    "get",
    "sites",
    "declare",
    "apply",
    "truncnorm_variance",
]

RESIDUAL_OUTPUTS = ("attn.output_proj.weight", "ffn.w2.weight")


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2)))


def truncnorm_variance(sigma: float, low: float, high: float) -> float:
    """Variance of N(0, sigma^2) truncated to [low, high] (absolute bounds).

    With a = low/sigma, b = high/sigma and Z = Phi(b) - Phi(a):
    Var = sigma^2 [1 + (a phi(a) - b phi(b))/Z - ((phi(a) - phi(b))/Z)^2].
    For symmetric bounds +-k sigma this is sigma^2 (1 - 2 k phi(k) / (2 Phi(k) - 1)),
    0.97334 sigma^2 at k = 3.
    """
    if sigma == 0:
        return 0.0
    a, b = low / sigma, high / sigma
    z = _Phi(b) - _Phi(a)
    pa, pb = _phi(a), _phi(b)
    a_pa = a * pa if math.isfinite(a) else 0.0
    b_pb = b * pb if math.isfinite(b) else 0.0
    return sigma**2 * (1 + (a_pa - b_pb) / z - ((pa - pb) / z) ** 2)


FAMILIES = ("trunc_normal", "normal", "uniform", "constant")


@dataclass(frozen=True)
class Dist:
    """The distribution one parameter is drawn from.

    family: "trunc_normal" (N(0, std^2) cut to [low, high], absolute bounds),
    "normal" (N(0, std^2)), "uniform" (U(low, high)) or "constant" (every entry = value).
    ``std`` is the sigma parameter of the normal families; ``variance`` is the
    variance the draws actually have (truncation corrected).
    """

    family: str
    std: float = 0.0
    low: float = -math.inf
    high: float = math.inf
    value: float = 0.0
    why: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            fail("family", self.family, "be trunc_normal, normal, uniform or constant", error=ConfigError)
        if self.family == "uniform" and not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            refuse(f"uniform bounds low={self.low}, high={self.high}: need finite low < high", error=ConfigError,
                   argument="low")
        if self.family in ("normal", "trunc_normal"):
            check("std", self.std, lambda v: v >= 0, "be >= 0", error=ConfigError)

    @property
    def mean(self) -> float:
        if self.family == "constant":
            return self.value
        if self.family == "uniform":
            return 0.5 * (self.low + self.high)
        if self.family == "trunc_normal" and self.std > 0 and self.low != -self.high:
            a, b = self.low / self.std, self.high / self.std
            return self.std * (_phi(a) - _phi(b)) / (_Phi(b) - _Phi(a))
        return 0.0

    @property
    def variance(self) -> float:
        """The variance of the draws (for trunc_normal, below std^2 by the truncation)."""
        if self.family == "constant":
            return 0.0
        if self.family == "uniform":
            return (self.high - self.low) ** 2 / 12.0
        if self.family == "normal":
            return self.std**2
        return truncnorm_variance(self.std, self.low, self.high)

    @property
    def actual_std(self) -> float:
        return math.sqrt(self.variance)

    @property
    def bounds(self) -> tuple[float, float]:
        """Closed interval every draw lies in (infinite for an untruncated normal)."""
        if self.family == "constant":
            return (self.value, self.value)
        return (self.low, self.high)

    @torch.no_grad()
    def sample_(self, tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Fill ``tensor`` in place with draws from this distribution."""
        if self.family == "constant":
            return tensor.fill_(self.value)
        if self.family == "uniform":
            return tensor.uniform_(self.low, self.high, generator=generator)
        if self.family == "normal" or self.std == 0:
            return tensor.normal_(0.0, self.std, generator=generator)
        return _trunc_normal_(tensor, self.std, self.low, self.high, generator)

    def describe(self) -> str:
        if self.family == "constant":
            return f"const {self.value:g}"
        if self.family == "uniform":
            return f"U({self.low:.4g}, {self.high:.4g})"
        if self.family == "normal":
            return f"N(0, {self.std:.4g}^2)"
        return f"TN(0, {self.std:.4g}^2, [{self.low:.4g}, {self.high:.4g}])"


@torch.no_grad()
def _trunc_normal_(t: torch.Tensor, std: float, low: float, high: float, gen: torch.Generator | None) -> torch.Tensor:
    """Exact draws from N(0, std^2) restricted to [low, high].

    Rejection sampling (redraw the entries that fall outside) is exact and, when most
    of the mass lies inside, cheaper than inverse-CDF sampling; otherwise
    torch's inverse-CDF ``trunc_normal_`` is used.
    """
    accept = _Phi(high / std) - _Phi(low / std)
    if accept < 0.5 or t.numel() == 0:
        return nn.init.trunc_normal_(t, mean=0.0, std=std, a=low, b=high, generator=gen)
    flat = t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    flat.normal_(0.0, std, generator=gen)
    bad = ((flat < low) | (flat > high)).nonzero().squeeze(-1)
    while bad.numel():
        redraw = torch.empty(bad.numel(), dtype=t.dtype, device=t.device).normal_(0.0, std, generator=gen)
        flat[bad] = redraw
        bad = bad[(redraw < low) | (redraw > high)]
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat.view_as(t))
    return t


def _trunc3(std: float, why: str) -> Dist:
    return Dist("trunc_normal", std=std, low=-3 * std, high=3 * std, why=why)


@dataclass(frozen=True)
class ParamSite:
    """Where a parameter sits, all a scheme needs to choose its distribution.

    kind: "linear_weight", "linear_bias", "embedding" (token or position table), "norm_gain"
    (RMSNorm's or LayerNorm's weight), "norm_bias" (LayerNorm's bias) or "other".
    fan_in / fan_out: d_in / d_out of a Linear (embedding: 1 / d; norm gain and bias: d / d).
    residual_output: the parameter is attn.output_proj.weight or ffn.w2.weight.
    num_layers, d_model: of the model (1 and fan_out when not known).
    """

    name: str
    kind: str
    fan_in: int
    fan_out: int
    residual_output: bool
    num_layers: int
    d_model: int


Scheme = Callable[[ParamSite], Dist]


def _unsupported(scheme: str, site: ParamSite) -> NoReturn:
    refuse(f"init scheme {scheme!r} has no rule for parameter {site.name!r} of kind {site.kind!r}",
           "register a scheme that covers it (tinylm.init.register)", error=ConfigError)


def _common(scheme: str, site: ParamSite) -> Dist:
    if site.kind == "norm_gain":
        return Dist("constant", value=1.0, why="norm gains start at 1: the norm's output has unit RMS")
    if site.kind == "linear_bias":
        return Dist("constant", value=0.0, why="biases start at 0")
    if site.kind == "norm_bias":
        return Dist("constant", value=0.0, why="LayerNorm's bias starts at 0: the norm's output has mean 0")
    _unsupported(scheme, site)


def cs336(site: ParamSite) -> Dist:
    if site.kind == "linear_weight":
        std = math.sqrt(2.0 / (site.fan_in + site.fan_out))
        return _trunc3(std, "Xavier/Glorot: 2/(d_in+d_out) is the harmonic compromise of the forward 1/d_in "
                            "and backward 1/d_out conditions; truncated at 3 sigma")
    if site.kind == "embedding":
        return Dist("trunc_normal", std=1.0, low=-3.0, high=3.0, why="unit-variance token vectors, truncated at 3")
    return _common("cs336", site)


def kaiming(site: ParamSite) -> Dist:
    if site.kind == "linear_weight":
        return _trunc3(math.sqrt(2.0 / site.fan_in), "He/Kaiming: 2/d_in keeps the second moment through a ReLU")
    if site.kind == "embedding":
        return cs336(site)
    return _common("kaiming", site)


def torch_default(site: ParamSite) -> Dist:
    bound = 1.0 / math.sqrt(site.fan_in)
    if site.kind in ("linear_weight", "linear_bias"):
        return Dist("uniform", low=-bound, high=bound,
                    why="nn.Linear's default: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(d_in))")
    if site.kind == "embedding":
        return Dist("normal", std=1.0, why="nn.Embedding's default N(0, 1)")
    return _common("torch-default", site)


def gpt2(site: ParamSite) -> Dist:
    if site.kind in ("linear_weight", "embedding"):
        if site.residual_output:
            return Dist("normal", std=0.02 / math.sqrt(2 * site.num_layers),
                        why="GPT-2: residual outputs scaled by 1/sqrt(2L) so the 2L branch sums stay O(1)")
        return Dist("normal", std=0.02, why="GPT-2: N(0, 0.02^2)")
    return _common("gpt2", site)


def small_init(site: ParamSite) -> Dist:
    if site.kind in ("linear_weight", "embedding"):
        if site.residual_output:
            return Dist("normal", std=2.0 / (site.num_layers * math.sqrt(site.d_model)),
                        why="Wang: residual outputs std 2/(L sqrt(d))")
        return Dist("normal", std=math.sqrt(2.0 / (5 * site.d_model)), why="Nguyen & Salazar small init: N(0, 2/(5d))")
    return _common("small-init", site)


def zero_residual(site: ParamSite) -> Dist:
    if site.kind == "linear_weight" and site.residual_output:
        return Dist("constant", value=0.0, why="residual outputs zero: every block starts as the identity")
    if site.kind in ("linear_weight", "embedding"):
        return cs336(site)
    return _common("zero-residual", site)


SCHEMES: dict[str, Scheme] = {
    "cs336": cs336,
    "kaiming": kaiming,
    "torch-default": torch_default,
    "gpt2": gpt2,
    "small-init": small_init,
    "zero-residual": zero_residual,
}


def register(name: str, scheme: Scheme, *, overwrite: bool = False) -> Scheme:
    """Add ``scheme`` (a function ParamSite -> Dist) to the registry under ``name``.

    Example::

        def tiny_std(site):
            if site.kind == "linear_weight":
                return Dist("normal", std=1e-3, why="deliberately small")
            return tinylm.init.cs336(site)

        tinylm.init.register("tiny-std", tiny_std)
        tinylm.init.apply(model, "tiny-std")
    """
    if not isinstance(name, str) or not name:
        refuse(f"name={name!r}: a scheme needs a non-empty name", error=ConfigError, argument="name")
    check("scheme", scheme, callable, "be a function ParamSite -> Dist", error=ConfigError)
    if name in SCHEMES and not overwrite:
        refuse(f"init scheme {name!r} exists already", "pass overwrite=True to replace it", error=ConfigError,
               argument="name")
    SCHEMES[name] = scheme
    return scheme


def get(name: str) -> Scheme:
    if name not in SCHEMES:
        refuse(f"unknown init scheme {name!r}", f"choose one of {', '.join(SCHEMES)}", error=ConfigError,
               argument="name")
    return SCHEMES[name]


def sites(model: nn.Module) -> dict[str, tuple[ParamSite, nn.Parameter]]:
    """Every distinct parameter of ``model`` (tied ones once) with its site."""
    config = getattr(model, "config", None)
    num_layers = getattr(config, "num_layers", None) or len(getattr(model, "layers", ())) or 1
    owner: dict[int, nn.Module] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
    out: dict[str, tuple[ParamSite, nn.Parameter]] = {}
    for name, p in model.named_parameters():
        mod = owner[id(p)]
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, Linear):
            kind = "linear_weight" if leaf == "weight" else "linear_bias"
            fan_in, fan_out = mod.in_features, mod.out_features
        elif isinstance(mod, Embedding):
            kind, fan_in, fan_out = "embedding", 1, mod.embedding_dim
        elif isinstance(mod, (RMSNorm, LayerNorm)):
            kind = "norm_gain" if leaf == "weight" else "norm_bias"
            fan_in, fan_out = mod.d_model, mod.d_model
        else:
            kind = "other"
            fan_in = p.shape[-1] if p.dim() else 1
            fan_out = p.shape[0] if p.dim() else 1
        d_model = getattr(config, "d_model", None) or fan_out
        residual = any(name.endswith(s) for s in RESIDUAL_OUTPUTS)
        out[name] = (ParamSite(name, kind, fan_in, fan_out, residual, num_layers, d_model), p)
    return out


def _for(model: nn.Module, scheme: str | Scheme) -> Scheme:
    """The scheme's function; for a tinylm model in muP, its muP version (``tinylm.mup.scheme``)."""
    fn = get(scheme) if isinstance(scheme, str) else scheme
    config = getattr(model, "config", None)
    if getattr(config, "parametrization", "sp") == "mup":
        from . import mup  # imports this module's names lazily

        return mup.scheme(config, fn)
    return fn


def declare(model: nn.Module, scheme: str | Scheme) -> dict[str, Dist]:
    """The distribution ``scheme`` intends for every parameter of ``model`` (nothing is changed);
    for a tinylm model in muP, the scheme's muP version (see :mod:`tinylm.mup`)."""
    fn = _for(model, scheme)
    return {name: fn(site) for name, (site, _) in sites(model).items()}


@torch.no_grad()
def apply(model: nn.Module, scheme: str | Scheme = "cs336", generator: torch.Generator | None = None) -> dict[str, Dist]:
    """Re-initialise ``model`` in place from ``scheme``; returns the declarations used.

    Parameters are drawn in ``named_parameters`` order, so a seeded ``generator``
    gives the same model every time. A tinylm model in muP is drawn from the scheme's muP
    version (see :mod:`tinylm.mup`).
    """
    fn = _for(model, scheme)
    decl = {}
    for name, (site, p) in sites(model).items():
        dist = fn(site)
        if not isinstance(dist, Dist):
            refuse(f"init scheme returned {type(dist).__name__} for {name!r}", "it must return a tinylm.init.Dist",
                   error=ConfigError, argument="scheme")
        dist.sample_(p, generator=generator)
        decl[name] = dist
    return decl

"""What a model declares of its init, and whether its weights are still at it: decided once per diagnosis.

Internal to :mod:`diagnostics.jobs.diagnose`. A model carries a declared init only when one is
known:

* a tinylm model built in code or read from a tinylm checkpoint: its config's scheme
  (``model.config.init``), unless the model says otherwise in ``model.declared_init`` (a dict set
  by :func:`tinylm.hf.load`: ``{"source": ..., "initializer_range": r, "scaled_residual": bool}``
  for a Hugging Face config that names its init, ``{"source": ...}`` for one that does not);
* any other module whose config holds ``initializer_range`` r (a Hugging Face ``PreTrainedModel``):
  what transformers' ``_init_weights`` draws, N(0, r^2) for every Linear, Conv1D and Embedding
  weight, GPT-2's residual projections (``c_proj``) N(0, (r / sqrt(2 n_layer))^2);
* nothing else: the weights are then judged by their scale only.

Fresh or trained (:func:`fresh`): a model is fresh when every weight matrix and embedding with a
declared std (block weights, the head and the embeddings alike) has a std within
``FRESH_SIGMAS / sqrt(2 n)`` of its declared one, relative (n its entry count), and every
parameter declared constant still is. The std of n independent draws of a distribution with
kurtosis k has relative standard deviation sqrt((k - 1) / (4 n)), at most 1/sqrt(2 n) for the
normal, truncated normal and uniform draws of the schemes (k <= 3); five of those is a fresh
draw's spread with a false "trained" rate under 1e-6 per weight. Unknown (None) without a
declaration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

import tinylm
from tinylm.init import Dist, declare

__all__ = ["Declaration", "declaration", "fresh", "fresh_one", "FRESH_SIGMAS", "FRESH_RULE"]

#: How many standard deviations of a fresh draw's std estimate a weight may sit from its declared std.
FRESH_SIGMAS = 5.0

#: The rule, as the report states it.
FRESH_RULE = (f"fresh: every weight matrix and embedding within {FRESH_SIGMAS:g}/sqrt(2n) of its declared "
              "init std (n its entries; a fresh draw's spread), constant ones unchanged")


@dataclass(frozen=True)
class Declaration:
    """The declared init of one model: ``words`` as the report says it ("cs336 (model config)",
    "initializer_range 0.02 (config.json)", "none"), ``scheme`` the tinylm scheme name when the
    declaration is one (global theory can then use it), ``dists`` {parameter name: its declared
    distribution} ({} when nothing is declared)."""

    words: str
    scheme: str | None
    dists: dict[str, Dist]

    @property
    def known(self) -> bool:
        return bool(self.dists)


NONE = "none: weights judged by scale only"


def declaration(model: nn.Module) -> Declaration:
    """The model's declared init (see the module docstring)."""
    marked = getattr(model, "declared_init", None)
    if isinstance(model, tinylm.TransformerLM):
        if isinstance(marked, dict):
            r = marked.get("initializer_range")
            if not _positive(r):
                return Declaration(NONE, None, {})
            scaled = bool(marked.get("scaled_residual"))
            words = f"initializer_range {float(r):g} ({marked.get('source', 'config.json')})"
            if scaled and float(r) == 0.02:  # exactly tinylm's gpt2 scheme: global theory can use it
                return Declaration(f"{words}, the gpt2 scheme", "gpt2", declare(model, "gpt2"))
            return Declaration(words, None, declare(model, _hf_scheme(float(r), scaled)))
        init = model.config.init
        if init not in tinylm.init.SCHEMES:
            return Declaration(NONE, None, {})
        return Declaration(f"{init} (model config)", init, declare(model, init))
    config = getattr(model, "config", None)
    r = getattr(config, "initializer_range", None)
    if not _positive(r):
        return Declaration(NONE, None, {})
    return Declaration(f"initializer_range {float(r):g} (the model's config)", None, _hf_dists(model, float(r)))


def _positive(r) -> bool:
    return isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0


def _hf_scheme(r: float, scaled_residual: bool):
    """A tinylm scheme drawing what transformers draws from ``initializer_range`` r."""
    base = tinylm.init.get("gpt2")  # norms 1, biases 0: as transformers

    def scheme(site):
        if site.kind in ("linear_weight", "embedding"):
            if scaled_residual and site.residual_output:
                return Dist("normal", std=r / math.sqrt(2 * site.num_layers),
                            why="transformers GPT-2: c_proj N(0, (initializer_range / sqrt(2 n_layer))^2)")
            return Dist("normal", std=r, why=f"transformers: N(0, initializer_range^2), initializer_range {r:g}")
        return base(site)
    return scheme


def _hf_dists(model: nn.Module, r: float) -> dict[str, Dist]:
    """transformers' ``_init_weights`` for the weights of a model read through transformers: N(0, r^2) for
    Linear, Conv1D and Embedding weights; GPT-2's c_proj (attention and MLP) r / sqrt(2 n_layer)."""
    config = getattr(model, "config", None)
    gpt2 = getattr(config, "model_type", None) == "gpt2"
    n_layer = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None) or 1
    named = {id(p): n for n, p in model.named_parameters()}  # a tied weight under its first name
    out: dict[str, Dist] = {}
    for mname, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, nn.Parameter) or id(w) not in named or named[id(w)] in out or w.dim() != 2:
            continue
        if not (isinstance(mod, (nn.Linear, nn.Embedding)) or type(mod).__name__ == "Conv1D"):
            continue
        std = r / math.sqrt(2 * n_layer) if gpt2 and mname.endswith("c_proj") else r
        out[named[id(w)]] = Dist("normal", std=std, why="transformers' _init_weights")
    return out


def fresh_one(p, d: Dist) -> bool | None:
    """Whether one parameter row (name, shape, std, declared_std) is at its declared ``d`` by the rule
    of the module docstring; None where the rule does not judge it (a 1-D or zero-std non-constant)."""
    if d.family == "constant":
        return p.std is not None and p.std == 0
    if len(p.shape) < 2 or p.declared_std is None or not p.declared_std > 0:
        return None
    if p.std is None or not math.isfinite(p.std):
        return False
    return abs(p.std / p.declared_std - 1) <= FRESH_SIGMAS / math.sqrt(2 * math.prod(p.shape))


def fresh(params, decl: Declaration) -> bool | None:
    """Whether the weights are at their declared init (the rule in the module docstring); None when
    nothing is declared. ``params``: the parameter rows (name, shape, std, declared_std)."""
    if not decl.known:
        return None
    judged = False
    for p in params:
        d = decl.dists.get(p.name)
        if d is None:
            continue
        one = fresh_one(p, d)
        if one is False:
            return False
        judged = judged or (one is True and d.family != "constant")
    return judged

"""Which tensors of a model are measured: its sites, found once for every job.

A decoder-only LM is token embeddings, a stack of blocks and a head that outputs the logits.
:func:`model_sites` finds each from the model's structure, for a tinylm model and for any
``nn.Module``, and says what the probe, the watch and ``diagnose`` measure there:

* embeddings: every ``nn.Embedding`` / ``tinylm.Embedding`` (module order); the token
  embedding is the one the head is tied to, else the first whose ``num_embeddings`` is the
  head's output width V, else the first;
* blocks: the block stack of :func:`diagnostics.measure.blocks.find_blocks` (the
  ``nn.ModuleList`` / ``nn.Sequential`` of one class of parameterised modules holding the most
  parameters);
* attention: each tinylm ``MultiHeadSelfAttention``; in any other model each child of a
  block whose class name ends in ``Attention`` (GPT2Attention, LlamaAttention, ...);
* head: the module whose output is the logits, found by what it does. Of the modules outside
  the block stack, in module order, the last linear one (an integer ``out_features``) whose
  output width is an embedding's ``num_embeddings`` (the vocabulary V), or whose ``weight``
  is an embedding's table (a tied head). ``lm_head`` (tinylm, Hugging Face), ``head``,
  ``output`` (Llama's original, torchtitan) and ``embed_out`` (GPT-NeoX) are all found so.
  None when no module qualifies: the logits are then not measured, and what reads them is
  not judged.

Module order is the order ``named_modules()`` gives; a model that registers its modules in
the order they run (every tinylm and Hugging Face model) has it equal to forward order.

The sites of a model are found once and kept (weakly: they never keep the model alive) while
its structure stays the same: the same module objects under the same names, each holding the
same parameter objects of the same shapes, and (tinylm) the same config object. Any change
to these (a module added, removed or replaced, a parameter replaced or re-tied) finds them
again at the next call. :func:`model_walk` gives with them the model's modules and parameters
by name (what ``named_modules()`` and ``named_parameters()`` return), checked against what was
recorded in one pass over the modules: a probe's set-up walks the model once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple

from torch import Tensor, nn

import tinylm

from .blocks import BlockStack, find_blocks

__all__ = ["Sites", "Walk", "model_sites", "model_walk"]

_EMBEDDINGS = (nn.Embedding, tinylm.Embedding)
_LINEARS = (nn.Linear, tinylm.Linear)
_NORMS = (tinylm.RMSNorm, nn.LayerNorm)
_TAP_KINDS = {"resid_mid": "resid_mid", "scores": "attn_scores", "probs": "attn_probs", "hidden": "ffn_hidden",
              "resid_in": "embedding"}  # token + learned position embeddings: the stream at depth 0


@dataclass(frozen=True)
class Sites:
    """Where a model's tensors are measured (module names; see the module docstring).

    Attributes:
        embeddings: every embedding table, in module order.
        embedding: the token embedding (None without any table).
        blocks: the block stack, or None when the model has none.
        attention: the attention modules, in module order.
        head: the module whose output is the logits, or None when none is identifiable.
        points: {name: kind} a probe instruments by default, in module order (each tensor
            once per name). Kinds: embedding, residual (a block's output; any other model's
            block 0 input ``{stack}.input`` too), attn_branch, attn_heads, attn_scores,
            attn_probs, ffn_branch, ffn_hidden, resid_mid, logits (the head), linear, norm,
            module (any other module holding parameters of its own).
        watch: the tensors the watch records, in forward order (``Watch``'s default ``sites``).
        depth: the residual stream between blocks, block 0's input first (``diagnose``'s
            depth rows); empty without a block stack.
    """

    embeddings: tuple[str, ...]
    embedding: str | None
    blocks: BlockStack | None
    attention: tuple[str, ...]
    head: str | None
    points: Mapping[str, str]
    watch: tuple[str, ...]
    depth: tuple[str, ...]


def _is_tinylm(model: nn.Module) -> bool:
    return isinstance(model, tinylm.TransformerLM)


def _out_width(module: nn.Module) -> int | None:
    n = getattr(module, "out_features", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _head(named: list[tuple[str, nn.Module]], tables: list[nn.Module], stack: BlockStack | None) -> str | None:
    """The last module outside the blocks, in module order, that is linear with output width an
    embedding's num_embeddings, or whose weight is an embedding's table (module docstring)."""
    vocab = {t.num_embeddings for t in tables if isinstance(getattr(t, "num_embeddings", None), int)}
    weights = [t.weight for t in tables if isinstance(getattr(t, "weight", None), Tensor)]
    blocks = set(stack.names) if stack is not None else set()
    inside = tuple(b + "." for b in blocks)
    head = None
    for name, mod in named:
        if name in blocks or name.startswith(inside) or isinstance(mod, _EMBEDDINGS):
            continue
        w = getattr(mod, "weight", None)
        tied = isinstance(w, Tensor) and any(w is t for t in weights)
        if tied or _out_width(mod) in vocab:
            head = name
    return head


def _token_embedding(named: dict[str, nn.Module], tables: tuple[str, ...], head: str | None) -> str | None:
    """The table the head is tied to, else the first of width the head's output, else the first."""
    if head is not None:
        w = getattr(named[head], "weight", None)
        for t in tables:
            if w is not None and getattr(named[t], "weight", None) is w:
                return t
        for t in tables:
            if getattr(named[t], "num_embeddings", None) == _out_width(named[head]):
                return t
    return tables[0] if tables else None


def _kind(name: str, mod: nn.Module, tiny: bool, head: str | None) -> str | None:
    """The kind of a module that is not a block, or None when it is not a default point."""
    if name == head:
        return "logits"
    if isinstance(mod, tinylm.Tap):
        return _TAP_KINDS.get(name.rsplit(".", 1)[-1], "module")
    if tiny and isinstance(mod, tinylm.MultiHeadSelfAttention):
        return "attn_branch"
    if tiny and isinstance(mod, (tinylm.SwiGLU, tinylm.MLP)):
        return "ffn_branch"
    if not any(True for _ in mod.parameters(recurse=False)):
        return None
    if isinstance(mod, _EMBEDDINGS):
        return "embedding"
    if isinstance(mod, _LINEARS):
        return "linear"
    if isinstance(mod, _NORMS) or type(mod).__name__ in ("RMSNorm", "LayerNorm"):
        return "norm"
    return "module"


def _points(model: nn.Module, named: list[tuple[str, nn.Module]], stack: BlockStack | None,
            head: str | None) -> dict[str, str]:
    """{name: kind} of the default points, in module order (``Sites.points``).

    Every module holding parameters of its own, every ``tinylm.Tap``, each block's output (the
    residual stream) and, for a model that is not tinylm, block 0's input ``{stack}.input``
    (a tinylm model's is its embedding's output, or the ``resid_in`` Tap); for a tinylm model
    also the attention and FFN branches before they are added (``layers.i.attn``,
    ``layers.i.ffn``) and the attention heads before ``output_proj`` (``layers.i.attn.heads``)."""
    tiny = _is_tinylm(model)
    blocks = set(stack.names) if stack is not None else set()
    points: dict[str, str] = {}
    for name, mod in named:
        if (tiny and isinstance(mod, tinylm.TransformerBlock)) or name in blocks:
            if not tiny and name == stack.names[0]:
                points[stack.input] = "residual"
            points[name] = "residual"
            continue
        kind = _kind(name, mod, tiny, head)
        if kind is not None:
            points[name] = kind
        if kind == "attn_branch":
            points[f"{name}.heads"] = "attn_heads"  # output_proj's input: the heads, concatenated
    return points


def _attention(model: nn.Module, named: dict[str, nn.Module], stack: BlockStack | None) -> tuple[str, ...]:
    """Each tinylm attention module; in any other model each block child whose class name ends
    in ``Attention``."""
    if _is_tinylm(model):
        return tuple(n for n, m in named.items() if isinstance(m, tinylm.MultiHeadSelfAttention))
    return tuple(f"{b}.{c}" for b in (stack.names if stack is not None else ())
                 for c, m in named[b].named_children() if type(m).__name__.endswith("Attention"))


def _watch(plan: tinylm.plan.ModelPlan | None, names: set[str], embeddings: tuple[str, ...],
           embedding: str | None, stack: BlockStack | None, head: str | None) -> tuple[str, ...]:
    """The watch's default sites. A tinylm model (its ``plan``): the token embedding; per block i
    attn.scores (pre-softmax logits, causal entries), attn.probs, attn (the attention branch),
    resid_mid, ffn (the FFN branch) and the block's output ``layers.i`` (the residual stream);
    the head (the logits). Any other module: every embedding table, each block's output and
    the head."""
    if plan is not None:
        sites = [embedding]
        for b in plan.blocks:
            attn, ffn = b.branches()
            sites += [f"{attn.name}.scores", f"{attn.name}.probs", attn.name, b.mid, ffn.name, b.output]
        sites.append(head)
    else:
        sites = [*embeddings, *(stack.names if stack is not None else ()), head]
    return tuple(dict.fromkeys(s for s in sites if s is not None and s in names))


class Walk(NamedTuple):
    """One walk of a model's modules, shared by everything a probe sets up: its :class:`Sites`,
    ``named`` (``dict(model.named_modules())``) and ``params`` (``list(model.named_parameters())``),
    each a new container per call."""

    sites: Sites
    named: dict[str, nn.Module]
    params: list[tuple[str, nn.Parameter]]


_FOUND: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _structure(model: nn.Module) -> tuple:
    """What the sites depend on, held by weak reference: per module in module order (its name,
    the module, its type, its children's keys and ids, its parameters by key with their shapes);
    the model's named parameters; the config of a tinylm model."""
    mods = [(n, weakref.ref(m), type(m), list(m._modules), [id(c) for c in m._modules.values()],
             [(k, weakref.ref(p), tuple(p.shape)) for k, p in m._parameters.items() if p is not None])
            for n, m in model.named_modules()]
    params = [(n, weakref.ref(p)) for n, p in model.named_parameters()]
    return mods, params, getattr(model, "config", None) if _is_tinylm(model) else None


def _unchanged(model: nn.Module, known: tuple) -> tuple[dict[str, nn.Module], list] | None:
    """({name: module}, [(name, parameter)]) of ``model`` when its structure is still the one
    :func:`_structure` recorded in ``known``, else None. Every module recorded is alive and still
    has the same children (by id: a child that replaced one is either another id, or at the id
    of one that died, whose own record then fails) under the same keys and the same parameters
    of the same shapes, so the modules reachable from the model, their names and order, are
    those recorded (one pass over the recorded modules, no walk of names)."""
    mods, params, config = known
    if (getattr(model, "config", None) if _is_tinylm(model) else None) is not config:
        return None
    if not mods or mods[0][1]() is not model:
        return None
    named: dict[str, nn.Module] = {}
    for name, ref, kind, keys, ids, own in mods:
        m = ref()
        if m is None or type(m) is not kind:
            return None
        now = m._modules
        if list(now) != keys or [id(c) for c in now.values()] != ids:
            return None
        held = m._parameters
        if own or held:
            now_held = [(k, p) for k, p in held.items() if p is not None]
            if len(now_held) != len(own):
                return None
            for (k, r, shape), (key, p) in zip(own, now_held):
                if k != key or r() is not p or p.shape != shape:
                    return None
        named[name] = m
    return named, [(n, r()) for n, r in params]


def model_walk(model: nn.Module) -> Walk:
    """The sites, modules and parameters of ``model`` (:class:`Walk`), found again only when its
    structure changed (module docstring); else from one pass over what was recorded."""
    known = _FOUND.get(model)
    if known is not None:
        now = _unchanged(model, known[0])
        if now is not None:
            return Walk(known[1], *now)
    sites = _find(model)
    _FOUND[model] = (_structure(model), sites)
    return Walk(sites, dict(model.named_modules()), list(model.named_parameters()))


def model_sites(model: nn.Module) -> Sites:
    """The sites of ``model`` (a tinylm model or any ``nn.Module``): see :class:`Sites`; found
    again only when the model's structure changed (module docstring).

    Returns:
        A :class:`Sites`; a model without embeddings, blocks or a head has those fields empty
        or None (nothing is measured there), never an error.
    """
    return model_walk(model).sites


def _find(model: nn.Module) -> Sites:
    """The sites of ``model``, found from its modules (:func:`model_sites` without the memory)."""
    named = [(n, m) for n, m in model.named_modules() if m is not model]
    modules = dict(named)
    stack = find_blocks(model)
    tables = tuple(n for n, m in named if isinstance(m, _EMBEDDINGS))
    head = _head(named, [modules[t] for t in tables], stack)
    embedding = _token_embedding(modules, tables, head)
    plan = tinylm.plan.build(model.config) if _is_tinylm(model) else None
    if plan is not None:
        depth = plan.block_outputs()
    else:
        depth = (stack.input, *stack.names) if stack is not None else ()
    return Sites(embeddings=tables, embedding=embedding, blocks=stack, attention=_attention(model, modules, stack),
                 head=head, points=MappingProxyType(_points(model, named, stack, head)),
                 watch=_watch(plan, set(modules), tables, embedding, stack, head), depth=depth)

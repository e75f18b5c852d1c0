"""The block stack of any ``nn.Module``, found by its structure.

A decoder-only LM is an embedding, a stack of blocks of one class applied one after the
other, and a head. The stack is found without knowing the model's class:

    the nn.ModuleList or nn.Sequential whose children are modules of one class, each made
    of modules (not a leaf) and holding parameters; of several, the one holding the most
    parameters (then the longest, then the first in module order).

Nested lists (a per-block list of heads or experts) hold fewer parameters than the stack
around them, so the outermost stack wins. Examples: ``tinylm.TransformerLM.layers`` (its
blocks are ``layers.0`` ... ``layers.{L-1}``, the names of ``tinylm.plan``'s block outputs),
Hugging Face ``transformer.h`` (GPT-2) and ``model.layers`` (Llama), a user's ``blocks``.

Each block's output (the first tensor of a tuple output) is taken as the residual stream
after it, and block 0's input as the stream before the blocks (named ``{stack}.input``).
:func:`diagnostics.measure.sites.model_sites` takes its ``blocks`` from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["BlockStack", "find_blocks", "is_norm"]


@dataclass(frozen=True)
class BlockStack:
    """The block stack of a model: ``prefix`` (the container's module name, "" for the model
    itself) and ``names`` (each block's module name, in order)."""

    prefix: str
    names: tuple[str, ...]

    @property
    def input(self) -> str:
        """The name given to block 0's input: the residual stream before the blocks."""
        return f"{self.prefix}.input" if self.prefix else "input"

    def index(self, name: str) -> int | None:
        """i for block i's name or a name inside block i (``{block}.*``), else None."""
        for i, block in enumerate(self.names):
            if name == block or name.startswith(block + "."):
                return i
        return None

    def __len__(self) -> int:
        return len(self.names)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module) -> BlockStack | None:
    """The model's block stack (module docstring), or None when it has none."""
    best: tuple[tuple[int, int], BlockStack] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.named_children())
        if not children or len({type(c) for _, c in children}) != 1:
            continue
        if any(not any(True for _ in c.children()) or _params(c) == 0 for _, c in children):
            continue
        held = _params(mod)
        stack = BlockStack(name, tuple(f"{name}.{c}" if name else c for c, _ in children))
        key = (held, len(children))
        if best is None or key > best[0]:
            best = (key, stack)
    return best[1] if best else None


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer: its class name holds "Norm" (LayerNorm, RMSNorm,
    LlamaRMSNorm, ...), or it is a leaf whose parameters are a 1-D ``weight`` and at most a 1-D
    ``bias`` of the same size (a norm's elementwise affine, whatever the class is called: nanoGPT-style
    ``LN`` classes calling F.layer_norm)."""
    if "Norm" in type(module).__name__:
        return True
    if next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    w, b = params.get("weight"), params.get("bias")
    return w is not None and set(params) <= {"weight", "bias"} and w.dim() == 1 and w.numel() > 1 \
        and (b is None or b.shape == w.shape)

"""``diff``: where two executions of one model part ways, site by site, forward and backward.

    result = diff(reference, candidate)       # two models, or fingerprints, or one of each
    result.first                              # the first site beyond roundoff, or None
    print(result)                             # "same within roundoff: ..." / "departs at layers.3 ..."

Three stages: measure each side (:func:`diagnostics.jobs.fingerprint.fingerprint`: one forward
and backward pass on the same tokens, every site reduced at once to moments and a sketch), pair
the sites by structure (``Site.key``: embedding, block i's attention, MLP and output, final norm,
logits), and judge each pair's departure against its roundoff tolerance
(:mod:`diagnostics.judge.departure`). Two models of different classes (tinylm and its Hugging Face
export read by transformers, a user's module) pair by that structure; what cannot be paired is
listed in ``unpaired``.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from torch import nn

import tinylm

from ..judge.departure import Tolerance, first_departure, relative_departure
from ..options import DiffOptions, OptionsError
from ..measure.blocks import find_blocks
from .fingerprint import Fingerprint, FingerprintError, diff_sites, fingerprint

__all__ = ["diff", "diff_against", "compare_fingerprints", "compiled_copy", "DiffResult", "DiffRow", "VARIANTS"]

DIFF_SCHEMA_VERSION = "1"
#: the tidy columns of DiffResult.to_frame()
DIFF_COLUMNS = ("site", "direction", "block", "kind", "departure", "tolerance", "ratio", "depth", "reference_dtype",
                "candidate_dtype", "reference_rms", "candidate_rms", "reference_module", "candidate_module")


@dataclass
class DiffRow:
    """One paired site and direction: ``departure`` ||a - b|| / ||b|| (estimated), ``tolerance``
    (judge.departure), ``ratio`` = departure / tolerance, ``depth`` l of the tolerance formula,
    each side's dtype, root mean square and module name."""

    site: str
    direction: str
    block: int | None
    kind: str
    departure: float
    tolerance: float
    ratio: float
    depth: int
    reference_dtype: str
    candidate_dtype: str
    reference_rms: float
    candidate_rms: float
    reference_module: str
    candidate_module: str

    @property
    def departs(self) -> bool:
        return not (self.ratio <= 1.0)


@dataclass
class DiffResult:
    """Per paired site and direction a :class:`DiffRow`, in judging order (forward in forward order,
    then backward from the loss); ``unpaired`` the (site, why) that were not compared;
    ``reference`` / ``candidate`` the two fingerprints' meta; ``tolerance`` the constants used."""

    rows: list[DiffRow]
    unpaired: list[tuple[str, str]]
    reference: dict
    candidate: dict
    tolerance: dict
    schema_version: str = field(default=DIFF_SCHEMA_VERSION)

    @property
    def first(self) -> DiffRow | None:
        """The first row whose departure exceeds its tolerance, or None."""
        i = first_departure([r.ratio for r in self.rows])
        return None if i is None else self.rows[i]

    @property
    def same(self) -> bool:
        """True when every paired site is within its tolerance (and something was paired)."""
        return bool(self.rows) and self.first is None

    @property
    def departures(self) -> list[DiffRow]:
        return [r for r in self.rows if r.departs]

    def to_frame(self):
        """Tidy rows, one per site and direction (columns ``DIFF_COLUMNS``)."""
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.rows], columns=list(DIFF_COLUMNS))

    def to_dict(self) -> dict:
        def num(v):
            return v if not isinstance(v, float) or math.isfinite(v) else str(v)
        return {"schema_version": self.schema_version, "summary": str(self),
                "first": None if self.first is None else {k: num(v) for k, v in asdict(self.first).items()},
                "columns": list(DIFF_COLUMNS),
                "rows": [[num(getattr(r, c)) for c in DIFF_COLUMNS] for r in self.rows],
                "unpaired": [list(u) for u in self.unpaired], "reference": self.reference,
                "candidate": self.candidate, "tolerance": self.tolerance}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    def __str__(self) -> str:
        if not self.rows:
            return "nothing compared: no site could be paired"
        first = self.first
        if first is None:
            sites = len({r.site for r in self.rows})
            directions = len({r.direction for r in self.rows})
            text = f"same within roundoff: {sites} sites x {directions} direction{'s' if directions > 1 else ''}"
        else:
            text = (f"departs at {first.site} ({first.direction}): {first.departure:.2g} vs tolerance "
                    f"{first.tolerance:.2g}")
        if self.unpaired:
            text += f"; {len(self.unpaired)} not paired"
        return text

    def __repr__(self) -> str:
        return f"DiffResult({self})"


def _depth(order: int, blocks: int, direction: str) -> int:
    """l of the tolerance formula from a site's forward position (Site.order = 3i + 1..3 in block i)."""
    forward = 0 if order == 0 else min((order - 1) // 3 + 1, blocks + 1)
    return forward if direction == "forward" else (blocks + 1) + (blocks + 1 - forward) + 1


def _rms(record) -> float:
    return math.sqrt(max(record.mean_square, 0.0))


def _check_comparable(a: Fingerprint, b: Fingerprint) -> None:
    for key, what in (("tokens_sha256", "the same tokens"), ("k", "the same sketch size k"),
                      ("projection_seed", "the same projections")):
        if a.meta.get(key) != b.meta.get(key):
            raise FingerprintError(f"candidate {key}={b.meta.get(key)!r}: must equal the reference's "
                                   f"{a.meta.get(key)!r} (two fingerprints compare only on {what}); pass "
                                   "fingerprints made with the same tokens and DiffOptions")


def compare_fingerprints(reference: Fingerprint, candidate: Fingerprint, tolerance: Tolerance | None = None
                         ) -> DiffResult:
    """Pair two fingerprints' records by site and direction and judge each (module docstring)."""
    _check_comparable(reference, candidate)
    tolerance = tolerance or Tolerance()
    blocks = 1 + max([r.block for r in reference.records if r.block is not None] or [-1])
    width = next((r.shape[-1] for r in reference.records if r.key == "embedding"),
                 next((r.shape[-1] for r in reference.records if r.block is not None), 1))
    rows, unpaired = [], []
    for ref in reference.records:
        cand = candidate.record(ref.key, ref.direction)
        if cand is None:
            unpaired.append((f"{ref.key} ({ref.direction})", "only the reference has it"))
            continue
        if tuple(cand.shape) != tuple(ref.shape):
            unpaired.append((f"{ref.key} ({ref.direction})", f"shapes differ: {tuple(ref.shape)} vs {tuple(cand.shape)}"))
            continue
        dep = math.inf if cand.nonfinite != ref.nonfinite else relative_departure(cand.sketch, ref.sketch)
        depth = _depth(ref.order, blocks, ref.direction)
        tol = tolerance((ref.dtype, cand.dtype), width, depth, ref.direction)
        rows.append(DiffRow(ref.key, ref.direction, ref.block, ref.kind, dep, tol, dep / tol, depth, ref.dtype,
                            cand.dtype, _rms(ref), _rms(cand), ref.module, cand.module))
    for cand in candidate.records:
        if reference.record(cand.key, cand.direction) is None:
            unpaired.append((f"{cand.key} ({cand.direction})", "only the candidate has it"))
    for side, fp in (("reference", reference), ("candidate", candidate)):
        unpaired += [(key, f"not measured in the {side}") for key in fp.meta.get("unmeasured", [])]
    return DiffResult(rows, unpaired, reference.meta, candidate.meta, tolerance.to_dict())


def diff(reference, candidate, tokens=None, options: DiffOptions | None = None) -> DiffResult:
    """Run both sides on the same tokens, forward and backward, and compare them site by site.

    Args:
        reference, candidate: each an ``nn.Module`` (measured here, on ``tokens``) or a
            :class:`Fingerprint` (measured before, perhaps on another machine). A model measured
            against a fingerprint runs on the fingerprint's tokens.
        tokens: (N, T+1) windows, a 1-D token stream, or None (uniform random ids from
            ``options.seed``); ignored where a fingerprint fixes them.
        options: :class:`diagnostics.DiffOptions` (batch size, seq_len, seed, k, a dtype per side,
            backward, inputs, tolerance).
    Returns:
        a :class:`DiffResult`; ``result.first`` is the first site (forward in order, then backward
        from the loss) whose departure ||a - b|| / ||b|| exceeds c (u_store + u_acc sqrt(w)) (1 + a l)
        (diagnostics.judge.departure), or None. Both models are left as they were.
    """
    options = options or DiffOptions()
    for name, side in (("reference", reference), ("candidate", candidate)):
        if not isinstance(side, (nn.Module, Fingerprint)):
            raise OptionsError(f"{name}={type(side).__name__}: must be a torch.nn.Module or a Fingerprint; pass a "
                               "model or diagnostics.Fingerprint.load(path)")
    fixed = next((s for s in (reference, candidate) if isinstance(s, Fingerprint)), None)
    if fixed is not None:
        tokens = fixed.tokens
        options = _options_of(options, fixed)
    ref = reference if isinstance(reference, Fingerprint) else \
        fingerprint(reference, tokens, options, dtype=options.reference_dtype)
    cand = candidate if isinstance(candidate, Fingerprint) else \
        fingerprint(candidate, ref.tokens, options, dtype=options.candidate_dtype)
    return compare_fingerprints(ref, cand, options.tolerance)


def _options_of(options: DiffOptions, fp: Fingerprint) -> DiffOptions:
    """``options`` with the batch and sketch a fingerprint was made with."""
    tokens = np.asarray(fp.tokens)
    return replace(options, batch_size=int(tokens.shape[0]), seq_len=int(tokens.shape[1] - 1), k=int(fp.meta["k"]))


#: the variants :func:`diff_against` runs a model against (the reference is the model as it is)
VARIANTS = ("compiled", "bf16", "fp16", "cpu-threads", "explicit-attention", "float64")


def compiled_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose per-block computations run through ``torch.compile``: each
    child of each block (attention, MLP, norms) and the final norm get a compiled ``forward``;
    the residual adds and the hooks on the sites stay eager, so every site is still measured."""
    twin = copy.deepcopy(model)
    named = dict(twin.named_modules())
    stack = find_blocks(twin)
    leaves = [child for block in (stack.names if stack is not None else ())
              for _, child in named[block].named_children()]
    leaves += [named[s.module] for s in diff_sites(twin) if s.key == "final_norm"]
    for mod in leaves:
        mod.forward = torch.compile(mod.forward, dynamic=False)
    return twin


def _explicit_copy(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    attention = [m for m in twin.modules() if isinstance(m, tinylm.MultiHeadSelfAttention)]
    if not attention:
        raise OptionsError("variant='explicit-attention': must be a tinylm model (its attention has an explicit "
                           "path); pass another variant")
    for m in attention:
        m.explicit = True
    return twin


def diff_against(model: nn.Module, variant: str, tokens=None, options: DiffOptions | None = None,
                 threads: int | None = None) -> DiffResult:
    """``model`` as it is (the reference) against a variant of itself (the candidate), on the same tokens.

    Variants: "compiled" (:func:`compiled_copy`), "bf16" / "fp16" / "float64" (a copy cast to
    that dtype), "cpu-threads" (the reference on 1 torch thread, the candidate on ``threads``,
    default max(2, the current count); the thread count is restored), "explicit-attention"
    (tinylm only: attention through its explicit scores and weights, not torch's fused kernel).
    """
    from tinylm.validate import choice

    choice("variant", variant, VARIANTS, fix="one of " + ", ".join(VARIANTS), error=OptionsError)
    options = options or DiffOptions()
    if variant in ("bf16", "fp16", "float64"):
        name = {"bf16": "bfloat16", "fp16": "float16"}.get(variant, variant)
        return diff(model, model, tokens, replace(options, candidate_dtype=name))
    if variant == "cpu-threads":
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            ref = fingerprint(model, tokens, options, dtype=options.reference_dtype)
            torch.set_num_threads(threads or max(2, before))
            cand = fingerprint(model, ref.tokens, options, dtype=options.candidate_dtype)
        finally:
            torch.set_num_threads(before)
        return compare_fingerprints(ref, cand, options.tolerance)
    twin = compiled_copy(model) if variant == "compiled" else _explicit_copy(model)
    return diff(model, twin, tokens, options)

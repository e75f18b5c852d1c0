"""The header of a diagnosis: the facts about what was measured (diagnostics/result.py re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Header:
    """Facts about what was measured (a field added later reads "" or None in older documents).

    model_class; config: the tinylm ModelConfig as a dict (None for other modules); parameter_count: distinct
    parameters; init: the scheme of declared stds and global theory ("" if none); tokens_measured (over seeds
    and batches); batch_size, seq_len, batches, seeds as run; seed: the first; theory: "local", "global" or
    "off"; loss: the mean measured; loss_uniform: ln V where the loss is the logits' mean next-token CE, else
    None; interval: what the ratios' 99% intervals cover, in words; declared: the declared init, in words;
    fresh: at it (True), moved off it (False), unknown (None), by ``fresh_rule``; dtype, device: the
    parameters' ("/"-joined when several); dtype_note: why that dtype, where the caller says ("stored");
    kv_heads: the K/V head count the model states (below the heads: grouped-query attention), else None;
    kinds: each weight kind's state (WeightKind.to_dict(): kind, fresh / misscaled / trained, factor, blocks);
    source, data: where the model and the tokens came from, as the caller says (the command line's lines).
    """

    model_class: str
    config: dict[str, Any] | None
    parameter_count: int
    init: str
    tokens_measured: int
    batch_size: int
    seq_len: int
    batches: int
    seeds: int
    seed: int
    theory: str
    loss: float
    loss_uniform: float | None
    token_source: str
    interval: str = ""
    declared: str = ""
    fresh: bool | None = None
    fresh_rule: str = ""
    dtype: str = ""
    dtype_note: str = ""
    device: str = ""
    kv_heads: int | None = None
    source: str = ""
    data: str = ""
    kinds: list = field(default_factory=list)

"""tinylm: one complete, readable decoder-only Transformer LM (CS336 assignment-1 names and keys).

Pre-norm RMSNorm, SwiGLU, RoPE, causal multi-head attention; ablations (post-norm,
no norm, NoPE, SiLU FFN) and the GPT-2 family (LayerNorm, GELU/ReLU MLPs, learned
positions, biases) chosen by :class:`ModelConfig`; named init schemes in
:mod:`tinylm.init`; checkpoints in :mod:`tinylm.checkpoint`; the block plan (the
model's dataflow as data, with module and tensor names) in :mod:`tinylm.plan`.
"""

from . import functional, init, mup, plan
from .config import PRESETS, ModelConfig, default_d_ff, preset
from .errors import CheckpointError, ConfigError, MissingOptionError, TinyLMError, UnsafeCheckpointError
from .layers import (
    MLP,
    Embedding,
    LayerNorm,
    Linear,
    MultiHeadSelfAttention,
    RMSNorm,
    RotaryPositionalEmbedding,
    SiLUFFN,
    SwiGLU,
    Tap,
)
from .model import TransformerBlock, TransformerLM
from .plan import BlockPlan, ModelPlan

__version__ = "0.1.0"

__all__ = [
    "ModelConfig",
    "PRESETS",
    "preset",
    "default_d_ff",
    "Linear",
    "Embedding",
    "RMSNorm",
    "LayerNorm",
    "SwiGLU",
    "MLP",
    "SiLUFFN",
    "RotaryPositionalEmbedding",
    "MultiHeadSelfAttention",
    "Tap",
    "TransformerBlock",
    "TransformerLM",
    "functional",
    "init",
    "mup",
    "plan",
    "BlockPlan",
    "ModelPlan",
    "TinyLMError",
    "ConfigError",
    "CheckpointError",
    "MissingOptionError",
    "UnsafeCheckpointError",
]

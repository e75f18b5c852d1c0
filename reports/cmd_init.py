"""Write a freshly initialised tinylm checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli import PRESET_NAMES, SCHEME_NAMES, UsageError, choose
from .intake import check_outputs, positive_int

#: what ``-o`` may end in: a torch.save'd file or safetensors
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help=f"model sizes: {', '.join(PRESET_NAMES)} (default tiny)")
    p.add_argument("--init", help=f"init scheme: {', '.join(SCHEME_NAMES)} (default: the preset's, cs336 "
                   "for the CS336 presets, gpt2 for the gpt2 ones)")
    p.add_argument("--norm", choices=["pre", "post", "none"], help="norm placement (default: the preset's, pre)")
    p.add_argument("--norm-kind", choices=["rms", "layer"], help="RMSNorm or LayerNorm (default: the preset's)")
    p.add_argument("--ffn", choices=["swiglu", "silu", "gelu", "gelu_tanh", "relu"],
                   help="feed-forward kind (default: the preset's)")
    p.add_argument("--positions", choices=["rope", "learned", "none"],
                   help="rotary, learned absolute or no position information (default: the preset's)")
    p.add_argument("--no-rope", action="store_true", help="no position information (NoPE): --positions none")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction,
                   help="biases on every linear layer but the output head (default: the preset's)")
    p.add_argument("--num-layers", type=positive_int, help="override the preset's number of blocks")
    p.add_argument("--d-model", type=positive_int, help="override the preset's width")
    p.add_argument("--num-kv-heads", type=positive_int,
                   help="key/value heads (grouped-query attention; must divide the heads; default: one per head)")
    p.add_argument("--sliding-window", type=positive_int,
                   help="each position attends to the last N positions only, itself included (default: all)")
    p.add_argument("--qk-norm", choices=["none", "rms", "layer"],
                   help="normalise each head's queries and keys (RMSNorm or LayerNorm over d_k) before RoPE "
                   "(default none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the init draws (default 0)")
    p.add_argument("-o", "--output", required=True, help="where to write the checkpoint (.pt or .safetensors)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")


def check_checkpoint_suffix(flag: str, value: str) -> None:
    """An output checkpoint's suffix is one the loaders read back."""
    if Path(value).suffix.lower() not in CHECKPOINT_SUFFIXES:
        raise UsageError(f"{flag} {value}: a checkpoint is written as {' or '.join(CHECKPOINT_SUFFIXES)}; "
                         f"give a path such as {Path(value).with_suffix('.pt')}")


def check(args: argparse.Namespace) -> None:
    """The flags, before torch is imported: preset, scheme, output path."""
    choose("--preset", args.preset, PRESET_NAMES, "preset")
    if args.init is not None:
        choose("--init", args.init, SCHEME_NAMES, "init scheme")
    if args.no_rope and args.positions not in (None, "none"):
        raise UsageError(f"--no-rope with --positions {args.positions}: choose one (--no-rope is --positions none)")
    check_outputs({"-o": args.output}, {}, force=args.force)
    check_checkpoint_suffix("-o", args.output)


def run(args: argparse.Namespace) -> int:
    import torch

    from tinylm import TransformerLM, checkpoint, preset
    from tinylm.init import get

    check(args)
    if args.init is not None:
        get(args.init)  # unknown scheme: a clear error before any work
    changes = {} if args.init is None else {"init": args.init}
    for name in ("norm", "norm_kind", "ffn", "positions", "bias", "num_layers", "d_model", "num_kv_heads",
                 "sliding_window", "qk_norm"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.no_rope:
        changes["positions"] = "none"
    config = preset(args.preset, **changes)
    out = Path(args.output)
    model = TransformerLM(config, generator=torch.Generator().manual_seed(args.seed))
    checkpoint.save(out, model, seed=args.seed)
    print(f"wrote {out} ({model.num_parameters():,} parameters, preset {args.preset}, init {config.init}, seed {args.seed})")
    return 0

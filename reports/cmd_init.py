"""Write a freshly initialised tinylm checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path


from .intake import check_outputs


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tinylm.config import PRESETS
    from tinylm.init import SCHEMES

    p.add_argument("--preset", default="tiny", help=f"model sizes: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--init", default="cs336", help=f"init scheme: {', '.join(SCHEMES)} (default cs336)")
    p.add_argument("--norm", choices=["pre", "post", "none"], help="norm placement (default: the preset's, pre)")
    p.add_argument("--ffn", choices=["swiglu", "silu"], help="feed-forward kind (default swiglu)")
    p.add_argument("--no-rope", action="store_true", help="no rotary embeddings (NoPE)")
    p.add_argument("--num-layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--d-model", type=int, help="override the preset's width")
    p.add_argument("--seed", type=int, default=0, help="seed of the init draws (default 0)")
    p.add_argument("-o", "--output", required=True, help="where to write the checkpoint (.pt or .safetensors)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")


def run(args: argparse.Namespace) -> int:
    import torch

    from tinylm import TransformerLM, checkpoint, preset
    from tinylm.init import get

    get(args.init)  # unknown scheme: a clear error before any work
    changes = {"init": args.init}
    for name in ("norm", "ffn", "num_layers", "d_model"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.no_rope:
        changes["rope"] = False
    config = preset(args.preset, **changes)
    out = Path(args.output)
    check_outputs({"-o": args.output}, {}, force=args.force)
    model = TransformerLM(config, generator=torch.Generator().manual_seed(args.seed))
    checkpoint.save(out, model, seed=args.seed)
    print(f"wrote {out} ({model.num_parameters():,} parameters, preset {args.preset}, init {args.init}, seed {args.seed})")
    return 0

"""Write a tinylm model as a Hugging Face directory (config.json and model.safetensors) that transformers loads.

``tinylm export --hf DIR [CHECKPOINT]``: the checkpoint's model (any file ``diagnose``
reads), or with no checkpoint a freshly initialised ``--preset`` model, written in the
Llama layout (the CS336 configuration: pre-norm RMSNorm, SwiGLU, RoPE) or the GPT-2 layout
(the GPT-2 family). A configuration with no Hugging Face equivalent (post-norm, no norm, a
SiLU FFN with RMSNorm, NoPE) is refused with the reason. Exit codes: 0 written, 2 bad input or usage (a refused configuration, a non-empty
DIR without ``--force``, DIR being the input), one line on stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli import PRESET_NAMES, SCHEME_NAMES, UsageError, choose
from .intake import check_model_path, load_model, positive_int

#: what a directory export writes; with --force only these are replaced
WRITTEN = ("config.json", "model.safetensors")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="the model to export: any checkpoint diagnose reads; none: a fresh --preset model")
    p.add_argument("--hf", metavar="DIR", required=True,
                   help="write a Hugging Face directory (config.json, model.safetensors) here")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty DIR, replacing its config.json and model.safetensors")
    g = p.add_argument_group("fresh model (no CHECKPOINT)")
    g.add_argument("--preset", help=f"model sizes: {', '.join(PRESET_NAMES)} (default tiny)")
    g.add_argument("--init", help=f"init scheme: {', '.join(SCHEME_NAMES)} (default: the preset's own)")
    g.add_argument("--seed", type=int, default=0, help="seed of the init draws (default 0)")
    g = p.add_argument_group("checkpoint without a config")
    g.add_argument("--num-heads", type=positive_int, help="attention heads")
    g.add_argument("--rope-theta", type=float, help="RoPE base theta")
    g.add_argument("--context-length", type=positive_int, help="longest sequence the model takes")


def _inside(output: Path, checkpoint: str | None) -> bool:
    """Whether writing ``output``/config.json or ``output``/model.safetensors could touch the input."""
    if checkpoint is None or not output.exists():
        return False
    src = Path(checkpoint).resolve()
    out = output.resolve()
    return src == out or (src.parent == out and src.name in WRITTEN)


def check(args: argparse.Namespace) -> None:
    """The flags, before torch is imported: the input, the output directory, preset and scheme."""
    if args.checkpoint is not None and (args.preset is not None or args.init is not None):
        raise UsageError("--preset and --init build a fresh model; with a CHECKPOINT drop them (or drop the "
                         "CHECKPOINT to export a fresh model)")
    choose("--preset", args.preset or "tiny", PRESET_NAMES, "preset")
    if args.init is not None:
        choose("--init", args.init, SCHEME_NAMES, "init scheme")
    check_model_path("checkpoint", args.checkpoint)
    out = Path(args.hf)
    if _inside(out, args.checkpoint):
        raise UsageError(f"--hf {args.hf} would overwrite the checkpoint {args.checkpoint}; choose another directory "
                         "(inputs are never overwritten, even with --force)")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--hf {args.hf}: exists and is a file; give a directory (new or empty)")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"--hf {args.hf}: exists and is not empty; choose a new or empty directory, or pass --force "
                         f"to replace its {' and '.join(WRITTEN)}")


def run(args: argparse.Namespace) -> int:
    import torch

    from tinylm import TransformerLM, hf, preset

    check(args)
    if args.checkpoint is None:
        name = args.preset or "tiny"
        config = preset(name) if args.init is None else preset(name, init=args.init)
        model = TransformerLM(config, generator=torch.Generator().manual_seed(args.seed))
        what = f"fresh {name} preset, {config.init} init, seed {args.seed}"
    else:
        source = load_model(args.checkpoint, num_heads=args.num_heads, rope_theta=args.rope_theta,
                            context_length=args.context_length, command="tinylm export --hf DIR")
        if not isinstance(source.model, TransformerLM):
            raise UsageError(f"{args.checkpoint}: a model read through transformers is a Hugging Face model already; "
                             "there is nothing to export")
        model, what = source.model, source.description
    out = hf.save_pretrained(model, args.hf, force=args.force)
    layout = hf.hf_config(model.config)["architectures"][0]
    print(f"wrote {out} ({', '.join(WRITTEN)}; {layout}, {model.num_parameters():,} parameters) from {what}")
    return 0

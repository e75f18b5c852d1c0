"""What seeing the attention of a model that is not tinylm costs: one forward + backward step of a
Hugging Face GPT-2 (built from a config in code, "sdpa" attention), bare, under a probe without
attention, and under a probe that measures every scaled_dot_product_attention call on sampled
query rows (diagnostics.measure.sdpa). Median of ``--repeats`` steps each, after one warm-up.

    python benchmarks/bench_anymodule.py [--d 256] [--layers 4] [--seq-len 256] [--batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from diagnostics import ProbeOptions, probe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=8000, n_positions=args.seq_len, n_embd=args.d, n_layer=args.layers, n_head=max(1, args.d // 64)))
    model.eval()
    ids = torch.randint(0, 8000, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def timed(options: ProbeOptions | None) -> float:
        times = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            if options is None:
                step()
            else:
                with probe(model, options):
                    step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    bare = timed(None)
    plain = timed(ProbeOptions(attention=False, params=False))
    seen = timed(ProbeOptions(attention=True, params=False))
    print(f"GPT-2 d {args.d}, {args.layers} blocks, {args.batch} x {args.seq_len} tokens, torch threads "
          f"{torch.get_num_threads()}: bare {bare * 1e3:.0f} ms, probe without attention {plain * 1e3:.0f} ms "
          f"({plain / bare:.2f}x), probe seeing attention {seen * 1e3:.0f} ms ({seen / bare:.2f}x; attention "
          f"{(seen - plain) / bare:+.2f} of a bare step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

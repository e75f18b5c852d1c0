"""Replay: fault injection, false alarms and cost (docs/replay.md).

    python benchmarks/bench_replay.py --injections 200 --reruns 200 --cost 5

Injection: one exponent bit (chosen uniformly among the dtype's exponent bits) of one element
(chosen uniformly among those with |x| >= the median |x|) of one site's forward output, or of the
gradient with respect to it, flipped during the rerun only; the site is chosen uniformly among the
module sites (every block's attention and MLP branch and output, the final norm). A hit: verdict
"departs"; named: the first departing row is that site (forward), or that site in the backward
(the right block and site). Models: tinylm (d 64, 4 layers, 4 x 32 tokens) and a Hugging Face
Llama built by ``transformers`` from a config of the same sizes.

False alarms: reruns that differ from the first execution only in ways that keep the math:
another number of threads, tinylm's explicit attention instead of the fused kernel, the block
children through ``torch.compile``; and plain reruns (which must be "identical").

Cost: one plain step (forward and backward, no hooks) against one replay of it, interleaved in
one process; the ratio replay / step (target <= 2: one extra forward and backward plus the
fingerprints' sketches).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time

import torch
import torch.nn.functional as F

import tinylm
from diagnostics.jobs.fingerprint import diff_sites
from diagnostics.jobs.replay import ReplayOptions, replay
from diagnostics.measure.bits import EXPONENT_BITS, flip_exponent_bit
from diagnostics.measure.outputs import first_tensor

VOCAB, D, LAYERS, HEADS, FF, BATCH, SEQ = 256, 64, 4, 4, 128, 4, 32


def tiny_model(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    cfg = tinylm.ModelConfig(vocab_size=VOCAB, context_length=64, d_model=D, num_layers=LAYERS, num_heads=HEADS,
                             d_ff=FF, dropout=dropout)
    return tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(seed))


def llama_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def step_of(model: torch.nn.Module, x: torch.Tensor):
    """The user's step: forward, next-token cross-entropy, backward; returns the loss."""
    def step():
        out = model(x[:, :-1])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        return loss
    return step


def injection_sites(model: torch.nn.Module) -> list:
    """The module sites a flip is injected at (not the stream entering the blocks, not the logits)."""
    return [s for s in diff_sites(model) if s.key not in ("embedding", "logits")]


def _pick(t: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
    """(element index among |x| >= median |x|, exponent bit), uniformly."""
    a = t.detach().reshape(-1).abs().float()
    candidates = torch.nonzero(a >= a.median()).reshape(-1)
    index = int(candidates[torch.randint(len(candidates), (), generator=gen)])
    bit = int(torch.randint(EXPONENT_BITS[t.dtype][1], (), generator=gen))
    return index, bit


def _flipped(t: torch.Tensor, gen: torch.Generator, note: dict) -> torch.Tensor:
    out = t.detach().clone()
    index, bit = _pick(out, gen)
    before = float(out.reshape(-1)[index])
    flip_exponent_bit(out, index, bit)
    note.update(index=index, bit=bit, before=before, after=float(out.reshape(-1)[index]))
    return out


@contextlib.contextmanager
def flip_hook(model: torch.nn.Module, site, direction: str, gen: torch.Generator, note: dict):
    """For the ``with`` block, one exponent bit of ``site``'s output (forward) or of the gradient
    with respect to it (backward) flips, once; the hook runs before replay's (prepend)."""
    module = dict(model.named_modules())[site.module]
    done = {"n": 0}

    def grad_hook(g):
        return _flipped(g, gen, note)

    def hook(mod, args, output):
        if done["n"]:
            return None
        done["n"] += 1
        t = first_tensor(output)
        if direction == "forward":
            new = t + (_flipped(t, gen, note) - t.detach())  # the flipped values, still differentiable
            return new if isinstance(output, torch.Tensor) else (new, *output[1:])
        t.register_hook(grad_hook)
        return None

    h = module.register_forward_hook(hook, prepend=True)
    try:
        yield
    finally:
        h.remove()


def injected_step(model, x, site, direction, gen, note):
    """A step whose second call (the rerun) has one flip at ``site``."""
    step, calls = step_of(model, x), {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] == 2:
            with flip_hook(model, site, direction, gen, note):
                return step()
        return step()
    return fn


def inject_once(model, site, direction, seed: int, options=None) -> tuple[bool, bool, str]:
    """(detected, named at the site, summary) of one injection."""
    note: dict = {}
    gen = torch.Generator().manual_seed(seed)
    fn = injected_step(model, tokens(seed), site, direction, gen, note)
    model.zero_grad(set_to_none=True)
    r = replay(model, fn, options)
    named = r.first is not None and r.first.site == site.key and r.first.direction == direction
    got = "-" if r.first is None else f"{r.first.site} ({r.first.direction})"
    return r.verdict == "departs", named, f"{site.key} {direction} bit {note.get('bit')}: {note.get('before', 0):.3g}" \
        f" -> {note.get('after', 0):.3g}; found {got}"


def sweep_injections(model, n: int, direction: str, seed: int = 0, verbose: bool = False, options=None
                     ) -> tuple[int, int]:
    """(detected, named) over ``n`` injections of ``direction`` at sites drawn uniformly."""
    sites = injection_sites(model)
    gen = torch.Generator().manual_seed(seed)
    hit = named = 0
    for i in range(n):
        site = sites[int(torch.randint(len(sites), (), generator=gen))]
        h, nm, text = inject_once(model, site, direction, seed * 100003 + i, options)
        hit, named = hit + h, named + nm
        if verbose and not (h and nm):
            print("  miss:", text)
    return hit, named


# ----------------------------------------------------------------------------- false alarms


def _rerun_differently(model, x, variant: str, compiled=None):
    """A step whose rerun differs only in a way that keeps the math."""
    step, calls = step_of(model, x), {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] == 1 or variant == "identical":
            return step()
        if variant == "threads":
            before = torch.get_num_threads()
            torch.set_num_threads(2 if before == 1 else 1)
            try:
                return step()
            finally:
                torch.set_num_threads(before)
        if variant == "explicit-attention":
            attn = [m for m in model.modules() if isinstance(m, tinylm.MultiHeadSelfAttention)]
            for m in attn:
                m.explicit = True
            try:
                return step()
            finally:
                for m in attn:
                    m.explicit = False
        if variant == "compiled":
            saved = {m: m.__dict__.get("forward") for m in compiled}
            for m, f in compiled.items():
                m.forward = f
            try:
                return step()
            finally:
                for m, f in saved.items():
                    if f is None:
                        del m.forward
                    else:
                        m.forward = f
        raise ValueError(variant)
    return fn


def compiled_forwards(model) -> dict:
    """Each block child's (and the final norm's) forward through torch.compile, not yet installed."""
    from diagnostics.measure.blocks import find_blocks

    named = dict(model.named_modules())
    stack = find_blocks(model)
    mods = [c for b in stack.names for _, c in named[b].named_children()]
    mods += [named[s.module] for s in diff_sites(model) if s.key == "final_norm"]
    return {m: torch.compile(m.forward, dynamic=False) for m in mods}


def sweep_false_alarms(model, variant: str, n: int, seed: int = 0, compiled=None) -> dict[str, int]:
    """Verdict counts over ``n`` reruns of ``variant`` (a fresh batch each)."""
    counts: dict[str, int] = {}
    for i in range(n):
        model.zero_grad(set_to_none=True)
        r = replay(model, _rerun_differently(model, tokens(seed * 7919 + i), variant, compiled))
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
        top = max(r.rows, key=lambda row: row.ratio)
        if top.ratio > counts.get("largest ratio", (0.0, ""))[0]:
            counts["largest ratio"] = (round(top.ratio, 3), f"{top.site} ({top.direction})")
    return counts


# ----------------------------------------------------------------------------- cost


def cost(model, reps: int) -> tuple[float, float]:
    """(median plain step s, median replay s), interleaved in this process."""
    x = tokens(1)
    step = step_of(model, x)
    plain, rep = [], []
    for _ in range(reps + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        replay(model, step)
        rep.append(time.perf_counter() - t0)
    return statistics.median(plain[1:]), statistics.median(rep[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--injections", type=int, default=20, help="per model and direction")
    ap.add_argument("--reruns", type=int, default=20, help="per equivalent variant (tinylm)")
    ap.add_argument("--cost", type=int, default=5, help="timed repetitions")
    ap.add_argument("--cost-model", default="d512", choices=("small", "d512"))
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--models", default="tinylm,llama")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of the injected models")
    ap.add_argument("--exact", action="store_true", help="ReplayOptions(exact=True) for the injections")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    models = {"tinylm": tiny_model, "llama": llama_model}
    for name in a.models.split(","):
        model = models[name](0).to(getattr(torch, a.dtype))
        for direction in ("forward", "backward"):
            if a.injections:
                t0 = time.perf_counter()
                hit, named = sweep_injections(model, a.injections, direction, seed=1, verbose=True,
                                              options=ReplayOptions(exact=a.exact))
                print(f"injection {name:6s} {a.dtype} {'exact ' if a.exact else ''}{direction:8s}: detected {hit}/{a.injections} "
                      f"({100 * hit / a.injections:.1f}%), named at the site {named}/{a.injections} "
                      f"({100 * named / a.injections:.1f}%)  [{time.perf_counter() - t0:.0f} s]")
    if a.reruns:
        model = tiny_model(0)
        variants = ["identical", "threads", "explicit-attention"] + ([] if a.no_compile else ["compiled"])
        compiled = None if a.no_compile else compiled_forwards(model)
        total = {}
        for v in variants:
            t0 = time.perf_counter()
            counts = sweep_false_alarms(model, v, a.reruns, seed=2, compiled=compiled)
            total[v] = counts
            print(f"rerun {v:18s}: {counts}  [{time.perf_counter() - t0:.0f} s]")
        alarms = sum(c.get("departs", 0) for c in total.values())
        runs = sum(v for c in total.values() for k, v in c.items() if k != "largest ratio")
        print(f"false alarms: {alarms} of {runs} reruns")
    if a.cost:
        if a.cost_model == "d512":
            cfg = tinylm.ModelConfig(vocab_size=10000, context_length=256, d_model=512, num_layers=4, num_heads=16,
                                     d_ff=1344)
            model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
            global VOCAB, BATCH, SEQ
            VOCAB, BATCH, SEQ = 10000, 4, 256
        else:
            model = tiny_model(0)
        plain, rep = cost(model, a.cost)
        print(f"cost ({a.cost_model}, {BATCH}x{SEQ} tokens): step {plain * 1e3:.1f} ms, replay {rep * 1e3:.1f} ms, "
              f"replay/step {rep / plain:.2f}; the cost beyond the step itself (the rerun and both "
              f"executions' fingerprints) {rep / plain - 1:.2f} x the step")


if __name__ == "__main__":
    main()

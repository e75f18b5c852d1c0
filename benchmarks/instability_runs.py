"""A catalog of real tiny training runs that fail in known ways, their matched stable controls,
and healthy runs; each trained on CPU with plain hooks that record the ground truth.

The truth is measured here, with plain forward hooks, tensor hooks, the optimizer's own state and
a recomputation of attention logits from q and k; nothing in ``diagnostics`` is used, so the truth
does not depend on the watch it is used to score.

Data: byte-level text (vocabulary 256), the source files of Python's own standard library
(``sysconfig.get_paths()["stdlib"]``, a fixed sorted list of modules), read once; batches are
drawn from it by a seeded generator, so a run replays exactly.

Each run (:class:`Run`) is a seed, a model (``tinylm.TransformerLM`` or the nanoGPT-style
:class:`GPT` below, with eager or SDPA attention), an AdamW setting, a schedule, a precision and a
step count. ``kind`` names the failure a run reproduces ("healthy" for none); ``role`` is
"fail", "control" (the matched stable run, one setting apart) or "healthy".

The departure step (the failure's onset) of a run:

- blow-ups: the first step whose loss is not finite or > 2 x the run's running minimum;
- kinds that stall or degrade without a blow-up at this scale (:data:`RELATIVE_KINDS`: Adam
  epsilon, fp16 underflow, and attention logit growth, post-norm without warm-up and a too-large
  init, whose loss plateaus well above the control's but never doubles): the first step at which
  the run's loss, smoothed by a trailing mean over :data:`SMOOTH` steps, is more than 10% above
  its matched control's smoothed loss at the same step (never before step SMOOTH).

Truth signals, recorded at every ``EVERY``-th step (the step's forward and backward, and its
optimizer step):

- ``attn_max_logit[i]``: the largest |q.k / sqrt(d_k)| over the causal entries of layer i;
  ``attn_entropy_ratio[i]``: the mean row entropy of softmax over those entries divided by the mean
  over rows of ln(number of keys the row may attend to);
- ``logz_mean``, ``logz_absmax``: mean and max of |log Z| (log Z = logsumexp of a row of output
  logits, float32); ``logit_absmax``: max |output logit|;
- ``update_ratio``: per 2-D parameter ||W_after - W_before||_F / ||W_before||_F of the step;
- ``eps_share``: share of the AdamW entries whose sqrt(v_hat) < eps (v_hat = exp_avg_sq / (1 - beta2^t));
- ``grad_zero[i]``, ``grad_under[i]``: share of exactly-zero entries, and of nonzero entries with
  |g| < 2^-14 (fp16's smallest normal), in the gradient at the outputs of block i's attention and
  FFN branches (under fp16 autocast the branches' outputs are float16) and at the block output;
- ``act_max[i]``, ``act_peak[i]``: max |x| and max |x| / median |x| of block i's output, and
  ``branch_max[i]``: max |x| over block i's attention and FFN branch outputs;
- ``grad_norm``: the global gradient norm (after unscaling);
- and the loss (cross-entropy) at every step.

Run ``python benchmarks/instability_runs.py --json PATH`` to train the catalog and write every
run's traces (default ``benchmarks/out/instability_truth.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

EVERY = 10
SMOOTH = 20
RELATIVE_KINDS = ("adam_eps_stall", "fp16_underflow", "attn_logit_growth", "post_norm_no_warmup", "init_too_large")
FP16_TINY = 2.0 ** -14
DEFAULT_JSON = Path(__file__).resolve().parent / "out" / "instability_truth.json"

# ----------------------------------------------------------------------------- data

_FILES = ("argparse.py", "inspect.py", "typing.py", "collections/__init__.py", "dataclasses.py", "pathlib.py",
          "functools.py", "enum.py", "textwrap.py", "difflib.py", "tarfile.py", "zipfile.py", "pickle.py",
          "subprocess.py", "threading.py", "logging/__init__.py", "unittest/case.py", "json/decoder.py",
          "json/encoder.py", "email/message.py", "http/client.py", "urllib/parse.py", "shutil.py", "random.py")
_CORPUS: torch.Tensor | None = None


def corpus() -> torch.Tensor:
    """The byte stream (uint8, 1-D) of the standard library files in ``_FILES`` that exist, in order."""
    global _CORPUS
    if _CORPUS is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        data = b"".join((root / f).read_bytes() for f in _FILES if (root / f).is_file())
        if len(data) < 100_000:
            raise RuntimeError(f"only {len(data)} bytes of standard library source under {root}")
        _CORPUS = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    return _CORPUS


def batch(gen: torch.Generator, batch_size: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 (B, ctx): random windows of the corpus and the next bytes."""
    data = corpus()
    starts = torch.randint(0, len(data) - ctx - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(ctx + 1)[None, :]
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


# ----------------------------------------------------------------------------- a nanoGPT-style model


class GPTAttention(nn.Module):
    """Causal self-attention as nanoGPT writes it: ``c_attn`` stacks q|k|v; ``flash`` picks
    ``F.scaled_dot_product_attention`` (True) or the eager softmax of the masked scores (False)."""

    def __init__(self, d: int, heads: int, ctx: int, flash: bool):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.heads, self.flash = heads, flash
        self.register_buffer("mask", torch.tril(torch.ones(ctx, ctx, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))  # (B, nh, T, hs)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, ctx: int, flash: bool):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d, bias=False), GPTAttention(d, heads, ctx, flash)
        self.ln_2 = nn.LayerNorm(d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model at small size: learned positions, pre-norm LayerNorm blocks, GELU MLP of
    width 4d, tied embeddings, N(0, 0.02) init (residual projections 0.02 / sqrt(2 L)).
    ``forward(idx) -> logits`` (B, T, V)."""

    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int, flash: bool):
        super().__init__()
        self.config = dict(vocab=vocab, ctx=ctx, d=d, layers=layers, heads=heads, flash=flash)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(ctx, d),
            h=nn.ModuleList([GPTBlock(d, heads, ctx, flash) for _ in range(layers)]), ln_f=nn.LayerNorm(d, bias=False)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ----------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Run:
    """One training run of the catalog.

    model: "tinylm" or "gpt" (the nanoGPT-style :class:`GPT`); attention: "sdpa" or "eager"
    (tinylm's explicit path is forced for "eager"). norm, qk_norm: tinylm's ``ModelConfig`` fields
    (qk_norm "none" builds a tinylm that lacks the field as well).
    precision: "fp32", or "fp16" / "bf16": activations stored in that format at the module
    boundaries, compute in float32 (:func:`storage_hooks`).
    loss_scale: the static loss scale (the loss is multiplied before backward, the gradients
    divided after). init_scale: every 2-D weight multiplied by this after init. warmup: steps
    of linear warm-up (0: none), then constant. z_loss: coefficient of mean(log Z^2) added to
    the loss (the recorded loss is the cross-entropy alone). control_of: the failing run a
    control is matched to (its departure is measured against it for the kinds in RELATIVE_KINDS).
    """

    name: str
    kind: str
    role: str
    model: str = "tinylm"
    attention: str = "sdpa"
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    ctx: int = 64
    batch: int = 16
    norm: str = "pre"
    norm_kind: str = "rms"
    ffn: str = "swiglu"
    qk_norm: str = "none"
    lr: float = 3e-3
    warmup: int = 20
    steps: int = 250
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    precision: str = "fp32"
    loss_scale: float = 1.0
    init_scale: float = 1.0
    z_loss: float = 0.0
    seed: int = 0
    control_of: str | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pair(kind: str, base: dict, changed: dict, note: str, name: str | None = None, **control_note) -> list[Run]:
    """A failing run and its control, the control differing only in ``changed``."""
    name = name or kind
    fail = Run(name=f"{name}/fail", kind=kind, role="fail", note=note, **base)
    ctrl = replace(fail, name=f"{name}/control", role="control", control_of=fail.name, **changed)
    return [fail, ctrl]


def _has_qk_norm() -> bool:
    """Whether this tinylm's ModelConfig has the qk_norm field."""
    from dataclasses import fields

    import tinylm

    return "qk_norm" in {f.name for f in fields(tinylm.ModelConfig)}


def _catalog() -> list[Run]:
    runs: list[Run] = []
    hot = dict(warmup=20, weight_decay=0.0)
    # attention logit growth (Dehghani et al. 2023; Wortsman et al. 2023): a high LR without
    # qk-norm; q.k grows, attention entropy collapses, the loss degrades. Control: a lower LR.
    for model, attention in (("tinylm", "sdpa"), ("gpt", "eager"), ("gpt", "sdpa")):
        runs += _pair("attn_logit_growth", dict(model=model, attention=attention, lr=1e-1, **hot), dict(lr=3e-3),
                      "LR 0.1, no qk-norm", name=f"attn_logit_growth/{model}-{attention}")
    if _has_qk_norm():  # the control the literature names: the same LR with qk-norm
        runs += _pair("attn_logit_growth", dict(lr=1e-1, **hot), dict(qk_norm="rms"), "LR 0.1, no qk-norm",
                      name="attn_logit_growth/tinylm-qknorm")
    # fp16 activation overflow: the same growth of the residual stream, stored in float16, passes
    # 65504 and turns inf. Control: stored in bfloat16.
    runs += _pair("fp16_overflow", dict(lr=5e-2, precision="fp16", **hot), dict(precision="bf16"),
                  "LR 0.05, activations stored in float16")
    runs += _pair("fp16_overflow", dict(model="gpt", lr=1e-1, precision="fp16", warmup=50, weight_decay=0.0),
                  dict(precision="bf16"), "LR 0.1, activations stored in float16", name="fp16_overflow/gpt")
    # fp16 gradient underflow without (enough) loss scaling (Micikevicius et al. 2018): gradients
    # stored in float16 flush to zero, training stalls. The failing scale 2^-8 stands in for the
    # smaller gradients of a larger model (here, unscaled fp16 gradients mostly survive).
    # Control: a static loss scale 2^10.
    runs += _pair("fp16_underflow", dict(precision="fp16", loss_scale=2.0 ** -8), dict(loss_scale=2.0 ** 10),
                  "loss scale 2^-8, activations and gradients stored in float16")
    runs += _pair("fp16_underflow", dict(model="gpt", precision="fp16", loss_scale=2.0 ** -8),
                  dict(loss_scale=2.0 ** 10), "loss scale 2^-8, float16 storage", name="fp16_underflow/gpt")
    # Adam epsilon too large: sqrt(v_hat) << eps, the updates are eps-dominated and ~20x too small.
    runs += _pair("adam_eps_stall", dict(eps=1e-1), dict(eps=1e-8), "AdamW eps 0.1")
    runs += _pair("adam_eps_stall", dict(model="gpt", eps=1e-1), dict(eps=1e-8), "AdamW eps 0.1",
                  name="adam_eps_stall/gpt")
    # a too-high LR without warm-up: the first updates are as large as the weights; the loss
    # blows up within a few steps. Control: 50 steps of warm-up.
    runs += _pair("lr_no_warmup", dict(model="gpt", layers=4, lr=1e-1, warmup=0, weight_decay=0.0), dict(warmup=50),
                  "LR 0.1 from step 0", name="lr_no_warmup/gpt")
    runs += _pair("lr_no_warmup", dict(lr=3e-1, warmup=0, weight_decay=0.0), dict(warmup=50), "LR 0.3 from step 0")
    # post-norm without warm-up (Xiong et al. 2020), 6 layers: trains far worse. Control: pre-norm.
    runs += _pair("post_norm_no_warmup", dict(norm="post", layers=6, lr=1e-2, warmup=0, steps=200), dict(norm="pre"),
                  "post-norm, 6 layers, LR 0.01 from step 0")
    # no normalisation at a high LR (Zhang et al. 2019; Huang et al. 2020): activations and output
    # logits grow until the loss diverges. Control: pre-norm.
    runs += _pair("no_norm_divergence", dict(norm="none", lr=1.5e-2, weight_decay=0.0), dict(norm="pre"),
                  "no norm, LR 0.015")
    # too large an init with a high LR: attention saturates from step 0 and the loss degrades.
    runs += _pair("init_too_large", dict(init_scale=5.0, lr=1e-2), dict(init_scale=1.0), "weights x5 at init, LR 0.01")
    # healthy runs across LRs (including high-but-stable ones), depths, widths, norms, models, attention paths
    H = "healthy"
    for lr in (1e-3, 3e-3, 1e-2):
        runs.append(Run(name=f"healthy/tinylm-pre-lr{lr:g}", kind=H, role=H, lr=lr))
        runs.append(Run(name=f"healthy/gpt-sdpa-lr{lr:g}", kind=H, role=H, model="gpt", lr=lr))
    runs += [
        Run(name="healthy/gpt-eager-lr3e-3", kind=H, role=H, model="gpt", attention="eager"),
        Run(name="healthy/gpt-eager-4l-lr1e-2", kind=H, role=H, model="gpt", attention="eager", layers=4, lr=1e-2),
        Run(name="healthy/gpt-sdpa-4l-ctx128", kind=H, role=H, model="gpt", layers=4, ctx=128, batch=8),
        Run(name="healthy/tinylm-eager-lr3e-3", kind=H, role=H, attention="eager"),
        Run(name="healthy/tinylm-4l", kind=H, role=H, layers=4),
        Run(name="healthy/tinylm-6l-lr1e-2", kind=H, role=H, layers=6, lr=1e-2, steps=200),
        Run(name="healthy/tinylm-d32", kind=H, role=H, d_model=32, lr=1e-2),
        Run(name="healthy/tinylm-d96", kind=H, role=H, d_model=96, heads=6),
        Run(name="healthy/tinylm-layernorm", kind=H, role=H, norm_kind="layer"),
        Run(name="healthy/tinylm-post-warmup", kind=H, role=H, norm="post", layers=4, warmup=100),
        Run(name="healthy/tinylm-nonorm-lr3e-3", kind=H, role=H, norm="none"),
        Run(name="healthy/tinylm-gelu", kind=H, role=H, ffn="gelu"),
        Run(name="healthy/tinylm-ctx128", kind=H, role=H, ctx=128, batch=8),
        Run(name="healthy/tinylm-fp16-scaled", kind=H, role=H, precision="fp16", loss_scale=2.0 ** 10),
        Run(name="healthy/tinylm-bf16", kind=H, role=H, precision="bf16"),
        Run(name="healthy/tinylm-seed1-lr1e-2", kind=H, role=H, lr=1e-2, seed=1),
        Run(name="healthy/tinylm-beta2-0.99", kind=H, role=H, beta2=0.99, weight_decay=0.0),
        Run(name="healthy/gpt-fp16-scaled", kind=H, role=H, model="gpt", precision="fp16", loss_scale=2.0 ** 10),
    ]
    return runs


CATALOG: list[Run] = _catalog()


def by_name(name: str) -> Run:
    for r in CATALOG:
        if r.name == name:
            return r
    raise KeyError(name)


# ----------------------------------------------------------------------------- building and training


def build(run: Run) -> nn.Module:
    """The run's model, initialised from its seed."""
    torch.manual_seed(run.seed)
    if run.model == "gpt":
        model = GPT(256, run.ctx, run.d_model, run.layers, run.heads, flash=run.attention == "sdpa")
    else:
        import tinylm
        from tinylm.config import default_d_ff

        kw = dict(qk_norm=run.qk_norm) if run.qk_norm != "none" else {}  # a tinylm without qk_norm: "none"
        cfg = tinylm.ModelConfig(vocab_size=256, context_length=run.ctx, d_model=run.d_model, num_layers=run.layers,
                                 num_heads=run.heads, d_ff=default_d_ff(run.d_model), norm=run.norm,
                                 norm_kind=run.norm_kind, ffn=run.ffn, **kw)
        model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(run.seed))
        if run.attention == "eager":
            for layer in model.layers:
                layer.attn.explicit = True
    if run.precision != "fp32":
        storage_hooks(model, torch.float16 if run.precision == "fp16" else torch.bfloat16)
    if run.init_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(run.init_scale)
    return model


def _to_float(mod, args):
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def storage_hooks(model: nn.Module, dtype: torch.dtype) -> None:
    """Store activations in ``dtype`` at the module boundaries, compute in float32: the outputs
    of the embeddings, of each block's attention and FFN branches, of each block and of the head
    are cast to ``dtype`` (so they overflow, and their gradients underflow, as that format does),
    and those modules cast their floating inputs back to float32."""
    mods = [m for m in model.modules() if isinstance(m, nn.Embedding) or type(m).__name__ == "Embedding"]
    for block in blocks_of(model):
        mods += [block, *branches_of(block)]
    mods.append(model.lm_head)
    for m in mods:
        m.register_forward_pre_hook(_to_float)
        m.register_forward_hook(lambda mod, inp, out: out.to(dtype))


def blocks_of(model: nn.Module) -> list[nn.Module]:
    return list(model.transformer.h) if isinstance(model, GPT) else list(model.layers)


def branches_of(block: nn.Module) -> tuple[nn.Module, nn.Module]:
    return (block.attn, block.mlp) if isinstance(block, GPTBlock) else (block.attn, block.ffn)


def _attn_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[float, float]:
    """(max |logit|, mean entropy / mean ln(keys)) of causal attention over q, k (B, H, T, d_k)."""
    q, k = q.detach().float(), k.detach().float()
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    max_logit = float(s.abs().masked_fill(~causal, 0.0).amax())
    logp = torch.log_softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    p = logp.exp()
    ent = -(p * logp.masked_fill(~causal, 0.0)).sum(-1)  # (B, H, T)
    ceiling = torch.log(torch.arange(1, T + 1, dtype=torch.float32)).mean()
    return max_logit, float(ent.mean() / ceiling)


def _share(g: torch.Tensor) -> tuple[float, float]:
    """(share of exact zeros, share of nonzero entries below 2^-14 in magnitude) of g."""
    a = g.detach().abs()
    n = a.numel()
    return float((a == 0).sum()) / n, float(((a > 0) & (a < FP16_TINY)).sum()) / n


class Truth:
    """Plain hooks that record the truth signals (module docstring) at the steps it is armed."""

    def __init__(self, model: nn.Module, run: Run):
        self.model, self.run = model, run
        self.on = False
        self.cur: dict[str, Any] = {}
        self.handles: list[Any] = []
        self.blocks = blocks_of(model)
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_hook(self._block_hook(i)))
            for j, branch in enumerate(branches_of(block)):
                self.handles.append(branch.register_forward_hook(self._branch_hook(i, j)))
            if isinstance(block, GPTBlock):
                self.handles.append(block.attn.c_attn.register_forward_hook(self._qkv_hook(i, block.attn.heads)))
            else:
                self.handles.append(block.attn.register_observer(self._observer(i)))
        self.handles.append(model.lm_head.register_forward_hook(self._head_hook))
        self.matrices = {n: p for n, p in model.named_parameters() if p.dim() == 2}
        self.before: dict[str, torch.Tensor] = {}

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def arm(self, on: bool) -> None:
        self.on = on
        L = len(self.blocks)
        self.cur = {key: [math.nan] * L for key in ("attn_max_logit", "attn_entropy_ratio", "act_max", "act_peak",
                                                     "branch_max", "grad_zero", "grad_under")} if on else {}
        self._grads: dict[tuple[int, int], tuple[float, float]] = {}

    def _attn(self, i: int, q: torch.Tensor, k: torch.Tensor) -> None:
        self.cur["attn_max_logit"][i], self.cur["attn_entropy_ratio"][i] = _attn_stats(q, k)

    def _observer(self, i: int) -> Callable:
        def fn(q, k, v, heads, weights):
            if self.on:
                self._attn(i, q, k)
        return fn

    def _qkv_hook(self, i: int, heads: int) -> Callable:
        def fn(mod, inp, out):
            if self.on:
                B, T, C3 = out.shape
                q, k, _ = out.split(C3 // 3, dim=2)
                self._attn(i, q.view(B, T, heads, -1).transpose(1, 2), k.view(B, T, heads, -1).transpose(1, 2))
        return fn

    def _grad_hook(self, i: int, j: int) -> Callable:
        def fn(g):
            self._grads[(i, j)] = _share(g)
        return fn

    def _block_hook(self, i: int) -> Callable:
        def fn(mod, inp, out):
            if not self.on:
                return
            a = out.detach().abs().float()
            mx, med = float(a.amax()), float(a.median())
            self.cur["act_max"][i] = mx
            self.cur["act_peak"][i] = mx / med if med > 0 else math.inf
            if out.requires_grad:
                out.register_hook(self._grad_hook(i, 2))
        return fn

    def _branch_hook(self, i: int, j: int) -> Callable:
        def fn(mod, inp, out):
            if not self.on:
                return
            mx = float(out.detach().abs().float().amax())
            prev = self.cur["branch_max"][i]
            self.cur["branch_max"][i] = mx if math.isnan(prev) else max(prev, mx)
            if out.requires_grad:
                out.register_hook(self._grad_hook(i, j))
        return fn

    def _head_hook(self, mod, inp, out) -> None:
        if not self.on:
            return
        logits = out.detach().float()
        logz = torch.logsumexp(logits, dim=-1)
        self.cur["logz_mean"] = float(logz.mean().abs())
        self.cur["logz_absmax"] = float(logz.abs().amax())
        self.cur["logit_absmax"] = float(logits.abs().amax())

    def before_step(self) -> None:
        if self.on:
            self.before = {n: p.detach().clone() for n, p in self.matrices.items()}
            for i in range(len(self.blocks)):
                shares = [self._grads.get((i, j), (math.nan, math.nan)) for j in range(3)]
                self.cur["grad_zero"][i] = max(s[0] for s in shares)
                self.cur["grad_under"][i] = max(s[1] for s in shares)

    def after_step(self, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The finished record of an armed step (None when not armed)."""
        if not self.on:
            return None
        ratios = {}
        for n, p in self.matrices.items():
            w0 = self.before[n]
            ratios[n] = float((p.detach() - w0).norm() / w0.norm().clamp_min(1e-30))
        self.cur["update_ratio"] = ratios
        self.cur["update_ratio_max"] = max(ratios.values())
        self.cur["update_ratio_median"] = float(torch.tensor(list(ratios.values())).median())
        below = total = 0
        for group in opt.param_groups:
            b2, eps = group["betas"][1], group["eps"]
            for p in group["params"]:
                st = opt.state.get(p, {})
                if "exp_avg_sq" not in st:
                    continue
                t = float(st["step"])
                vhat = st["exp_avg_sq"] / (1 - b2 ** t)
                below += int((vhat.sqrt() < eps).sum())
                total += vhat.numel()
        self.cur["eps_share"] = below / total if total else math.nan
        self.before = {}
        out, self.cur = self.cur, {}
        return out


def schedule(run: Run, t: int) -> float:
    """Linear warm-up over ``run.warmup`` steps, then constant."""
    return run.lr * min(1.0, (t + 1) / run.warmup) if run.warmup else run.lr


def train(run: Run, *, truth: bool = True, watch_factory: Callable | None = None, on_record: Callable | None = None,
          stop_after: int | None = 20, snapshots: bool = False) -> dict[str, Any]:
    """Train ``run``; returns {"losses", "records", "departure", "seconds", ...}.

    truth: attach :class:`Truth`. watch_factory(model, opt) -> a watch (``step(t)`` context,
    ``record(loss, lr=)``), attached as a user's loop would. on_record(t, model, report): called
    after each step's record (report: the watch's return or None). stop_after: stop this many
    steps after a blow-up departure (None: run all steps; the kinds in RELATIVE_KINDS always run all steps).
    snapshots: keep the state dict at every EVERY-th step (before its update) in "snapshots".
    """
    torch.set_num_threads(1)
    model = build(run)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(run.beta1, run.beta2), eps=run.eps,
                            weight_decay=run.weight_decay)
    gen = torch.Generator().manual_seed(1000 + run.seed)
    tr = Truth(model, run) if truth else None
    watch = watch_factory(model, opt) if watch_factory is not None else None
    losses: list[float] = []
    records: list[dict[str, Any]] = []
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    reports: list[Any] = []
    stop_at = None
    start = time.perf_counter()
    for t in range(run.steps):
        lr = schedule(run, t)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(gen, run.batch, run.ctx)
        armed = t % EVERY == 0
        if snapshots and armed:
            snaps[t] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if tr is not None:
            tr.arm(armed)
        with (watch.step(t) if watch is not None else contextlib.nullcontext()):
            logits = model(x).float()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss = ce + run.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean() if run.z_loss else ce
            (loss * run.loss_scale).backward()
            if run.loss_scale != 1.0:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.div_(run.loss_scale)
            gnorm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()
                                         if p.grad is not None)))
            if tr is not None:
                tr.before_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = tr.after_step(opt) if tr is not None else None
        lv = float(ce.detach())
        report = watch.record(lv, lr=lr) if watch is not None else None
        losses.append(lv)
        if rec is not None:
            rec.update(step=t, loss=lv, lr=lr, grad_norm=gnorm)
            records.append(rec)
        if on_record is not None:
            on_record(t, model, report)
        if report is not None:
            reports.append(report)
        if stop_at is None and stop_after is not None and run.kind not in RELATIVE_KINDS:
            if blowup(losses) is not None:
                stop_at = t + stop_after
        if stop_at is not None and (t >= stop_at or not math.isfinite(lv)):
            break
    if tr is not None:
        tr.close()
    out = dict(run=run.to_dict(), losses=losses, records=records, seconds=time.perf_counter() - start,
               departure=blowup(losses), model=model, watch=watch)
    if snapshots:
        out["snapshots"] = snaps
    return out


# ----------------------------------------------------------------------------- departure


def blowup(losses: list[float]) -> int | None:
    """The first step whose loss is not finite or > 2 x the running minimum before it (None: none)."""
    low = math.inf
    for t, v in enumerate(losses):
        if not math.isfinite(v) or v > 2 * low:
            return t
        low = min(low, v)
    return None


def smooth(losses: list[float], n: int = SMOOTH) -> list[float]:
    """Trailing mean over the last n steps (fewer at the start); a non-finite loss stays non-finite."""
    out, acc = [], 0.0
    for t, v in enumerate(losses):
        acc += v
        if t >= n:
            acc -= losses[t - n]
        out.append(acc / min(t + 1, n))
    return out


def onset_vs_control(losses: list[float], control: list[float], factor: float = 1.1) -> int | None:
    """The first step whose smoothed loss is > factor x the control's smoothed loss at that step."""
    a, b = smooth(losses), smooth(control)
    for t in range(SMOOTH, min(len(a), len(b))):
        if not math.isfinite(a[t]) or a[t] > factor * b[t]:
            return t
    return None


def departures(results: dict[str, dict[str, Any]]) -> dict[str, int | None]:
    """Each run's departure: its blow-up, or for a failing run of a kind in RELATIVE_KINDS its onset
    against its control (that kind's control: its own blow-up, like every other run)."""
    out = {}
    for name, res in results.items():
        run = res["run"]
        if run["kind"] in RELATIVE_KINDS and run["role"] == "fail":
            ctrl = next((r for r in results.values() if r["run"].get("control_of") == name), None)
            out[name] = onset_vs_control(res["losses"], ctrl["losses"]) if ctrl is not None else None
        else:
            out[name] = blowup(res["losses"])
    return out


# ----------------------------------------------------------------------------- signals against thresholds

LEAD = 20


def thresholds() -> dict[str, float]:
    """diagnostics.Thresholds() as a dict (empty when diagnostics cannot be imported)."""
    try:
        from diagnostics import Thresholds

        return Thresholds().to_dict()
    except Exception:
        return {}


#: (truth key, reducer over layers, direction, threshold field or a callable of thresholds and run)
SIGNALS = [
    ("attn_max_logit", max, "high", "attn_logit"),
    ("attn_entropy_ratio", min, "low", "attn_entropy"),
    ("logz_mean", None, "high", "logz_limit"),
    ("logit_absmax", None, "high", "logit_limit"),
    ("update_ratio_max", None, "high", "update_high"),
    ("update_ratio_median", None, "low", "update_low"),
    ("eps_share", None, "high", "eps_share"),
    ("grad_zero", max, "high", "underflow_share"),
    ("act_max", max, "high", "overflow_headroom"),
    ("act_peak", max, "high", "massive_ratio"),
]

_FINITE_MAX = {"fp16": 65504.0, "bf16": 3.39e38, "fp32": 3.4e38}


def _value(rec: dict[str, Any], key: str, reduce) -> float:
    v = rec.get(key)
    if v is None:
        return math.nan
    if isinstance(v, list):
        vals = [x for x in v if isinstance(x, (int, float)) and not math.isnan(x)]
        return reduce(vals) if vals else math.nan
    return float(v) if isinstance(v, (int, float)) else math.nan


def _threshold(field: str, th: dict[str, float], precision: str) -> float:
    if field == "overflow_headroom":
        return _FINITE_MAX[precision] / th.get(field, math.nan)
    return th.get(field, math.nan)


def signal_table(results: dict[str, dict[str, Any]], th: dict[str, float]) -> list[dict[str, Any]]:
    """Per signal, beside the threshold: the most extreme value of the healthy runs and, apart, of
    the controls (records after step 0; the record at step 0, the first update, apart), and of
    each failing run up to LEAD steps before its departure. grad_zero counts only runs stored in
    fp16; act_max is read as a fraction of each run's storage format's largest finite / headroom."""
    rows = []
    for key, reduce, direction, field in SIGNALS:
        pick = max if direction == "high" else min
        seen: dict[str, list] = {"healthy": [], "control": [], "step0": []}
        early: dict[str, tuple[float, int]] = {}
        for name, res in results.items():
            run, dep = res["run"], res["departure"]
            if key == "grad_zero" and run["precision"] != "fp16":
                continue
            for rec in res["records"]:
                v = _value(rec, key, reduce)
                if key == "act_max":
                    v = v / _threshold(field, th, run["precision"])
                if math.isnan(v):
                    continue
                if run["role"] != "fail":
                    seen["step0" if rec["step"] == 0 else run["role"]].append((v, name, rec["step"]))
                elif dep is not None and rec["step"] <= dep - LEAD:
                    prev = early.get(name)
                    if prev is None or pick(prev[0], v) == v:
                        early[name] = (v, rec["step"])
        thr = 1.0 if key == "act_max" else _threshold(field, th, "fp32")
        ext = {k: (pick(v, key=lambda x: x[0]) if v else None) for k, v in seen.items()}
        rows.append(dict(signal=key, threshold_field=field, threshold=thr, direction=direction,
                         healthy_extreme=ext["healthy"], control_extreme=ext["control"],
                         healthy_step0_extreme=ext["step0"], failing_early=early))
    return rows


def signal_lines(table: list[dict[str, Any]]) -> list[str]:
    """The signal table (:func:`signal_table`) as text lines."""
    out = ["", "per signal: the extreme of the healthy runs and of the controls (steps > 0; step 0 of both apart) "
               f"beside the threshold, and each failing run's extreme up to {LEAD} steps before its departure"]

    def at(e):
        return f"{e[0]:.3g} ({e[1]} @{e[2]})" if e else "-"

    for row in table:
        h0 = row["healthy_step0_extreme"]
        unit = " (x the format's largest finite / headroom)" if row["signal"] == "act_max" else ""
        h0s = f"{h0[0]:.3g}" if h0 else "-"
        out.append(f"  {row['signal']:20s} {row['direction']:4s} threshold {row['threshold']:.3g}{unit}: "
                   f"healthy {at(row['healthy_extreme'])}; controls {at(row['control_extreme'])}; step 0 {h0s}")
        for name, (v, step) in row["failing_early"].items():
            out.append(f"      {name:44s} {v:.3g} (@{step})")
    return out


def separation_lines(results: dict[str, dict[str, Any]], table: list[dict[str, Any]]) -> list[str]:
    """Per failing run, the signals that pass the healthy runs' extreme before its departure: the
    first record past it and the lead (departure - that step) a threshold just past the healthy
    extreme would give (a signal that never passes it is left out)."""
    out = ["", "per failing run: signals past every healthy run's extreme before departure "
               "(signal: first record step past it, lead = departure - step)"]
    for name, res in results.items():
        run, dep = res["run"], res["departure"]
        if run["role"] != "fail" or dep is None:
            continue
        found = []
        for row, (key, reduce, direction, field) in zip(table, SIGNALS):
            h = row["healthy_extreme"]
            if h is None:
                continue
            for rec in res["records"]:
                if rec["step"] >= dep:
                    break
                v = _value(rec, key, reduce)
                if key == "act_max":
                    v = v / _threshold(field, thresholds(), run["precision"])
                if math.isnan(v) and key != "act_max":
                    continue
                past = v > h[0] if direction == "high" else v < h[0]
                if past:
                    found.append(f"{key} @{rec['step']} (lead {dep - rec['step']})")
                    break
        out.append(f"  {name:44s} departure {dep:4d}: {'; '.join(found) or 'none'}")
    return out


def kind_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Per failing run: its setting, its departure and its control's."""
    out = ["", "failing runs: departure (control's departure)"]
    for name, res in results.items():
        run = res["run"]
        if run["role"] != "fail":
            continue
        ctrl = next((r for r in results.values() if r["run"].get("control_of") == name), None)
        cdep = ctrl["departure"] if ctrl is not None else "-"
        rule = "vs control" if run["kind"] in RELATIVE_KINDS else "blow-up"
        out.append(f"  {name:44s} {run['note']:48s} departure {res['departure']} ({rule}); control {cdep}")
    bad = [n for n, r in results.items() if r["run"]["role"] != "fail" and r["departure"] is not None]
    out.append(f"healthy runs and controls that departed: {', '.join(bad) or 'none'}")
    return out


# ----------------------------------------------------------------------------- command line


def _worker(name: str) -> dict[str, Any]:
    res = train(by_name(name))
    res.pop("model"), res.pop("watch")
    return res


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def run_all(names: list[str], workers: int, fn: Callable[[str], dict[str, Any]] = _worker,
            progress: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, dict[str, Any]]:
    """fn(name) for each name, over ``workers`` processes (each one thread), in catalog order."""
    os.environ["OMP_NUM_THREADS"] = "1"
    results: dict[str, dict[str, Any]] = {}
    if workers <= 1:
        for n in names:
            results[n] = fn(n)
            if progress:
                progress(n, results[n])
    else:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            for n, res in zip(names, pool.imap(fn, names)):
                results[n] = res
                if progress:
                    progress(n, results[n])
    return {n: results[n] for n in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where the traces go")
    ap.add_argument("--workers", type=int, default=1, help="processes (one thread each)")
    ap.add_argument("--only", default="", help="comma-separated substrings of run names")
    ap.add_argument("--summary", action="store_true", help="print the tables of the traces in --json; train nothing")
    args = ap.parse_args(argv)
    if args.summary:
        results = json.loads(Path(args.json).read_text())["runs"]
    else:
        names = [r.name for r in CATALOG if not args.only or any(s in r.name for s in args.only.split(","))]
        print(f"{len(names)} runs, {args.workers} worker process(es), 1 thread each", flush=True)

        def progress(n: str, res: dict[str, Any]) -> None:
            print(f"  {n:40s} {len(res['losses']):4d} steps {res['seconds']:6.1f}s  blow-up {res['departure']}  "
                  f"last loss {res['losses'][-1]:.3f}", flush=True)

        results = run_all(names, args.workers, progress=progress)
        deps = departures(results)
        for n, res in results.items():
            res["departure"] = deps[n]
    table = signal_table(results, thresholds())
    print("\n".join(kind_lines(results) + signal_lines(table) + separation_lines(results, table)))
    if not args.summary:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(_clean(dict(every=EVERY, smooth=SMOOTH, runs=results))))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

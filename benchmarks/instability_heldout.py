"""A second, independent set of failing training runs with matched controls, and healthy runs,
built by another recipe than benchmarks/instability_runs.py: the early warnings are scored on it,
never tuned on it.

The recipe is nanoGPT's training loop (karpathy/nanoGPT ``train.py``) at a small size, and an
OLMo-like one for tinylm models:

- data: character-level (the distinct bytes of the text, 104 symbols) from *other* files of
  Python's standard library than the tuning set reads; batches of 12 windows of 64 characters;
- the plain-PyTorch model :class:`NanoGPT` below, written after nanoGPT's ``model.py`` (biases in
  every Linear and LayerNorm, GELU MLP of width 4d, learned positions, tied head, N(0, 0.02)
  init with the residual projections at 0.02 / sqrt(2 L)), with SDPA or eager attention; or
  tinylm's ``TransformerLM`` (no biases, RMSNorm, SwiGLU);
- AdamW with weight decay on the matrices only, betas (0.9, 0.99) (nanoGPT's small-model
  setting; 0.95 for the OLMo-like runs), a linear warm-up then a cosine decay to a tenth of the
  peak, the gradient norm clipped at 1.0, the loss divided by the gradient-accumulation count
  (``accum``: nanoGPT divides by its 40 micro-steps; Adam is invariant to it, a cast of the
  gradient to float16 is not).

Failures (each with a control one setting apart) and where a lead is possible:

| kind | failing run | control |
| --- | --- | --- |
| attention logit growth | NanoGPT (SDPA) at LR 3e-2, tinylm (eager) at LR 0.1, no qk-norm | LR 1e-3 / qk-norm |
| gradient underflow through a cast | the gradient into a block rounded through float16 (the loss divided as OLMo's 4M-token step divides it), no loss scaling | loss scale 2^16 |
| post-norm without warm-up | NanoGPT post-LN, 6 layers, LR 1e-2 from step 0 | 100 warm-up steps |
| output-logit divergence | NanoGPT, untied head without final norm, LR 1e-2, no weight decay | z-loss 1e-4 |
| Adam epsilon too large | tinylm, eps 1e-3 | eps 1e-8 |
| an LR spike | tinylm, the LR ramped up 100x over steps 80-120 (a wrong restart) | no ramp |

The departure of a failing run: the earlier of its blow-up (the loss not finite or > 2x its
running minimum) and its onset against its control (the 20-step trailing mean 10% above the
control's), the rules of instability_runs.py.

    python benchmarks/instability_heldout.py [--workers N] [--json PATH] [--only SUBSTR]
    python benchmarks/instability_heldout.py --rejudge PATH   # judge the saved histories again, train nothing
    python benchmarks/instability_heldout.py --nanogpt PATH/model.py   # the NanoGPT runs on nanoGPT's own model

``--rejudge`` replays each saved watch history through the watch's own judge
(:class:`diagnostics.jobs.watch_alerts.AlertBook`, the verdicts over time and the recorded
spike and non-finite events) with the current code and thresholds: the alerts the watch would
have raised on the same records. It reads any results file holding ``runs`` with a
``history``, ``losses`` and ``run`` each (this module's, or the tuning set's when saved so).

Each worker process uses one thread.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import instability_runs as IR  # noqa: E402  (only its departure rules and process pool)

EVERY = 10
DEFAULT_JSON = Path(__file__).resolve().parent / "out" / "instability_heldout.json"

# ----------------------------------------------------------------------------- data

_FILES = ("ast.py", "tokenize.py", "configparser.py", "calendar.py", "statistics.py", "fractions.py",
          "heapq.py", "string.py", "locale.py", "gettext.py", "csv.py", "optparse.py", "smtplib.py",
          "ftplib.py", "mailbox.py", "pdb.py", "doctest.py", "trace.py")
_DATA: tuple[torch.Tensor, int] | None = None


def data() -> tuple[torch.Tensor, int]:
    """(the text as int64 symbol ids, the vocabulary size): each distinct byte one symbol."""
    global _DATA
    if _DATA is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        raw = b"".join((root / f).read_bytes() for f in _FILES if (root / f).is_file())
        if len(raw) < 100_000:
            raise RuntimeError(f"only {len(raw)} bytes of standard library source under {root}")
        b = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        symbols = torch.unique(b)
        lookup = torch.full((256,), -1, dtype=torch.long)
        lookup[symbols] = torch.arange(len(symbols))
        _DATA = (lookup[b], len(symbols))
    return _DATA


def get_batch(gen: torch.Generator, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, _ = data()
    ix = torch.randint(len(ids) - ctx - 1, (batch,), generator=gen)
    x = torch.stack([ids[i:i + ctx] for i in ix.tolist()])
    y = torch.stack([ids[i + 1:i + 1 + ctx] for i in ix.tolist()])
    return x, y


# ----------------------------------------------------------------------------- the model


class _RoundHalf(torch.autograd.Function):
    """Identity forward; the backward rounds the gradient through float16 (as a ``.half()`` in
    a user's model, or a hook that stores gradients in float16, does) and hands it on in float32."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.half().float()


def cast_backward(module: nn.Module) -> None:
    """Round the gradient that leaves ``module`` through its input (to every module below it)
    through float16."""
    module.register_forward_pre_hook(lambda mod, args: (_RoundHalf.apply(args[0]), *args[1:]))


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, ctx: int, flash: bool):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_head, self.flash = heads, flash
        self.register_buffer("bias", torch.tril(torch.ones(ctx, ctx)).view(1, 1, ctx, ctx), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LN (``post=False``: x + f(ln(x))) or post-LN (ln(x + f(x)), the original Transformer's)."""

    def __init__(self, d: int, heads: int, ctx: int, flash: bool, post: bool):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), SelfAttention(d, heads, ctx, flash)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)
        self.post = post

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post:
            x = self.ln_1(x + self.attn(x))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT at small size (module docstring); ``tied``: the head shares the token
    embedding; ``final_norm``: ln_f before the head. ``forward(idx) -> logits`` (B, T, V)."""

    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int, flash: bool = True,
                 post: bool = False, tied: bool = True, final_norm: bool = True):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(ctx, d),
            h=nn.ModuleList([Block(d, heads, ctx, flash, post) for _ in range(layers)]),
            ln_f=nn.LayerNorm(d) if final_norm else nn.Identity()))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# ----------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Run:
    """One run: ``model`` "nanogpt" or "tinylm"; ``attention`` "sdpa" or "eager"; ``post``:
    post-LN (NanoGPT); ``tied``/``final_norm``: NanoGPT's head; ``qk_norm``: tinylm's;
    ``cast``: the block whose backward is rounded through float16 (None: none); ``loss_scale``:
    a static scale around the backward; ``spike``: (first step, last step, factor) of a ramp of
    the LR up to ``factor`` x; ``z_loss``: coefficient of mean (log Z)^2."""

    name: str
    kind: str
    role: str
    model: str = "nanogpt"
    attention: str = "sdpa"
    layers: int = 3
    d_model: int = 64
    heads: int = 4
    ctx: int = 64
    batch: int = 12
    post: bool = False
    tied: bool = True
    final_norm: bool = True
    qk_norm: str = "none"
    lr: float = 3e-3
    warmup: int = 10
    steps: int = 200
    weight_decay: float = 0.1
    beta2: float = 0.99
    eps: float = 1e-8
    accum: int = 40
    cast: int | None = None
    loss_scale: float = 1.0
    spike: tuple[int, int, float] | None = None
    z_loss: float = 0.0
    seed: int = 0
    control_of: str | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pair(name: str, kind: str, fail: dict, changed: dict, note: str) -> list[Run]:
    f = Run(name=f"{name}/fail", kind=kind, role="fail", note=note, **fail)
    return [f, replace(f, name=f"{name}/control", role="control", control_of=f.name, **changed)]


def _catalog() -> list[Run]:
    olmo = dict(model="tinylm", beta2=0.95)
    runs = []
    runs += _pair("attn_logit_growth/nanogpt", "attn_logit_growth", dict(lr=3e-2, weight_decay=0.0), dict(lr=1e-3),
                  "LR 3e-2, no qk-norm")
    runs += _pair("attn_logit_growth/tinylm", "attn_logit_growth", dict(lr=1e-1, attention="eager", **olmo),
                  dict(qk_norm="rms"), "LR 0.1, no qk-norm")
    big = dict(accum=5461)  # the loss divided as OLMo's 4M-token step (2048 x 2048) divides it
    runs += _pair("grad_cast_underflow/tinylm", "grad_cast_underflow", dict(cast=1, **big, **olmo),
                  dict(loss_scale=2.0 ** 16), "the gradient into block 1 rounded through float16, no loss scaling")
    runs += _pair("grad_cast_underflow/nanogpt", "grad_cast_underflow", dict(cast=2, **big),
                  dict(loss_scale=2.0 ** 16), "the gradient into block 2 rounded through float16, no loss scaling")
    runs += _pair("post_norm_no_warmup", "post_norm_no_warmup", dict(post=True, layers=6, lr=1e-2, warmup=0),
                  dict(warmup=100), "post-LN, 6 layers, LR 1e-2 from step 0")
    runs += _pair("output_logit_divergence", "output_logit_divergence",
                  dict(tied=False, final_norm=False, lr=1e-2, weight_decay=0.0), dict(z_loss=1e-4),
                  "untied head, no final norm, LR 1e-2, no weight decay")
    runs += _pair("adam_eps", "adam_eps", dict(eps=1e-3, **olmo), dict(eps=1e-8), "AdamW eps 1e-3")
    runs += _pair("lr_spike", "lr_spike", dict(spike=(80, 120, 100.0), **olmo), dict(spike=None),
                  "LR ramped 100x over steps 80-120")
    H = "healthy"
    runs += [
        Run(name="healthy/nanogpt-lr1e-3", kind=H, role=H, lr=1e-3),
        Run(name="healthy/nanogpt-lr6e-3", kind=H, role=H, lr=6e-3),
        Run(name="healthy/nanogpt-eager-4l", kind=H, role=H, attention="eager", layers=4),
        Run(name="healthy/nanogpt-post-warmup", kind=H, role=H, post=True, layers=4, warmup=100),
        Run(name="healthy/nanogpt-untied", kind=H, role=H, tied=False),
        Run(name="healthy/tinylm-olmo-lr3e-3", kind=H, role=H, **olmo),
        Run(name="healthy/tinylm-olmo-lr1e-2-4l", kind=H, role=H, lr=1e-2, layers=4, warmup=50, **olmo),
        Run(name="healthy/tinylm-olmo-d96", kind=H, role=H, d_model=96, heads=6, seed=1, **olmo),
    ]
    return runs


CATALOG: list[Run] = _catalog()


def by_name(name: str) -> Run:
    return next(r for r in CATALOG if r.name == name)


#: the environment variable naming nanoGPT's own model.py (``--nanogpt``), read by each worker
NANOGPT_ENV = "INSTABILITY_NANOGPT_MODEL"


def nanogpt_builds(run: Run) -> bool:
    """Whether nanoGPT's own ``GPT`` builds ``run``'s model: pre-LN, tied head, final norm."""
    return run.model == "nanogpt" and not run.post and run.tied and run.final_norm


class NanoGPTModel(nn.Module):
    """nanoGPT's ``GPT`` (from its own model.py) called as this loop calls a model: the logits of
    every position, which nanoGPT returns when it is given targets (its own loss is not used)."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx, idx)[0]


@functools.lru_cache(maxsize=2)
def _nanogpt_module(path: str):
    """nanoGPT's model.py at ``path``, loaded once per process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nanogpt(path: str, run: Run, vocab: int) -> nn.Module:
    """``run``'s model built by the ``GPT`` class of nanoGPT's model.py at ``path``; eager attention
    as nanoGPT builds it where SDPA is missing (its causal mask buffer)."""
    module = _nanogpt_module(path)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # its parameter count, printed by every build
        gpt = module.GPT(module.GPTConfig(block_size=run.ctx, vocab_size=vocab, n_layer=run.layers, n_head=run.heads,
                                          n_embd=run.d_model, dropout=0.0, bias=True))
    if run.attention == "eager":
        for block in gpt.transformer.h:
            block.attn.flash = False
            block.attn.register_buffer("bias", torch.tril(torch.ones(run.ctx, run.ctx)).view(1, 1, run.ctx, run.ctx))
    return NanoGPTModel(gpt)


def build(run: Run) -> nn.Module:
    _, vocab = data()
    torch.manual_seed(run.seed)
    if run.model == "nanogpt" and os.environ.get(NANOGPT_ENV):
        model = _nanogpt(os.environ[NANOGPT_ENV], run, vocab)
        blocks = model.gpt.transformer.h
    elif run.model == "nanogpt":
        model = NanoGPT(vocab, run.ctx, run.d_model, run.layers, run.heads, flash=run.attention == "sdpa",
                        post=run.post, tied=run.tied, final_norm=run.final_norm)
        blocks = model.transformer.h
    else:
        import tinylm

        kw = dict(qk_norm=run.qk_norm) if run.qk_norm != "none" else {}
        cfg = tinylm.ModelConfig(vocab_size=vocab, context_length=run.ctx, d_model=run.d_model,
                                 num_layers=run.layers, num_heads=run.heads, d_ff=4 * run.d_model, **kw)
        model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(run.seed))
        if run.attention == "eager":
            for layer in model.layers:
                layer.attn.explicit = True
        blocks = model.layers
    if run.cast is not None:
        cast_backward(blocks[run.cast])
    return model


def lr_at(run: Run, t: int) -> float:
    """nanoGPT's schedule: linear warm-up, cosine decay to lr / 10 at the last step; times the spike's ramp."""
    if t < run.warmup:
        lr = run.lr * (t + 1) / (run.warmup + 1)
    else:
        ratio = (t - run.warmup) / max(1, run.steps - run.warmup)
        lr = run.lr / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (run.lr - run.lr / 10)
    if run.spike is not None:
        a, b, factor = run.spike
        if t >= a:
            lr *= 1 + (factor - 1) * min(1.0, (t - a) / max(1, b - a))
    return lr


def optimizer(model: nn.Module, run: Run) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": run.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=run.lr, betas=(0.9, run.beta2), eps=run.eps)


def train(run: Run, watch: bool = True) -> dict[str, Any]:
    """Train ``run`` (with ``diagnostics.Watch(model, every=10, optimizer=opt)`` when ``watch``):
    its losses, the watch's history and alerts."""
    torch.set_num_threads(1)
    model = build(run)
    opt = optimizer(model, run)
    gen = torch.Generator().manual_seed(2000 + run.seed)
    w = None
    if watch:
        from diagnostics import Watch

        w = Watch(model, every=EVERY, optimizer=opt)
    losses, alerts = [], []
    start = time.perf_counter()
    for t in range(run.steps):
        lr = lr_at(run, t)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = get_batch(gen, run.batch, run.ctx)
        with w.step(t) if w is not None else _null():
            logits = model(x)
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            loss = ce + run.z_loss * torch.logsumexp(logits.float(), -1).pow(2).mean() if run.z_loss else ce
            ((loss / run.accum) * run.loss_scale).backward()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(run.accum / run.loss_scale)  # the accumulated gradient of the mean loss
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad(set_to_none=True)
        lv = float(ce.detach())
        losses.append(lv)
        if w is not None:
            report = w.record(lv, lr=lr, grad_norm=gnorm)
            alerts += [_alert(a) for a in report]
        if not math.isfinite(lv):
            break
    out = dict(run=run.to_dict(), losses=losses, seconds=time.perf_counter() - start, alerts=alerts)
    if w is not None:
        out["history"] = w.history
        out["failure"] = None if w.failure is None else {"step": w.failure.step, "verdict": w.failure.verdict}
        w.close()
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _alert(a: Any) -> dict[str, Any]:
    return {k: getattr(a, k) for k in ("step", "severity", "signal", "site", "value", "threshold", "message")}


# ----------------------------------------------------------------------------- scoring


def departures(results: dict[str, dict[str, Any]]) -> dict[str, int | None]:
    """A failing run's departure: the earlier of its blow-up and its onset against its control;
    any other run's: its blow-up."""
    out = {}
    for name, res in results.items():
        blow = IR.blowup(res["losses"])
        ctrl = next((r for r in results.values() if r["run"].get("control_of") == name), None)
        if res["run"]["role"] == "fail" and ctrl is not None:
            rel = IR.onset_vs_control(res["losses"], ctrl["losses"])
            out[name] = min((d for d in (blow, rel) if d is not None), default=None)
        else:
            out[name] = blow
    return out


def score(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per kind: warned before departure and the lead (departure - first alert); false alarms:
    any alert on a healthy run; alerts on the controls apart."""
    kinds: dict[str, dict[str, Any]] = {}
    healthy_alarms, control_alerts = {}, {}
    for name, res in results.items():
        run, dep = res["run"], res["departure"]
        steps = [a["step"] for a in res["alerts"]]
        first = min(steps) if steps else None
        signals = sorted({a["signal"] for a in res["alerts"]})
        if run["role"] == "fail":
            k = kinds.setdefault(run["kind"], dict(runs=0, warned=0, leads=[], rows=[]))
            k["runs"] += 1
            early = first is not None and dep is not None and first < dep
            k["warned"] += early
            if early:
                k["leads"].append(dep - first)
            k["rows"].append(dict(name=name, departure=dep, first_alert=first, signals=signals))
        elif res["alerts"]:
            (healthy_alarms if run["role"] == "healthy" else control_alerts)[name] = dict(first=first, signals=signals)
    leads = [x for k in kinds.values() for x in k["leads"]]
    return dict(kinds=kinds, healthy_alarms=healthy_alarms, control_alerts=control_alerts,
                lead_median=statistics.median(leads) if leads else None)


def report(results: dict[str, dict[str, Any]], scores: dict[str, Any]) -> str:
    out = ["", "per failure kind (lead = departure step - first alert step)"]
    for kind, k in scores["kinds"].items():
        out.append(f"  {kind:26s} runs {k['runs']}  warned before departure {k['warned']}  leads {k['leads']}")
        for row in k["rows"]:
            out.append(f"      {row['name']:40s} departure {row['departure']}  first alert {row['first_alert']}  "
                       f"{', '.join(row['signals'])}")
    n_h = sum(r["run"]["role"] == "healthy" for r in results.values())
    n_c = sum(r["run"]["role"] == "control" for r in results.values())
    out.append(f"median lead over every warned failing run: {scores['lead_median']}")
    out.append(f"false alarms: {len(scores['healthy_alarms'])} of {n_h} healthy runs; "
               f"alerts on {len(scores['control_alerts'])} of {n_c} controls")
    for name, fa in {**scores["healthy_alarms"], **scores["control_alerts"]}.items():
        out.append(f"  {name:40s} first alert step {fa['first']}: {', '.join(fa['signals'])}")
    return "\n".join(out)


def _worker(name: str) -> dict[str, Any]:
    return train(by_name(name))


def _tuning_worker(name: str) -> dict[str, Any]:
    """A run of the tuning set (instability_runs.CATALOG) with the watch, its history kept."""
    torch.set_num_threads(1)
    from diagnostics import Watch

    res = IR.train(IR.by_name(name), watch_factory=lambda m, o: Watch(m, every=EVERY, optimizer=o), stop_after=30)
    w = res.pop("watch")
    res.pop("model")
    res.update(history=w.history, alerts=[_alert(a) for a in w.alerts])
    w.close()
    return res


def rejudge(history: dict[str, Any]) -> list[dict[str, Any]]:
    """The alerts the watch raises on ``history``'s records, judged again with the current code."""
    from diagnostics import Thresholds
    from diagnostics.jobs.watch_alerts import AlertBook
    from diagnostics.judge.over_time import Extremes, record_verdicts

    h = dict(history, records=[])
    th = Thresholds()
    book, earlier = AlertBook(h, th, 4, EVERY), Extremes()
    for rec in history["records"]:
        h["records"].append(rec)
        rows = record_verdicts(rec, earlier, h.get("norm"), th, h.get("kinds"))
        earlier.update(rec)
        book.judge(rec, rows, [])
    out = [_alert(a) for a in book.alerts]
    return out + [dict(step=e["step"], severity="warn", signal=e["kind"], site=None, value=None, threshold=None,
                       message=e.get("message", "")) for e in history.get("events", [])]


def _rejudged(path: str) -> int:
    results = json.loads(Path(path).read_text())["runs"]
    for res in results.values():
        res["alerts"] = rejudge(res["history"])
        res["losses"] = [math.nan if v is None else float(v) for v in res["losses"]]  # NaN and inf as saved
    tuning = all(n in {r.name for r in IR.CATALOG} for n in results)  # the tuning set: its own departure rules
    for n, d in (IR.departures(results) if tuning else departures(results)).items():
        results[n]["departure"] = d
    print(f"{len(results)} runs of {path}, judged again")
    print(report(results, score(results)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=1, help="processes, one thread each (default 1)")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where the results (with the histories) go")
    ap.add_argument("--only", default="", help="comma-separated substrings of run names")
    ap.add_argument("--tuning", action="store_true", help="train the tuning set's runs instead (healthy first)")
    ap.add_argument("--rejudge", default="", help="a results file: judge its histories again, train nothing")
    ap.add_argument("--nanogpt", default="", metavar="MODEL_PY",
                    help="nanoGPT's own model.py: the NanoGPT runs its GPT can build use it (the others are left out)")
    args = ap.parse_args(argv)
    if args.rejudge:
        return _rejudged(args.rejudge)
    catalog = IR.CATALOG if args.tuning else CATALOG
    if args.nanogpt:
        if args.tuning or not Path(args.nanogpt).is_file():
            print(f"--nanogpt {args.nanogpt}: give nanoGPT's model.py (a file), without --tuning", file=sys.stderr)
            return 2
        os.environ[NANOGPT_ENV] = str(Path(args.nanogpt).resolve())
        if args.json == str(DEFAULT_JSON):  # not over the re-written model's results
            args.json = str(DEFAULT_JSON.with_name("instability_heldout_nanogpt.json"))
        pairs = {r.name: r for r in catalog}
        catalog = [r for r in catalog if nanogpt_builds(r) and all(
            nanogpt_builds(c) for c in catalog if c.control_of == r.name or r.control_of == c.name)]
    names = [r.name for r in catalog if not args.only or any(s in r.name for s in args.only.split(","))]
    if args.tuning:  # the healthy runs first: the false alarms are what this set is read for
        names.sort(key=lambda n: IR.by_name(n).role != "healthy")
    for n in list(names):  # a failing run is judged against its control
        ctrl = next((r.name for r in catalog if r.control_of == n), None)
        if ctrl and ctrl not in names:
            names.insert(names.index(n) + 1, ctrl)
    print(f"{len(names)} runs, {args.workers} worker process(es), 1 thread each", flush=True)
    start = time.perf_counter()

    def progress(n: str, res: dict[str, Any]) -> None:
        first = min((a["step"] for a in res["alerts"]), default=None)
        print(f"  {n:40s} {len(res['losses']):4d} steps {res['seconds']:6.1f}s  last loss {res['losses'][-1]:.3f}  "
              f"alerts {len(res['alerts']):3d}  first {first}", flush=True)

    results = IR.run_all(names, args.workers, fn=_tuning_worker if args.tuning else _worker, progress=progress)
    for n, d in departures(results).items():
        results[n]["departure"] = d
    scores = score(results)
    print(report(results, scores))
    print(f"\n{len(names)} runs in {time.perf_counter() - start:.0f} s on {args.workers} process(es), one thread each")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(IR._clean(dict(every=EVERY, runs=results, scores=scores)), default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

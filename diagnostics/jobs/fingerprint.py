"""``fingerprint``: one forward and backward pass of a model, each site reduced at once to a sketch.

    fp = fingerprint(model, tokens, DiffOptions(batch_size=4, seq_len=256))
    fp.save("run.npz"); Fingerprint.load("run.npz")

Sites (:func:`diff_sites`, the one place that says which tensors a diff measures and how two
models' tensors pair): the stream entering the blocks (``embedding``: block 0's input), per
block i its attention and MLP branch outputs (``layers.i.attn``, ``layers.i.ffn``, before they
are added) and its output (``layers.i``, the residual stream), the final norm's output
(``final_norm``) and the logits; for each, the forward tensor and the gradient of the loss
(mean next-token cross-entropy, computed in float32 from the logits) with respect to it.

Reduction, in the hook, under ``no_grad``, in float64: the tensor X, flattened to (N, w) (N the
leading elements, w its last dimension), with non-finite entries counted and set to 0, gives

    moments   count, mean, mean square, max |x|, non-finite count
    sketch    S = G^T X H / k,   G (N, k), H (w, k) standard Gaussian,

G and H drawn from a generator seeded with sha256 of (the projection seed, the axis, its
length, k), the same on every machine. vec(S) is a Kronecker Johnson-Lindenstrauss projection
of vec(X) with E ||S||_F^2 = ||X||_F^2, so ||S_a - S_b|| / ||S_b|| estimates ||a - b|| / ||b||
(:func:`diagnostics.judge.departure.relative_departure`). Nothing else is kept: memory is
2 k^2 + 5 floats per site and direction, plus the projection matrices.

A model whose parameters need no gradient is given them for the pass; its ``training`` flags,
``requires_grad`` and ``.grad`` are put back as they were, whatever happens.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import Tensor, nn

import tinylm

from ..measure.blocks import find_blocks, is_norm
from ..measure.outputs import call_model
from ..measure.probe import instrument_points
from ..measure.step_record import hook_sites
from ..options import DiffOptions, OptionsError
from .diagnose_sample import model_context

__all__ = ["Site", "SiteRecord", "Fingerprint", "FingerprintError", "diff_sites", "fingerprint", "sketch",
           "FORMAT", "VERSION", "PROJECTION_SEED"]

FORMAT, VERSION = "tinylm-fingerprint", 1
#: seeds the projection matrices G and H (a fingerprint records it; two are compared only if equal)
PROJECTION_SEED = 20240611
_ATTN = re.compile(r"(attn|attention)$", re.IGNORECASE)
_FFN = re.compile(r"(mlp|ffn|feed_forward)$", re.IGNORECASE)


class FingerprintError(OptionsError):
    """A fingerprint file that cannot be read, or two that cannot be compared."""


@dataclass(frozen=True)
class Site:
    """One measured tensor of a model: ``key`` its structural name, shared by every model
    ("embedding", "layers.i.attn", "layers.i.ffn", "layers.i", "final_norm", "logits"),
    ``module`` the module's name in this model ("" for the logits: the model's output),
    ``kind``, ``block`` (None outside the blocks) and ``order`` (its position in the forward)."""

    key: str
    module: str
    kind: str
    block: int | None
    order: int


def diff_sites(model: nn.Module) -> list[Site]:
    """The sites of ``model`` in forward order (module docstring), paired across models by ``key``.

    The block stack is :func:`diagnostics.measure.blocks.find_blocks`'s; a block's attention and
    MLP are a tinylm block's ``attn`` and ``ffn`` (as :func:`instrument_points` names them), else
    the block's child whose name ends in attn/attention and mlp/ffn/feed_forward (the MLP: else
    the block's last linear child, the MLP's output where its layers are the block's own, as in
    OPT); the final norm is ``ln_final`` for tinylm, else :func:`_final_norm`. A model without a
    block stack has the logits only."""
    stack = find_blocks(model)
    points = instrument_points(model)
    L = len(stack) if stack is not None else 0
    out = [Site("logits", "", "logits", None, 3 * L + 2)]
    if stack is None:
        return out
    out.append(Site("embedding", stack.input, "embedding", None, 0))
    tiny = isinstance(model, tinylm.TransformerLM)
    named = dict(model.named_modules())
    for i, block in enumerate(stack.names):
        out.append(Site(f"layers.{i}", block, "residual", i, 3 * i + 3))
        ffn = own_linear = None
        for child, mod in named[block].named_children():
            name = f"{block}.{child}"
            if (points.get(name) == "attn_branch") if tiny else bool(_ATTN.search(child)):
                out.append(Site(f"layers.{i}.attn", name, "attn_branch", i, 3 * i + 1))
            elif (points.get(name) == "ffn_branch") if tiny else bool(_FFN.search(child)):
                ffn = name
            elif not tiny and isinstance(mod, nn.Linear):
                own_linear = name  # the block's last linear child: its MLP's output where the MLP is no child (OPT)
        if ffn or own_linear:
            out.append(Site(f"layers.{i}.ffn", ffn or own_linear, "ffn_branch", i, 3 * i + 2))
    final = _final_norm(model, stack)
    if tiny:
        final = "ln_final" if getattr(model, "ln_final", None) is not None else None
    if final is not None:
        out.append(Site("final_norm", final, "final_norm", None, 3 * L + 1))
    return sorted(out, key=lambda s: s.order)


def _final_norm(model: nn.Module, stack) -> str | None:
    """The last norm (:func:`~diagnostics.measure.blocks.is_norm`) after the block stack and outside
    it; else the last norm outside it whose own name says "final" (OPT registers its final norm
    before its blocks)."""
    after, final, named = False, None, None
    for name, mod in model.named_modules():
        if name == stack.names[-1]:
            after = True
        elif stack.index(name) is None and is_norm(mod):
            if after:
                final = name
            elif "final" in name.rsplit(".", 1)[-1]:
                named = name
    return final or named


# ----------------------------------------------------------------------------- the reduction


def _gaussian(n: int, k: int, axis: str, seed: int, device: torch.device, cache: dict) -> Tensor:
    """(n, k) standard Gaussian float64, the same on every machine for (seed, axis, n, k)."""
    key = (n, k, axis, seed, str(device))
    if key not in cache:
        digest = hashlib.sha256(f"{seed}:{axis}:{n}:{k}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        cache[key] = torch.randn(n, k, generator=g, dtype=torch.float64).to(device)
    return cache[key]


@torch.no_grad()
def sketch(x: Tensor, k: int, seed: int = PROJECTION_SEED, cache: dict | None = None) -> tuple[Tensor, Tensor]:
    """(moments, S) of ``x`` (module docstring): moments = [count, mean, mean square, max |x|,
    non-finite count] over the finite entries, S = G^T X H / k (k, k), both float64 on x's device."""
    cache = {} if cache is None else cache
    x = x.detach()
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
    xd = x2.double()
    finite = torch.isfinite(xd)
    bad = (~finite).sum()
    xd = torch.where(finite, xd, torch.zeros((), dtype=xd.dtype, device=xd.device))
    n = finite.sum().clamp(min=1)
    moments = torch.stack([finite.sum().double(), xd.sum() / n, (xd * xd).sum() / n,
                           xd.abs().max() if xd.numel() else xd.new_zeros(()), bad.double()])
    G = _gaussian(xd.shape[0], k, "rows", seed, xd.device, cache)
    H = _gaussian(xd.shape[1], k, "columns", seed, xd.device, cache)
    return moments, G.T @ (xd @ H) / k


# ----------------------------------------------------------------------------- the records


@dataclass
class SiteRecord:
    """One site and direction of a fingerprint: the site's fields, the tensor's dtype and shape,
    its moments (count, mean, mean_square, max_abs, nonfinite) and ``sketch`` (k, k) float64."""

    key: str
    module: str
    kind: str
    block: int | None
    order: int
    direction: str
    dtype: str
    shape: tuple[int, ...]
    count: float
    mean: float
    mean_square: float
    max_abs: float
    nonfinite: float
    sketch: np.ndarray = field(repr=False)

    def fields(self) -> dict:
        """Everything but the sketch, as JSON values."""
        d = {k: v for k, v in asdict(self).items() if k != "sketch"}
        d["shape"] = list(self.shape)
        return d


@dataclass
class Fingerprint:
    """The sites of one pass (``records``, forward then backward), the tokens it read (B, T+1) and
    ``meta``: format, version, model (class, parameters, config), dtype, device, tokens_sha256,
    batch_size, seq_len, seed, k, projection_seed, loss, torch."""

    meta: dict
    tokens: np.ndarray
    records: list[SiteRecord]

    def record(self, key: str, direction: str) -> SiteRecord | None:
        return next((r for r in self.records if r.key == key and r.direction == direction), None)

    def save(self, path: str | Path) -> Path:
        """Write an .npz archive (plain arrays and one JSON string; read back without pickle) at
        ``path`` whatever its name (no suffix is added; the file is told by its content), whole or
        not at all, with the mode the user's umask gives a new file."""
        from tinylm.checkpoint import atomic_write

        path = Path(path)
        k = int(self.meta["k"])
        sketches = np.stack([r.sketch for r in self.records]) if self.records else np.zeros((0, k, k))
        text = json.dumps({"meta": self.meta, "records": [r.fields() for r in self.records]}, sort_keys=True)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, header=np.frombuffer(text.encode(), dtype=np.uint8), tokens=self.tokens.astype(np.int64),
                         sketches=sketches.astype(np.float64))

        atomic_write(path, write)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Fingerprint":
        """Read a file :meth:`save` wrote (``allow_pickle=False``); anything else is a FingerprintError."""
        try:
            with np.load(path, allow_pickle=False) as z:
                head = json.loads(bytes(z["header"]).decode())
                tokens, sketches = np.array(z["tokens"]), np.array(z["sketches"])
            meta, rows = head["meta"], head["records"]
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            records = [SiteRecord(**{**r, "shape": tuple(r["shape"])}, sketch=s) for r, s in zip(rows, sketches)]
        except FingerprintError:
            raise
        except Exception as e:  # a zip, JSON or field error: the file is not one of ours
            raise FingerprintError(f"path={str(path)!r}: must be a fingerprint file written by "
                                   f"diagnostics.fingerprint(...).save ({type(e).__name__}: {e})") from None
        if int(meta.get("version", 0)) > VERSION:
            raise FingerprintError(f"path={str(path)!r}: must be a fingerprint of version <= {VERSION}, got "
                                   f"{meta.get('version')}; pass a file this version of tinylm wrote")
        return cls(meta, tokens, records)

    def __repr__(self) -> str:
        m = self.meta
        return (f"Fingerprint({m['model']['class']}, {len(self.records)} records, tokens {m['batch_size']}x"
                f"{m['seq_len']}, {m['dtype']} on {m['device']}, k={m['k']})")


# ----------------------------------------------------------------------------- the pass


def _vocab(model: nn.Module) -> int | None:
    value = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(value, int):
        return value
    return next((m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, tinylm.Embedding))), None)


def batch_of(model: nn.Module, tokens, options: DiffOptions) -> Tensor:
    """The measured batch (B, T+1) int64: ``tokens`` (N, T+1) windows (the first batch_size), a 1-D
    stream (batch_size windows drawn with the seed) or None (uniform random ids, seeded)."""
    ctx = model_context(model)
    seq_len = options.seq_len or (min(ctx, 256) if ctx else 128)
    if tokens is None:
        vocab = _vocab(model)
        if vocab is None:
            raise OptionsError("tokens=None: must be given for a model without a vocabulary (no config.vocab_size, "
                               "no Embedding); pass tokens=")
        return torch.randint(0, vocab, (options.batch_size, seq_len + 1),
                             generator=torch.Generator().manual_seed(options.seed))
    t = torch.as_tensor(np.asarray(tokens) if not isinstance(tokens, Tensor) else tokens)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise OptionsError(f"tokens dtype={t.dtype}: must be integer token ids; pass (N, T+1) windows or a 1-D stream")
    t = t.long().cpu()
    if t.dim() == 1:
        from tinylm.data import get_batch

        x, y = get_batch(t.numpy(), options.batch_size, seq_len, torch.Generator().manual_seed(options.seed))
        return torch.cat([x, y[:, -1:]], dim=1)
    if t.dim() != 2 or t.shape[1] < 3:
        raise OptionsError(f"tokens shape={tuple(t.shape)}: must be (N, T+1) windows with T >= 2 or a 1-D stream")
    return t[:options.batch_size]


def _logits(output) -> Tensor:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        first = next((o for o in output if isinstance(o, Tensor)), None)
        if first is not None:
            return first
    value = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if not isinstance(value, Tensor):
        raise OptionsError(f"model output={type(output).__name__}: must hold next-token logits (B, T, V) (a tensor, a "
                           "tuple's first tensor or .logits); pass DiffOptions(inputs=...) or wrap the model")
    return value


class _Recorder:
    """Reduces each site's tensor as it comes (forward in the hook, backward in a gradient hook)."""

    def __init__(self, k: int, backward: bool):
        self.k, self.backward = k, backward
        self.cache: dict = {}
        self.store: dict[tuple[str, str], tuple[Tensor, Tensor, str, tuple]] = {}

    def take(self, site: Site, t: Tensor | None) -> None:
        if not isinstance(t, Tensor) or not t.is_floating_point() or (site.key, "forward") in self.store:
            return
        self._reduce(site, "forward", t)
        if self.backward and t.requires_grad:
            t.register_hook(lambda g, _s=site: self._reduce(_s, "backward", g))

    def _reduce(self, site: Site, direction: str, t: Tensor) -> None:
        moments, s = sketch(t, self.k, PROJECTION_SEED, self.cache)
        self.store[(site.key, direction)] = (moments, s, str(t.dtype).removeprefix("torch."), tuple(t.shape))


@contextlib.contextmanager
def _recording(model: nn.Module, sites: list[Site], recorder: _Recorder) -> Iterator[None]:
    """Hooks on every site for the ``with`` block; removed, and the model put back, whatever happens."""
    named = dict(model.named_modules())
    stack = find_blocks(model)
    training = {m: m.training for m in named.values()}
    params = list(model.named_parameters())
    requires = {n: p.requires_grad for n, p in params}
    grads = {n: p.grad for n, p in params}
    with contextlib.ExitStack() as undo:
        undo.callback(_restore, model, training, requires, grads)
        hook_sites(undo, model, sites, stack, recorder.take, output=False)
        model.eval()
        for _, p in params:
            p.grad = None
            if recorder.backward and p.is_floating_point():
                p.requires_grad_(True)
        yield


def _restore(model: nn.Module, training: dict, requires: dict, grads: dict) -> None:
    for m, flag in training.items():
        m.training = flag
    for n, p in model.named_parameters():
        if n in requires:
            p.requires_grad_(requires[n])
            p.grad = grads[n]


def _describe(model: nn.Module) -> dict:
    config = getattr(model, "config", None)
    if isinstance(config, tinylm.ModelConfig):
        conf = asdict(config)
    elif hasattr(config, "to_dict"):
        conf = {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool)) or v is None}
    else:
        conf = None
    seen, count = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            count += p.numel()
    return {"class": type(model).__name__, "parameters": count, "config": conf}


def _cast(model: nn.Module, dtype: str | None) -> nn.Module:
    """``model`` itself, or a deep copy cast to ``dtype`` (the caller's model is never cast)."""
    if dtype is None:
        return model
    return copy.deepcopy(model).to(getattr(torch, dtype))


def fingerprint(model: nn.Module, tokens=None, options: DiffOptions | None = None, *,
                dtype: str | None = None) -> Fingerprint:
    """One forward and backward pass of ``model`` on the measured batch, reduced per site (module docstring).

    Args:
        model: any ``nn.Module`` whose output holds next-token logits (B, T, V).
        tokens: (N, T+1) windows, a 1-D token stream, or None (uniform random ids; see :func:`batch_of`).
        options: :class:`diagnostics.DiffOptions` (batch_size, seq_len, seed, k, backward, inputs).
        dtype: None measures the model as it is; a dtype name measures a copy cast to it.
    Returns:
        a :class:`Fingerprint`; the model is left as it was.
    """
    if not isinstance(model, nn.Module):
        raise OptionsError(f"model={type(model).__name__}: must be a torch.nn.Module; pass the model itself")
    options = options or DiffOptions()
    batch = batch_of(model, tokens, options)
    run = _cast(model, dtype)
    device = next((p.device for p in run.parameters()), torch.device("cpu"))
    sites = diff_sites(run)
    recorder = _Recorder(options.k, options.backward)
    ids, targets = batch[:, :-1].to(device).contiguous(), batch[:, 1:].to(device).contiguous()
    with _recording(run, sites, recorder):
        out = call_model(run, ids, targets, options.inputs)  # a forward(idx, targets) gets every position's logits
        logits = _logits(out)
        recorder.take(sites[-1] if sites[-1].key == "logits" else next(s for s in sites if s.key == "logits"), logits)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
        if options.backward and loss.requires_grad:
            loss.backward()
    return _assemble(run, sites, recorder, batch, options, float(loss.detach()), device)


def _to_host(vectors: list[Tensor], sketches: list[Tensor]) -> tuple[list[list[float]], list[np.ndarray]]:
    """Every site's moments (as float lists) and sketch (as float64 arrays) from one transfer to
    the host: one flat float64 tensor on the first one's device (one sync on a GPU, not two per
    site), cut back into each piece's shape (the same values: all are float64)."""
    if not vectors:
        return [], []
    device = vectors[0].device
    pieces = [t.to(device).reshape(-1) for t in (*vectors, *sketches)]
    flat = torch.cat(pieces).cpu().numpy()
    cuts = np.cumsum([p.numel() for p in pieces])[:-1]
    parts = np.split(flat, cuts)
    n = len(vectors)
    return [p.tolist() for p in parts[:n]], [p.reshape(s.shape) for p, s in zip(parts[n:], sketches)]


def _assemble(model, sites, recorder, batch, options, loss, device) -> Fingerprint:
    """The records (forward in order, then backward from the loss) and the meta of one pass."""
    keys = list(recorder.store)
    vectors, sketches = _to_host([recorder.store[k][0] for k in keys], [recorder.store[k][1] for k in keys])
    records = []
    for (key, direction), vec, sk in zip(keys, vectors, sketches):
        site = next(s for s in sites if s.key == key)
        _, _, dt, shape = recorder.store[(key, direction)]
        records.append(SiteRecord(site.key, site.module, site.kind, site.block, site.order, direction, dt, shape,
                                  *vec, sketch=sk))
    records.sort(key=lambda r: (r.direction != "forward", r.order if r.direction == "forward" else -r.order))
    arr = batch.numpy().astype(np.int64)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    meta = {"format": FORMAT, "version": VERSION, "model": _describe(model), "dtype": ",".join(dtypes) or "none",
            "device": str(device), "tokens_sha256": hashlib.sha256(arr.tobytes()).hexdigest(),
            "batch_size": int(arr.shape[0]), "seq_len": int(arr.shape[1] - 1), "seed": options.seed, "k": options.k,
            "projection_seed": PROJECTION_SEED, "loss": loss, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "unmeasured": [s.key for s in sites if (s.key, "forward") not in recorder.store]}
    return Fingerprint(meta, arr, records)

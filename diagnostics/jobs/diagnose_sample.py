"""What ``diagnose`` measures: the models (one per seed), each one's batches, and the loss of a batch.

Internal to :mod:`diagnostics.jobs.diagnose` (its ``_sample`` and ``_measure`` stages).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn

import tinylm

from ..measure.outputs import call_model, read_output, takes_targets
from ..options import DiagnoseOptions, OptionsError

__all__ = ["CONTEXT_KEYS", "model_context", "kv_heads", "parameter_placement", "takes_targets", "seed_batches", "seed_models", "batch_loss"]

_HOW = ("diagnose reads next-token logits (B, T, V), a tuple whose first tensor they are, an object with .logits "
        "or .loss, or a 0-d loss (a forward(idx, targets=None) is given targets); pass DiagnoseOptions(inputs=ids -> model arguments, loss_fn=(logits, targets) -> "
        "loss) (diagnostics/API.md)")


#: where a model's config states its context length, in the order they are read: tinylm,
#: nanoGPT / minGPT, Hugging Face (Llama-style, GPT-2-style, ...)
CONTEXT_KEYS = ("context_length", "block_size", "max_position_embeddings", "n_positions", "n_ctx", "seq_length",
                "max_seq_len")


def model_context(model: nn.Module) -> int | None:
    """The longest sequence the model takes: the first of :data:`CONTEXT_KEYS` that its
    ``config`` (an object or a dict) holds as an integer > 1 (tinylm's ``context_length``,
    nanoGPT's ``block_size``, Hugging Face's ``max_position_embeddings`` / ``n_positions``),
    else None (unknown)."""
    config = getattr(model, "config", None)
    if isinstance(model, tinylm.TransformerLM):
        return config.context_length
    get = config.get if isinstance(config, Mapping) else (lambda key: getattr(config, key, None))
    for key in CONTEXT_KEYS:
        value = get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None


def kv_heads(model: nn.Module) -> int | None:
    """The key/value head count the model's config states (tinylm's ``num_kv_heads``, else its head
    count; Hugging Face's ``num_key_value_heads``), None where it states none."""
    config = getattr(model, "config", None)
    if isinstance(model, tinylm.TransformerLM):
        return config.num_kv_heads or config.num_heads
    get = config.get if isinstance(config, Mapping) else (lambda key: getattr(config, key, None))
    for key in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
        value = get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def parameter_placement(model: nn.Module) -> tuple[str, str]:
    """(the floating dtype(s) of the parameters, "/"-joined in order of first use; their device(s))."""
    params = list(model.parameters())
    dtypes = dict.fromkeys(str(p.dtype).removeprefix("torch.") for p in params if p.is_floating_point())
    devices = dict.fromkeys(str(p.device) for p in params)
    return "/".join(dtypes), "/".join(devices)


def _vocab(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    for m in model.modules():
        if isinstance(m, (nn.Embedding, tinylm.Embedding)):
            return m.num_embeddings
    return None


def seed_batches(model: nn.Module, tokens, options: DiagnoseOptions, seq_len: int) -> tuple[list[list[Tensor]], str]:
    """The measured batches of each seed, each (B, seq_len + 1) int64, and their source ("random" or
    "given"). Random tokens and windows of a 1-D stream are drawn afresh for every seed (the first
    seed's are those of a one-seed run), so that the seeds are independent replicates; given
    (N, T+1) windows are the same for every seed."""
    draws = options.seeds
    if tokens is None:
        vocab = _vocab(model)
        if vocab is None:
            raise OptionsError("tokens=None: cannot draw random tokens for a model without a vocabulary "
                               "(no config.vocab_size, no Embedding); pass tokens=")
        gen = torch.Generator().manual_seed(options.seed)
        return [[torch.randint(0, vocab, (options.batch_size, seq_len + 1), generator=gen)
                 for _ in range(options.batches)] for _ in range(draws)], "random"
    if not isinstance(tokens, Tensor):
        arr = np.asarray(tokens)  # a memory-mapped token file stays mapped: only the sampled windows are read
        if arr.dtype.kind not in "iu":
            raise OptionsError(f"tokens dtype {arr.dtype}: token ids must be integers")
        stream = arr if arr.ndim == 1 else None
        t = None if stream is not None else torch.from_numpy(np.array(arr, dtype=np.int64))
    else:
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise OptionsError(f"tokens dtype {tokens.dtype}: token ids must be integers")
        t = tokens.long()
        stream = t.numpy() if t.dim() == 1 else None
    if stream is not None:
        from tinylm.data import get_batch

        gen = torch.Generator().manual_seed(options.seed)
        out = []
        for _ in range(draws):
            out.append([])
            for _ in range(options.batches):
                x, y = get_batch(stream, options.batch_size, seq_len, gen)
                out[-1].append(torch.cat([x, y[:, -1:]], dim=1))
        return out, "given"
    if t.dim() != 2 or t.shape[1] < 3:
        raise OptionsError(f"tokens shape {tuple(t.shape)}: pass (N, T+1) windows with T >= 2, or a 1-D token stream")
    b = options.batch_size
    chunks = [t[i:i + b] for i in range(0, t.shape[0], b)]
    if len(chunks) > 1 and chunks[-1].shape[0] < b:
        chunks = chunks[:-1]
    return [chunks] * draws, "given"


def seed_models(model: nn.Module, options: DiagnoseOptions) -> list[nn.Module]:
    """The models measured: ``model`` itself for one seed; for n seeds, n copies of a tinylm model
    re-initialised from its own scheme with seeds seed..seed+n-1."""
    if options.seeds == 1:
        return [model]
    if not isinstance(model, tinylm.TransformerLM):
        raise OptionsError(f"seeds={options.seeds}: re-initialising needs a tinylm.TransformerLM; use seeds=1")
    out = []
    for i in range(options.seeds):
        m = copy.deepcopy(model)
        tinylm.init.apply(m, model.config.init, generator=torch.Generator().manual_seed(options.seed + i))
        m.zero_grad(set_to_none=True)
        out.append(m)
    return out


def batch_loss(model: nn.Module, batch: Tensor, options: DiagnoseOptions | None = None,
               logits_out: dict | None = None) -> tuple[Tensor, tuple[float, float], int | None]:
    """The loss of ``batch`` (B, T+1) whose gradient is measured, the two softmax moments the
    theory's cross-entropy-gradient rule rests on, over its B*T positions: (E[sum_c p_c^2], E[p_y])
    (NaN without next-token logits), and V when the loss is the mean next-token cross-entropy of
    (B, T, V) logits (None otherwise: the loss is then not comparable with ln V).

    The model's output is read by :func:`diagnostics.measure.outputs.read_output`. The moments are
    computed under no_grad from the logits upcast to float32, in chunks of rows (memory stays
    ~16 MB whatever the vocabulary), and summed in float64.

    ``logits_out``: a dict that, where the output holds next-token logits, receives the output
    logits' scale over the same rows, with log Z_t = logsumexp_c z_{t,c} of row t in float32:
    {"logz_sum": sum_t log Z_t, "logz_squares": sum_t (log Z_t)^2, "logz_absmax": max_t |log Z_t|,
    "max_logit": max_{t,c} |z_{t,c}|, "rows": the row count}, from the chunks the softmax reads.
    """
    options = options or DiagnoseOptions()
    batch = batch.to(next((p.device for p in model.parameters()), batch.device))  # tokens go where the weights are
    ids, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # a user's forward may .view them
    output = call_model(model, ids, targets, options.inputs)
    logits, own = read_output(output)
    next_token = logits is not None and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(ids.shape) \
        and logits.is_floating_point() and int(targets.max()) < logits.shape[-1]
    if options.loss_fn is not None:
        if logits is None:
            raise OptionsError(f"model output {type(output).__name__}: holds no logits tensor for loss_fn; {_HOW}")
        loss = options.loss_fn(logits, targets)
    elif next_token:
        loss = tinylm.functional.cross_entropy(logits.float(), targets)
    elif own is not None:
        loss = own
    else:
        shape = f" of shape {tuple(logits.shape)}" if logits is not None else ""
        if logits is not None and logits.dim() == 3 and logits.shape[1] == 1 < ids.shape[1]:
            shape += " (the last position's logits only)"
        raise OptionsError(f"model output {type(output).__name__}{shape}: not next-token logits for ids of shape "
                           f"{tuple(ids.shape)}; {_HOW}")
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise OptionsError(f"loss {type(loss).__name__}: must be a one-element float tensor; {_HOW}")
    loss = loss.reshape(())
    if not next_token:
        return loss, (math.nan, math.nan), None
    moments = _softmax_moments(logits, targets, logits_out)
    return loss, moments, None if options.loss_fn is not None else int(logits.shape[-1])


def _softmax_moments(logits: Tensor, targets: Tensor, logits_out: dict | None = None) -> tuple[float, float]:
    """(E[sum_c p_c^2], E[p_y]) over the positions of (B, T, V) logits and (B, T) targets; with
    ``logits_out``, the log-partition and largest-logit sums of :func:`batch_loss` written into it."""
    with torch.no_grad():
        flat = logits.detach().reshape(-1, logits.shape[-1])  # (B*T, V)
        y = targets.reshape(-1, 1).to(flat.device)
        rows = max(1, (1 << 22) // flat.shape[1])
        s2 = torch.zeros((), dtype=torch.float64, device=flat.device)
        py = torch.zeros((), dtype=torch.float64, device=flat.device)
        lz = torch.zeros(4, dtype=torch.float64, device=flat.device)  # sum, sum of squares, max |log Z|, max |z|
        for i in range(0, flat.shape[0], rows):
            z = flat[i:i + rows].float()
            p = torch.softmax(z, dim=-1)
            s2 += p.square().sum(dtype=torch.float64)
            py += p.gather(1, y[i:i + rows]).sum(dtype=torch.float64)
            if logits_out is not None:
                log_z = torch.logsumexp(z, dim=-1)  # (rows,)
                lz[0] += log_z.sum(dtype=torch.float64)
                lz[1] += log_z.double().square().sum()
                lz[2] = torch.maximum(lz[2], log_z.abs().max().double())
                lz[3] = torch.maximum(lz[3], z.abs().max().double())
        n = max(flat.shape[0], 1)
    if logits_out is not None:
        total, squares, logz_absmax, max_logit = lz.tolist()  # one read of the device
        logits_out.update(logz_sum=total, logz_squares=squares, logz_absmax=logz_absmax, max_logit=max_logit,
                          rows=flat.shape[0])
    return float(s2) / n, float(py) / n

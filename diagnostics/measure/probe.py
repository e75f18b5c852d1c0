"""``probe``: forward and gradient hooks that reduce each tensor at once, removed whatever happens.

    with probe(model) as run:
        loss = loss_fn(model(x), y)
        loss.backward()
    stats = run.stats

Which tensors: by default the points :func:`diagnostics.measure.sites.model_sites` chooses
(``Sites.points``, also :func:`instrument_points`): every module that holds parameters of its
own (for tinylm: each Linear, RMSNorm and the Embedding; the head's output is the logits),
every ``tinylm.Tap`` (``layers.i.resid_mid``, ``layers.i.attn.scores``, ``layers.i.attn.probs``,
``layers.i.ffn.hidden``) and, for a tinylm model, each block's output (the residual stream; the
embedding output is block 0's input) and the attention and FFN branches before they are added
(outputs of ``layers.i.attn`` and ``layers.i.ffn``), and the attention heads before
``output_proj`` (``layers.i.attn.heads``, that module's input). Any other model: each block of
its block stack (its output, the residual stream) and block 0's input (``{stack}.input``);
with ``attention`` and the default points (``modules`` None) or ``signals``, each
``F.scaled_dot_product_attention`` call and each eager softmax over 4-D logits inside a block's
attention child (a block without one: anywhere in the block) is measured on sampled query rows (:mod:`diagnostics.measure.sdpa`, :mod:`.eager_attention`) as
``{module}.scores`` and the ``{module}.probs`` panel.

The forward hook reduces the output under ``no_grad`` to float64 moments and, when
the output needs a gradient, puts a hook on that tensor which reduces the
gradient of the loss w.r.t. it the same way. A request for the moments alone (most) waits in
the run's queue (:mod:`.pending`), reduced with the others by one call at the forward's end,
the exit, past its bounds and before anything reads the stores; on the default CPU path so does
one with rows (a residual point's cosine and inverse row mean squares, a gate's count, a norm's
per-token factor, made at the forward's flush, and its gradient's weighted figure:
:mod:`.pending_rows`, one more call per flush): the same bits as one reduction
per hook (a tensor changed in place meanwhile: not measured, ``run.queue.stale``; that site
of the model is reduced in its hook by every later probe of it). Nothing
else is kept. On exit the hooks are removed and the model's ``training`` flags,
``requires_grad`` and (by default) ``.grad`` are put back as they were on entry; a gradient
hook left on a graph the caller still holds does nothing once the probe has exited.

A ``torch.compile``'d or ``DistributedDataParallel`` model is probed through the module inside
it (:func:`.wrappers.unwrap`; names without ``_orig_mod.`` or ``module.``), and while the probe
is on every compiled function and module runs eagerly (:func:`.wrappers.eager`): a compiled
graph would not run hooks added after it was built. ``stats`` moves everything measured to the
host in one transfer per device.
"""

from __future__ import annotations

import math
import time
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Iterator

import torch
from torch import Tensor, nn

import tinylm

from ..options import OptionsError, ProbeOptions
from .attention_observer import AttentionObserver, AttentionQueue, observed_attention
from .moments import AttnMoments, Moments, ParamStats, ProbeStats
from .pending import Pending
from .probe_queue import FLAT_EDGE, Queued
from .reducer import Reducer, Reduction, merge_attention_vectors, merge_vectors, reduce
from .reducer_choice import pinned
from .attention_watch import watch_attention as _watch_attention, watched_modules as _watched  # noqa: F401
from .hooks import Hooks, tensor_hook
from .sdpa_queue import SDPAQueue
from .model_state import ModelState
from .signals import PEAK_KINDS, Signals
from .sites import model_sites, model_walk
from .params import param_stats, spectral_stats  # noqa: F401  (public here as before)
from .wrappers import eager, unwrap

__all__ = ["probe", "ProbeRun", "instrument_points", "block_index", "param_stats", "FLAT_EDGE"]


_CAUSAL_KINDS = ("attn_scores", "attn_probs")


block_index = tinylm.plan.block_index  # i for a name ``layers.i`` or ``layers.i.*``, else None


def _is_tinylm(model: nn.Module) -> bool:
    return isinstance(model, tinylm.TransformerLM)


def instrument_points(model: nn.Module) -> dict[str, str]:
    """The default {module name: kind} a probe instruments, in module order (each tensor once per
    name): ``model_sites(model).points`` (:mod:`diagnostics.measure.sites`), as a new dict."""
    return dict(model_sites(model).points)


from .outputs import first_tensor as _first_tensor  # noqa: E402  (the one rule: diagnostics/measure/outputs.py)


def _causal(kind: str, t: Tensor) -> bool:
    """Whether ``t`` of this kind is measured over its causal entries: attention scores and
    probabilities of square (..., T, T) shape."""
    return kind in _CAUSAL_KINDS and t.dim() >= 2 and t.shape[-1] == t.shape[-2]


def _as_lists(*stores: dict) -> list[dict]:
    """Each store of vectors (float64 tensors) as {key: vector as a list of floats}, moved to the
    host in one transfer per device (one ``.tolist()`` of all the vectors concatenated), so the
    transfers of a probe's results do not grow with the number of tensors it measured."""
    flat = [(i, k, v) for i, store in enumerate(stores) for k, v in store.items()]
    out: list[dict] = [{} for _ in stores]
    if all(v.is_cpu for _, _, v in flat):  # one group, named without a device object per vector
        groups = [flat] if flat else []
    else:
        groups = [[(i, k, v) for i, k, v in flat if v.device == device]
                  for device in dict.fromkeys(v.device for _, _, v in flat)]
    f64 = torch.float64
    for part in groups:
        values = torch.cat([v if v.dtype == f64 and v.dim() == 1 else v.reshape(-1).double()
                            for _, _, v in part]).tolist()
        at = 0
        for i, k, v in part:
            n = v.numel()
            out[i][k] = values[at:at + n]
            at += n
    return [{k: out[i][k] for k in store} for i, store in enumerate(stores)]


_NULL = nullcontext()

#: per model, the sites (name, direction) whose tensor was changed in place while it waited in a
#: probe's queue (that pass: not measured): later probes of the model reduce them in their hook
_IN_PLACE: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()


def _quiet():
    """The context of the probe's own work in a hook: torch functions' overrides off where every
    mode on is one of the probe's own watchers (``probe_own``: they pass the probe's calls on
    untouched, and each attribute read of a tensor would be a trip through them), else none."""
    n = torch._C._len_torch_function_stack()
    if n and all(getattr(torch._C._get_function_stack_at(i), "probe_own", False) for i in range(n)):
        return torch._C.DisableTorchFunction()
    return _NULL


class _Reducer(Reducer):
    """The probe's :class:`Reducer` (the op's kernels put the compiled reductions in the default
    ``torch.compile`` stance themselves while the model runs eagerly, :mod:`.reduction`)."""


class ProbeRun(Queued):
    """The live state of one probe; ``stats`` converts the accumulated vectors once and caches."""

    def __init__(self, model: nn.Module, options: ProbeOptions, named: dict[str, nn.Module] | None = None):
        self.model, self.options = model, options
        self.active = False
        self.completed = False  # the probed body ran to its end (set by probe)
        # the stores hold float64 vectors (tensors on the measured tensors' device), merged as they come
        self._vec: dict[tuple[str, str], Tensor] = {}
        self._attn: dict[str, Tensor] = {}
        self._cos: dict[str, Tensor] = {}
        self._inv: dict[str, Tensor] = {}
        self._normb: dict[str, Tensor] = {}
        self._flat: dict[str, Tensor] = {}
        #: the stores the queue merges into, by its tags (None: the moments'), and each store's tag
        self._stores = {None: self._vec, "cos": self._cos, "inv": self._inv, "flat": self._flat, "normb": self._normb}
        self._tags = {id(v): k for k, v in self._stores.items()}
        self._tinylm = _is_tinylm(model)
        #: the SiLU gate inputs (``w1`` of each tinylm SwiGLU / SiLU MLP), counted in the flat region
        self._gates = {f"{n}.w1" for n, m in (named or dict(model.named_modules())).items()
                       if isinstance(m, tinylm.SwiGLU) or (isinstance(m, tinylm.MLP) and m.activation == "silu")}
        #: reduces the hooks' tensors; one that reaches two hooks back to back is read once
        self.reducer = _Reducer()
        #: the plain requests (moments only) waiting to be reduced together (:mod:`.pending`)
        self.queue = Pending()
        #: the tinylm attentions' entries, measured together (:mod:`.attention_observer`)
        self.attention_queue = AttentionQueue()
        #: the SDPA calls waiting to be measured together (:mod:`.sdpa_queue`; set by the attention watch)
        self.sdpa_queue: SDPAQueue | None = None
        self._in_place = _IN_PLACE.setdefault(model, set())  # this model's sites that may not wait
        self._forward_waits = False  # forward tensors queued: flushed at the first gradient
        self._hooked: tuple | None = None  # (weak ref, targets) of the last tensor given a gradient hook
        self.kinds: dict[str, str] = {}
        self.order: list[str] = []
        self.steps = 0
        self.params: dict[str, ParamStats] = {}
        #: wall seconds spent in the probe's own work: its hooks (reductions included) and the
        #: parameter statistics on exit (what the probe adds to the steps it watches)
        self.seconds = 0.0
        self._stats: ProbeStats | None = None
        #: the precursor signals (``options.signals``), else None
        self.signals = Signals() if options.signals else None

    # -- accumulation (called from hooks; no host sync) --
    def _row_ms(self, t: Tensor) -> Tensor:
        """mean(t^2) per row, from the reducer (usually the summary of ``t`` already read them:
        a block's output is the residual point and the next norm's input; backward, a norm
        output's gradient is reduced and then weighs the norm's per-token factor)."""
        return self.reducer(t, rows=True).row_ms

    def _wants_rows(self, kind: str, direction: str, t: Tensor) -> bool:
        """Whether the per-token mean squares of ``t`` are used next: forward, a tinylm residual
        point's (cosine and the norm that follows); backward, a norm output's gradient."""
        if direction == "forward":
            return self.options.cosine and self._tinylm and t.dim() >= 2 \
                and kind in ("residual", "resid_mid", "embedding")
        return kind == "norm" and self.options.backward and t.dim() >= 1

    def _add(self, store: dict, key, vec: Tensor, merge) -> None:
        tag = self._tags.get(id(store), 0)
        if tag != 0 and self.queue.waits(tag, key):  # earlier vectors of this key wait: merge in turn
            self.queue.ready(key, vec, tag)
            return
        store[key] = merge(store[key], vec) if key in store else vec
        self._stats = None

    def _plain(self, kind: str, t: Tensor, key) -> bool:
        """Whether the moments of ``t`` (nothing else asked) may wait in the queue: not attention's (its
        observer writes those places), nor those the signals read at once (the peak ratio's sites),
        nor a site of this model whose tensor was once changed in place while it waited (``key``
        in :data:`_IN_PLACE`: reduced in its hook from then on)."""
        return kind not in _CAUSAL_KINDS and not (self.signals is not None and kind in PEAK_KINDS) \
            and key not in self._in_place and self.queue.takes(t)

    def flush(self) -> None:
        """Reduce the queued tensors and merge them into the stores (before anything reads them)."""
        self._forward_waits = False
        if self.sdpa_queue is not None and len(self.sdpa_queue):
            self.sdpa_queue.flush()
        if len(self.attention_queue):
            self.attention_queue.flush()
        if len(self.queue):
            self.queue.flush(self._vec, self._stores)
            self._in_place.update(self.queue.stale_keys)
            self._stats = None

    def _forward(self, name: str, kind: str, out: Tensor) -> None:
        if name not in self.kinds:
            self.kinds[name] = kind
            self.order.append(name)
        if name == self.order[0]:
            self.steps += 1
        rows = self._wants_rows(kind, "forward", out)
        gate = name in self._gates
        if not (rows or gate) and self._plain(kind, out, (name, "forward")):  # moments only: reduced with the others later
            self._queue((name, "forward"), out)
            moments = None
        elif (rows or gate) and self.queue.takes_rows(out) and self._plain(kind, out, (name, "forward")):  # later
            self._queue_site(name, kind, out, rows, gate)
            moments = None
        else:
            moments = self._reduce_site(name, kind, out, rows, gate)
        if self.signals is not None:
            self.signals.forward(name, kind, out, moments)
        if self.options.backward and out.requires_grad:
            self._targets(out).append((name, kind, None))

    def _reduce_site(self, name: str, kind: str, out: Tensor, rows: bool, gate: bool) -> Tensor:
        """One reduction of a forward site: the moments (returned) and every figure this site adds
        (the inverse row mean squares of a residual point, the gate's flat-region count, a panel)."""
        cosine = rows and kind != "resid_mid" and out.dim() >= 3  # a block's input or output
        probs = kind == "attn_probs" and self.options.attention and out.dim() >= 2
        r = self.reducer(out, causal=_causal(kind, out), probs=probs, rows=rows, cosine=cosine,
                         inv_eps=float(self.model.config.eps) if rows else -1.0, below=FLAT_EDGE if gate else math.nan)
        self._add(self._vec, (name, "forward"), r.moments, merge_vectors)
        if probs:
            self._add(self._attn, name, r.panel, merge_attention_vectors)
        if gate:
            self._add(self._flat, name, r.below, torch.add)
        if cosine:
            self._add(self._cos, name, r.cosine, merge_vectors)
        if rows:
            self._add(self._inv, name, r.inv, merge_vectors)
        return r.moments

    def _norm(self, name: str, module: nn.Module, inputs, out: Tensor) -> None:
        """RMSNorm: keep each token's 1/(mean x^2 + eps) of its input (B*T floats, not the
        activation) until the output's gradient arrives, and reduce the per-token product."""
        if not (self.options.backward and out.requires_grad and inputs and isinstance(inputs[0], Tensor)):
            return
        x, eps = inputs[0], float(getattr(module, "eps", 0.0))
        if self.queue.takes_rows(x) and self._plain("norm_input", x, (name, "norm")):  # made at the flush
            over, inv = self.queue.add_rows(x, [("later", name, "later")], rows=True, eps=eps)
            self._queued(over, True)
        else:
            with torch.no_grad():
                inv = (self._row_ms(x) + eps).reciprocal_()
        self._targets(out).append((name, "norm", inv))

    def _targets(self, t: Tensor) -> list:
        """What the gradient of ``t`` is measured for: a list of (name, kind, inv) that the one
        hook on ``t`` works through when the gradient arrives (inv: a norm's per-token factor,
        else None). The hook is put on ``t`` when it is first seen; a tensor seen again right
        after (a branch is the output of its last projection; a norm's output also carries
        its backward factor) adds to its list, so each gradient makes one trip from autograd
        into Python. The last tensor is held by a weak reference: a live match is the same one."""
        last = self._hooked
        if last is not None and last[0]() is t:
            return last[1]
        targets: list = []
        tensor_hook(t, self._grad_hook(targets))
        self._hooked = (weakref.ref(t), targets)
        return targets

    def _grad_hook(self, targets: list):
        def hook(grad: Tensor) -> None:
            if not self.active:
                return None
            t0 = time.perf_counter()
            with _quiet():
                self._gradient(targets, grad)
            self.seconds += time.perf_counter() - t0
            return None
        return hook

    def _gradient(self, targets: list, grad: Tensor) -> None:
        """Measure ``grad`` for each of ``targets`` (:meth:`_targets`). The forward's queue is
        flushed first: its tensors, read now, are not held through the backward."""
        if self._forward_waits:
            self.flush()
        weights = {name: inv for name, kind, inv in targets if inv is not None}
        done = set()  # norms whose weighted figure came with their gradient's reduction
        for name, kind, inv in targets:
            if inv is not None:  # the norm's factor: weighed with its per-token mean squares below
                if name not in done and self._factor(inv) is not None:
                    self._add(self._normb, name, self.reducer(grad, rows=True, weight=self._factor(inv)).weighted,
                              merge_vectors)
                continue
            factor = weights.get(name) if kind == "norm" else None
            weight = self._factor(factor)  # None: no factor, or not measured
            rows = self._wants_rows(kind, "backward", grad)
            key = (name, "backward")
            if weight is None and not rows and self._plain(kind, grad, key):
                self._queue(key, grad)
                continue
            if rows and self.queue.takes_rows(grad) and self._plain(kind, grad, key):  # with its rows, later
                parts = [(None, key, "moments")] + ([("normb", name, "vector")] if weight is not None else [])
                self._queued(self.queue.add_rows(grad, parts, rows=True, weight=factor)[0], False)
                done.update([name] if weight is not None else [])
                continue
            r = self.reducer(grad, causal=_causal(kind, grad), rows=rows, weight=weight)
            self._add(self._vec, (name, "backward"), r.moments, merge_vectors)
            if r.weighted is not None and weight is not None:
                self._add(self._normb, name, r.weighted, merge_vectors)
                done.add(name)

    def vectors(self) -> tuple[dict[tuple[str, str], Tensor], dict[str, Tensor]]:
        """The merged vectors so far, as tensors on the measured tensors' device (no host transfer):
        ({(name, direction): :data:`FIELDS` vector}, {probs name: :data:`ATTN_FIELDS` vector})."""
        self.flush()
        return dict(self._vec), dict(self._attn)

    @property
    def stats(self) -> ProbeStats:
        """Everything measured so far, as Python floats (one device sync for all tensors)."""
        self.flush()
        if self._stats is None:
            vec, attn, cos, inv, nb, flat = _as_lists(self._vec, self._attn, self._cos, self._inv, self._normb,
                                                      self._flat)
            # positional: FIELDS and ATTN_FIELDS are the records' field order (tests/test_reduction_direct.py)
            self._stats = ProbeStats(tensors={k: Moments(*r) for k, r in vec.items()},
                                     kinds=dict(self.kinds), order=list(self.order),
                                     attention={k: AttnMoments(*r) for k, r in attn.items()},
                                     cosine={k: Moments(*r) for k, r in cos.items()},
                                     params=dict(self.params), steps=self.steps,
                                     inv_ms={k: Moments(*r) for k, r in inv.items()},
                                     norm_back={k: Moments(*r) for k, r in nb.items()}, flat=flat)
        return self._stats


def _stream_in(run: ProbeRun, name: str, kind: str):
    """A forward pre-hook that measures a block's input (positional, else ``hidden_states=``) as ``name``."""
    def pre(module, args, kwargs):
        t = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("hidden_states")
        if run.active and isinstance(t, Tensor) and t.is_floating_point():
            t0 = time.perf_counter()
            with _quiet():
                run._forward(name, kind, t)
            run.seconds += time.perf_counter() - t0
        return None
    return pre


def _points(model: nn.Module, options: ProbeOptions) -> tuple[dict[str, str], object, dict[str, nn.Module], list]:
    """(name -> kind of every point measured, the block stack or None, the named modules, the
    named parameters): the model's sites, or ``options.modules``, from one walk of the model
    (:func:`~diagnostics.measure.sites.model_walk`, kept while its structure stays the same)."""
    sites, named, params = model_walk(model)
    points = dict(sites.points)
    if options.modules is not None:
        missing = [m for m in options.modules if m not in named and m not in points]
        if missing:
            raise OptionsError(f"modules={missing!r}: no such module in the model; names look like "
                               f"{', '.join(list(points)[:3])}")
        points = {m: points.get(m, "module") for m in options.modules}
    return points, sites.blocks, named, params


def _forward_hook(run: ProbeRun, name: str, kind: str):
    """A forward hook that measures a module's output (its first tensor) as ``name``; an RMSNorm's
    input too (:meth:`ProbeRun._norm`)."""
    def fwd(module, inputs, output):
        if not run.active:
            return None
        t0 = time.perf_counter()
        t = _first_tensor(output)
        with _quiet():
            if t is not None and t.is_floating_point():
                run._forward(name, kind, t)
                if isinstance(module, tinylm.RMSNorm):
                    run._norm(name, module, inputs, t)
        run.seconds += time.perf_counter() - t0
        return None
    return fwd


def _heads_hook(run: ProbeRun, name: str, kind: str):
    """A forward pre-hook on an attention's ``output_proj`` that measures its input (the heads) as ``name``."""
    def pre(module, inputs):
        if run.active and inputs and isinstance(inputs[0], Tensor):
            t0 = time.perf_counter()
            with _quiet():
                run._forward(name, kind, inputs[0])
            run.seconds += time.perf_counter() - t0
        return None
    return pre


def _hook_points(run: ProbeRun, points: dict[str, str], stack, named: dict[str, nn.Module],
                 observed: dict[str, frozenset[str]], owner: ExitStack) -> list[AttentionObserver]:
    """Attach the measurement to every point, each hook owned by ``owner`` (removed when it
    unwinds). tinylm attention keeps its path under a probe (the fused kernel unless something
    else needs the weights): its scores and weights are measured by an observer, never by hooks
    on its Taps. Returns the observers."""
    observers, handles, hooks = [], [], Hooks()
    owner.callback(_remove_all, handles)  # every handle below, each removed whatever the others do
    owner.callback(hooks.remove)
    for attn, want in observed.items():
        observers.append(AttentionObserver(run, attn, want))
        owner.callback(named[attn].register_observer(observers[-1]).remove)
    start = stack.input if stack is not None else None
    for name, kind in points.items():
        parent, _, leaf = name.rpartition(".")
        if leaf in observed.get(parent, ()):
            continue  # measured by the attention's observer
        if name == start:  # not a module: block 0's input
            handles.append(named[stack.names[0]].register_forward_pre_hook(_stream_in(run, name, kind),
                                                                           with_kwargs=True))
        elif kind == "attn_heads":  # not a module: the input of the attention's output_proj
            hooks.pre(named[parent + ".output_proj"], _heads_hook(run, name, kind))
        else:
            hooks.forward(named[name], _forward_hook(run, name, kind))
    return observers


def _remove_all(handles: list) -> None:
    """Remove every hook handle, last first; the first error raised once all are removed."""
    error = None
    for handle in reversed(handles):
        try:
            handle.remove()
        except BaseException as err:  # noqa: BLE001 - the others are removed all the same
            error = error or err
    if error is not None:
        raise error


def _finish(run: ProbeRun, observers: list[AttentionObserver]) -> None:
    """The pass is over: hooks go quiet, the queues are reduced (their errors never mask the body's),
    and forwards whose gradient never came are measured now (only when the body completed)."""
    run.active = False
    for observer in observers if run.completed else ():
        observer.flush()  # a forward whose gradient never came: queued alone
    if len(run.queue) or len(run.attention_queue) or (run.sdpa_queue is not None and len(run.sdpa_queue)):
        t0 = time.perf_counter()
        try:
            run.flush()
        except Exception:  # noqa: BLE001 - the body raised: keep its error, not the flush's
            if run.completed:
                raise
            run.queue, run.attention_queue = Pending(), AttentionQueue()
            if run.sdpa_queue is not None:
                run.sdpa_queue.clear()
        run.seconds += time.perf_counter() - t0


def _measure_params(run: ProbeRun, state: ModelState) -> None:
    """Parameter and gradient statistics (``options.params``) of a pass that completed."""
    if not (run.completed and run.options.params):
        return None
    t0 = time.perf_counter()
    named = state.now()
    grads = state.grad_deltas(dict(named))
    run.params = param_stats(state.model, spectral=run.options.spectral, grads=grads, named=named)
    run._stats = None
    run.seconds += time.perf_counter() - t0
    return None


@contextmanager
def probe(model: nn.Module, options: ProbeOptions | None = None) -> Iterator[ProbeRun]:
    """Instrument ``model`` for the duration of the ``with`` block; yields a :class:`ProbeRun`.

    Per instrumented tensor and direction the run accumulates count, mean, M2 (variance),
    max |x|, exact zeros, non-finite entries and fp16/bf16 under/overflow counts; see
    :mod:`diagnostics.measure.moments`. Raises OptionsError for a name in ``options.modules`` that
    the model does not have. One :class:`~contextlib.ExitStack` owns every hook, the attention
    watchers and the eager stance, so whatever happens in the body (or in the probe's own set-up)
    they are removed and the model is left exactly as it was (``restore_grads``: its gradients too).
    A compiled or data-parallel model is measured through the module inside, by its own names.
    """
    if not isinstance(model, nn.Module):
        raise OptionsError(f"model={type(model).__name__}: probe needs a torch.nn.Module")
    model = unwrap(model)
    options = options or ProbeOptions()
    points, stack, named, params = _points(model, options)
    run = ProbeRun(model, options, named)
    state = ModelState(model, named, params)
    with ExitStack() as owner:  # unwinds last-in first-out: the restore below runs last
        owner.callback(state.restore, options.restore_grads)
        owner.callback(_measure_params, run, state)
        owner.enter_context(eager())  # compiled graphs do not run the hooks: the model runs eagerly while probed
        owner.enter_context(pinned())  # TINYLM_REDUCER read once per probe, not once per tensor
        observers = _hook_points(run, points, stack, named, observed_attention(model, points, named), owner)
        if options.eval_mode:
            state.eval()
        if options.attention and (options.modules is None or options.signals) and stack and not run._tinylm:
            _watch_attention(run, stack, named, owner)
        if run.signals is not None:
            run.signals.attach(run, model, points, owner)
        owner.callback(_finish, run, observers)
        run.active = True
        yield run
        run.completed = True

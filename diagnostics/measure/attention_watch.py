"""The probe's attention watch: SDPA calls and eager softmax inside a model's attention modules.

:func:`watch_attention` puts an :class:`~.eager_attention.EagerAttentionWatch` (a
``TorchFunctionMode``) on while one of the :func:`watched_modules` runs. A mode sees every
torch call made meanwhile (912 a pass of the launch-bound GPT-2: views, shapes, the
projections), each a trip into Python, so a model whose attention is caught another way runs
without it:

* **Caught by name.** While a probe watches, ``torch.nn.functional.scaled_dot_product_attention``
  is a wrapper (:func:`_caught`: installed once however many probes are on, the function it
  replaced put back when the last one exits) that hands the calls of the probing thread, made
  while a watched module runs, to the watch's :meth:`~.sdpa.SDPAWatch.measure_sdpa` and then
  makes the call. Code that looks the function up by its name when it calls it (Hugging Face's
  ``sdpa_attention_forward``, nanoGPT, ``F.multi_head_attention_forward``) is caught this way;
  code that holds the function itself (``from torch.nn.functional import
  scaled_dot_product_attention`` at import) or that computes a softmax is not.
* **Learned per model.** A model's first probed pass runs both: the mode measures what the
  name did not catch (``missed``). When every run of a watched module made at least one call
  and the name caught them all, later probes of that model leave the mode off; when the mode
  measured any call, they keep it. A later pass in which a watched module's run is caught
  making no call (the model changed its attention, e.g. to an eager implementation) sends the
  model back to learning: that run's attention is not measured (never reported as measured),
  and the next probe runs both again.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack

import torch.nn.functional as F
from torch import Tensor, nn

import tinylm

from .eager_attention import EagerAttentionWatch
from .hooks import Hooks
from .sdpa_queue import SDPAQueue
from .reducer import merge_attention_vectors, merge_vectors

__all__ = ["watch_attention", "watched_modules"]

#: per model: True (its attention caught by name: no mode), False (the mode needed), absent (learn)
_BY_NAME: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()

_local = threading.local()  # .watch: the watch whose watched module runs on this thread, if any
_installed = {"count": 0, "prior": None}
_lock = threading.Lock()


def _caught(*args, **kwargs):
    """``torch.nn.functional.scaled_dot_product_attention`` while a probe watches (module docstring)."""
    watch, prior = getattr(_local, "watch", None), _installed["prior"]
    if watch is None:
        return prior(*args, **kwargs)
    if watch.measure_sdpa(args, kwargs):
        watch.by_name += 1
    watch.caught += 1
    try:
        return prior(*args, **kwargs)
    finally:
        watch.caught -= 1


def _install() -> None:
    with _lock:
        if _installed["count"] == 0:
            _installed["prior"] = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _caught
        _installed["count"] += 1


def _uninstall() -> None:
    with _lock:
        _installed["count"] -= 1
        if _installed["count"] == 0:
            if F.scaled_dot_product_attention is _caught:  # else someone replaced it since: theirs stays
                F.scaled_dot_product_attention = _installed["prior"]
            _installed["prior"] = None


def watched_modules(stack, named: dict[str, nn.Module]) -> list[str]:
    """The modules during whose run the attention watch is on: in each block its attention
    children (a class name ending in ``Attention``, as :mod:`.sites` finds attention), else the
    block and its children (the innermost running one names a call)."""
    out: list[str] = []
    for block in stack.names:
        children = [f"{block}.{c}" for c, _ in named[block].named_children()]
        attention = [n for n in children if type(named[n]).__name__.endswith("Attention")]
        out += attention or [block, *children]
    return out


def watch_attention(run, stack, named: dict[str, nn.Module], owner: ExitStack) -> None:
    """The watch of ``run`` (a :class:`~.probe.ProbeRun`), on only while one of the
    :func:`watched_modules` runs (entered by the outermost one's pre-hook, left by its
    always-called hook; hooks owned by ``owner``, which also leaves the watch if a run never
    returned), so the rest of the pass pays no interception; the mode itself only where the
    model's calls are not caught by name (module docstring). Its calls, named by the innermost
    running watched module (not a tinylm attention: its own observer measures it), add
    ``{name}.scores`` moments and ``{name}.probs``; its time is the probe's (``run.seconds``). The
    SDPA calls wait in ``run.sdpa_queue`` (:mod:`.sdpa_queue`), flushed with the probe's queue."""
    running: list[str] = []
    model = run.model

    def record(name: str, moments: Tensor, panel: Tensor) -> None:  # timed by the watch (its seconds)
        key = f"{name}.scores"
        if key not in run.kinds:
            run.kinds[key] = "attn_scores"
            run.order.append(key)
        run._add(run._vec, (key, "forward"), moments, merge_vectors)
        run._add(run._attn, f"{name}.probs", panel, merge_attention_vectors)

    own = {n for n, m in named.items() if isinstance(m, tinylm.MultiHeadSelfAttention) and run.signals is not None}

    def where() -> str | None:
        return running[-1] if running and run.active and running[-1] not in own else None

    watch = EagerAttentionWatch(record, where, run.signals.attention if run.signals is not None else None)
    watch.queue = run.sdpa_queue = SDPAQueue(watch.report, run.signals is not None, run.forward_waits)
    decided = _BY_NAME.get(model)
    use_mode, use_name = decided is not True, decided is not False
    watch.by_name, state = 0, {"on": False, "prior": None, "runs": 0, "empty": 0, "start": 0}

    def push(module, args, _name):
        if not running and run.active:
            if use_mode:
                watch.__enter__()
            if use_name:
                state["prior"], _local.watch = getattr(_local, "watch", None), watch
            state["on"], state["start"] = True, watch.by_name + watch.missed
        running.append(_name)

    def off() -> None:
        state["on"] = False
        if use_mode:
            watch.__exit__(None, None, None)
        if use_name:
            _local.watch, state["prior"] = state["prior"], None
        run.seconds, watch.seconds = run.seconds + watch.seconds, 0.0  # its measurement is the probe's work

    def pop(module, args, output, _name):
        if running and running[-1] == _name:
            running.pop()
        if state["on"] and not running:
            state["runs"] += 1
            state["empty"] += watch.by_name + watch.missed == state["start"]
            off()

    def leave() -> None:  # a run that raised before its hooks: the watch is left all the same
        running.clear()
        if state["on"]:
            off()
        run.seconds, watch.seconds = run.seconds + watch.seconds, 0.0
        if run.completed and state["runs"]:
            _learn(model, decided, watch, state)

    hooks = Hooks()
    owner.callback(hooks.remove)
    if use_name:
        _install()
        owner.callback(_uninstall)
    owner.callback(leave)
    for name in watched_modules(stack, named):
        hooks.pre(named[name], lambda m, a, _name=name: push(m, a, _name))
        hooks.forward(named[name], lambda m, a, o, _name=name: pop(m, a, o, _name), always_call=True)


def _learn(model: nn.Module, decided, watch, state: dict) -> None:
    """What the next probe of ``model`` uses (module docstring), from a completed probe's runs."""
    if decided is True:
        if state["empty"]:  # a run made no call that the name caught: learn again
            _BY_NAME.pop(model, None)
    elif decided is None:
        if watch.missed:
            _BY_NAME[model] = False
        elif watch.by_name and not state["empty"]:
            _BY_NAME[model] = True


"""Saving and loading models: the tinylm format, bare and training state dicts, nanoGPT, safetensors.

Loading never executes code from the file: torch pickles are read with
``torch.load(weights_only=True)`` and safetensors by its own parser. The file
is opened read-only and never written. Every way a file can be wrong ends in a
:class:`~tinylm.errors.CheckpointError` whose message names the problem and the fix.
"""

from __future__ import annotations

import io
import json
import os
import pickletools
import re
import stat
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .config import ModelConfig
from .errors import CheckpointError, ConfigError, MissingOptionError, UnsafeCheckpointError
from .memory import MemoryLimitError, check_model_fits
from .model import TransformerLM
from .validate import file_error, refuse

__all__ = ["save", "load", "read_state", "infer_config", "CheckpointInfo", "MissingOptionsError", "atomic_write"]

FORMAT, VERSION = "tinylm", 1
PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DistributedDataParallel wrappers
SAFE_GLOBAL_MODULES = ("torch", "collections", "builtins", "__builtin__", "numpy.core.multiarray", "_codecs")

#: the settings a config-less file cannot show, each with the placeholder of its value (N an integer, X a real)
UNSEEN = {"num_heads": "N", "rope_theta": "X", "context_length": "N"}


class MissingOptionsError(MissingOptionError):
    """Settings the weights cannot show and the file does not store (every one at once).

    ``missing`` lists the config fields, ``known`` what the shapes determined (vocab_size,
    d_model, ...), ``given`` the overrides that were passed; the message names every
    keyword argument of :func:`load` that is missing.
    """

    def __init__(self, missing: list[str], known: dict[str, Any], given: dict[str, Any]) -> None:
        self.missing, self.known, self.given = list(missing), dict(known), dict(given)
        self.field = self.argument = missing[0]
        names = ", ".join(missing)
        CheckpointError.__init__(self, f"the checkpoint stores no config, so {names} {'is' if len(missing) == 1 else 'are'} "
                                       f"unknown; pass {', '.join(f'{m}={UNSEEN[m]}' for m in missing)}")


@dataclass
class CheckpointInfo:
    """What ``load`` learned about a file besides the weights."""

    path: str
    format: str  # "tinylm", "safetensors", "training", "nanogpt", "state_dict" or "module-pickle"
    config_source: str  # "stored" or "inferred"
    version: int | None = None
    iteration: int | None = None
    has_optimizer: bool = False
    history: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    nonfinite: list[str] = field(default_factory=list)  # parameters holding NaN or inf


# --------------------------------------------------------------------------- writing


def _umask() -> int:
    """The process's file-mode creation mask, read without changing it where the OS tells it
    (Linux: /proc/self/status), else by setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call ``write(tmp_path)`` and rename the result onto ``path``: never a half-written file.

    The file gets the mode a plain ``open(path, "w")`` gives it: an existing file's own mode,
    else 0o666 less the user's umask (the private temporary file's 0o600 is not kept).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(path: str | os.PathLike, model: TransformerLM, **extra: Any) -> None:
    """Write ``model`` (with its config and any ``extra`` entries) to ``path`` atomically.

    ``.pt`` (any suffix but ``.safetensors``): a torch.save'd dict
    ``{"format": "tinylm", "version": 1, "config": {...}, "model": state_dict, **extra}``.
    ``.safetensors``: the tensors, with format, version, config and JSON-able extras in
    the metadata (a tied lm_head.weight is stored once, as token_embeddings.weight).
    """
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        refuse("save() needs a model with a tinylm ModelConfig in .config (a TransformerLM)", error=ConfigError,
               argument="model")
    reserved = {"format", "version", "config", "model"} & set(extra)
    if reserved:
        refuse(f"extra key(s) {sorted(reserved)} are reserved by the tinylm format", error=ConfigError)
    state = model.state_dict()
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        if config.tie_embeddings:
            state.pop("lm_head.weight", None)
        tensors = {k: v.detach().contiguous() for k, v in state.items()}
        try:
            meta = {"format": FORMAT, "version": str(VERSION), "config": json.dumps(config.to_dict())}
            meta.update({k: json.dumps(v) for k, v in extra.items()})
        except TypeError as e:
            refuse(f"safetensors metadata must be JSON: {e}", "save extras such as optimizer state as .pt",
                   error=ConfigError)
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
    else:
        obj = {"format": FORMAT, "version": VERSION, "config": config.to_dict(), "model": state, **extra}
        atomic_write(path, lambda tmp: torch.save(obj, tmp))


# --------------------------------------------------------------------------- reading


#: the problem and the fix of a file this process may not read
_UNREADABLE, _CHMOD = "not readable (permission denied)", "fix its permissions (chmod u+r)"


def _check_file(path: Path) -> bytes:
    """Refuse what is not a readable, non-empty file; return its first 16 bytes (format sniffing)."""
    if not path.exists():
        file_error(path, "no such file", "check the path", error=CheckpointError)
    if path.is_dir() and (path / "config.json").is_file():
        file_error(path, "is a Hugging Face save_pretrained directory (config.json and its weights), not a "
                   "checkpoint file", f"load it with tinylm.hf.load({str(path)!r}) (on the command line "
                   "`diagnose DIR` reads the directory itself)", error=CheckpointError)
    if path.is_dir():
        file_error(path, "is a directory", "pass the checkpoint file inside it", error=CheckpointError)
    if not path.is_file():
        file_error(path, "not a regular file", "pass a checkpoint file", error=CheckpointError)
    if not os.access(path, os.R_OK):
        file_error(path, _UNREADABLE, _CHMOD, error=CheckpointError)
    if path.stat().st_size == 0:
        file_error(path, "empty file (0 bytes); the save was probably interrupted", "use another checkpoint",
                   error=CheckpointError)
    try:
        with open(path, "rb") as f:
            return f.read(16)
    except PermissionError:
        file_error(path, _UNREADABLE, _CHMOD, error=CheckpointError)
    except OSError as e:
        file_error(path, f"cannot be read ({e.strerror or e})", "check the file and its disk", error=CheckpointError)



def _pickle_globals(data: bytes, pickles: int = 5) -> list[str]:
    """Names of the globals a pickle would import, read by opcode (nothing is executed).

    Reads up to ``pickles`` pickles one after another: torch's legacy (non-zip) format
    writes a magic number, the protocol and system information before the object.
    """
    names, strings = [], []
    stream = io.BytesIO(data)
    try:
        for _ in range(pickles):
            start = stream.tell()
            for op, arg, _ in pickletools.genops(stream):
                if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING", "BINSTRING"):
                    strings.append(arg)
                elif op.name == "GLOBAL":
                    names.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    names.append(f"{strings[-2]}.{strings[-1]}")
            if stream.tell() == start:
                break
    except Exception:  # a damaged stream or raw tensor bytes after the pickles: keep what was found
        pass
    return names


def _unsafe_globals(path: Path) -> list[str]:
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                pkl = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
                data = zf.read(pkl) if pkl else b""
        else:
            data = path.read_bytes()
    except Exception:
        return []
    bad = [n for n in _pickle_globals(data) if not n.startswith(SAFE_GLOBAL_MODULES)]
    return list(dict.fromkeys(bad))  # unique, in order of appearance


def _torch_load(path: Path, unsafe: bool) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with open(path, "rb") as f:
                return torch.load(f, map_location="cpu", weights_only=not unsafe)
    except CheckpointError:
        raise
    except PermissionError:
        file_error(path, _UNREADABLE, _CHMOD, error=CheckpointError)
    except Exception as e:  # torch raises many types for a damaged file; classify them for the user
        if unsafe and isinstance(e, (ModuleNotFoundError, AttributeError)):
            raise CheckpointError(_missing_class(path, e)) from e  # the cause stays chained for --debug
        if not unsafe:
            bad = _unsafe_globals(path)
            if bad:
                file_error(path, f"holds pickled Python objects ({', '.join(bad[:3])}), e.g. a whole torch.save(model), "
                           "which a safe load will not execute",
                           "if you made the file or trust it, rerun with unsafe=True (risk: it runs the code "
                           "the file names, with your permissions), or convert it once to a state dict: "
                           "torch.save(torch.load(p, weights_only=False).state_dict(), 'state.pt')",
                           error=UnsafeCheckpointError)
        msg = str(e).lower()
        if _is_npz(path):
            file_error(path, "is a NumPy .npz archive, not a checkpoint (a saved fingerprint "
                       "is one)", "compare a fingerprint with tinylm diff; pass a file written by torch.save or "
                       "safetensors", error=CheckpointError)
        if isinstance(e, EOFError) or _is_broken_zip(path) or "central directory" in msg or "truncat" in msg:
            why = "truncated or damaged (the save was probably interrupted or the copy is incomplete)"
        elif _looks_like_text(path):
            why = "a text file, not a checkpoint"
        else:
            why = "not a PyTorch checkpoint (unreadable or corrupt data)"
        file_error(path, why, "pass a file written by torch.save or safetensors", error=CheckpointError)


def _missing_class(path: Path, e: Exception) -> str:
    """The message for a whole pickled model whose class cannot be imported here: the class the
    pickle names (read by opcode), the module it needs, and the two routes that work."""
    classes = _unsafe_globals(path)
    if isinstance(e, ModuleNotFoundError) and e.name:
        module, attr = e.name, None
        named = [c for c in classes if c.startswith(module + ".")] or classes
    else:  # AttributeError: "Can't get attribute 'GPT' on <module ...>"
        found = re.search(r"attribute '([^']+)'", str(e))
        attr = found.group(1) if found else None
        named = [c for c in classes if attr is not None and c.rsplit(".", 1)[-1] == attr] or classes
        module = named[0].rsplit(".", 1)[0] if named and "." in named[0] else None
    what = f"class {named[0]}" if named else "a Python class"
    top = (module or "").split(".")[0]
    if module is None:
        need, fix = f"its class cannot be imported ({str(e).splitlines()[0][:120]})", "run where its code imports"
    elif module == "__main__":
        need, fix = "it was saved from a script (module '__main__'), whose classes are not importable", \
            "load it in that script"
    elif attr is not None:
        need, fix = f"module '{module}' has no class {attr}", "run with the version of its code that saved it"
    else:
        need = f"module '{module}' is not importable"
        fix = f"run from the folder that has {top}.py" if top == module else f"run from the folder that has {top}/"
    return (f"{path}: the checkpoint pickles {what}: {need}; {fix}, or use the Python API: build the model "
            "yourself and call diagnostics.diagnose(model) (diagnostics/API.md)")


def _is_npz(path: Path) -> bool:
    """A zip archive of .npy arrays only (``np.savez``), which torch.save never writes."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
        return bool(names) and all(n.endswith(".npy") for n in names)
    except (OSError, zipfile.BadZipFile):
        return False


def _is_broken_zip(path: Path) -> bool:
    """Starts like a zip archive (torch's format) but has no readable end: cut short."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        return head == b"PK\x03\x04" and not zipfile.is_zipfile(path)
    except OSError:
        return False


def _looks_like_text(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(512)
        head.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return b"\x00" not in head


def _is_safetensors(head: bytes, size: int) -> bool:
    """safetensors: 8-byte little-endian header length, then a JSON object."""
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 0 < n <= size - 8


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        tensors = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
        return tensors, meta
    except Exception as e:
        file_error(path, f"corrupt safetensors file ({str(e).splitlines()[0][:120]})", "re-export it",
                   error=CheckpointError)


#: bounds on one JSON value in a file's metadata: a few kilobytes of metadata must never cost more.
JSON_MAX_BYTES, JSON_MAX_DEPTH = 1 << 20, 64


def _bounded_json(text: str, what: str, path: Path) -> Any:
    """``json.loads(text)`` once its size and nesting depth are within bounds; else a CheckpointError."""
    if len(text) > JSON_MAX_BYTES:
        file_error(path, f"its {what} metadata is {len(text):,} characters (at most {JSON_MAX_BYTES:,} are read)",
                   "re-export the file without it", error=CheckpointError)
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:  # nesting outside strings, without recursion
        if in_string:
            escaped, in_string = (False, in_string) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > JSON_MAX_DEPTH:
        file_error(path, f"its {what} metadata nests {deepest} levels deep (at most {JSON_MAX_DEPTH})",
                   "re-export the file without it", error=CheckpointError)
    return json.loads(text)


def _strip_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in state.items():
        while k.startswith(PREFIXES):  # in any order: DDP around a compiled model writes "module._orig_mod."
            k = k[len(next(p for p in PREFIXES if k.startswith(p))):]
        out[k] = v
    return out


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and len(obj) > 0 and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _iteration(value: Any) -> int | None:
    """A stored iteration count as a non-negative int; anything else (a string, a float, a
    negative number, a tensor) is not a count and reads as unknown (None)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return int(value)


# --------------------------------------------------------------------------- nanoGPT

#: the entries of nanoGPT's ``model_args`` that fix the sizes (``bias`` and ``dropout`` are optional)
NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
#: nanoGPT name -> tinylm name, per block; c_attn ([3d, d], rows q|k|v) is split apart
_NANOGPT_BLOCK = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_proj": "attn.output_proj", "mlp.c_fc": "ffn.w1",
                  "mlp.c_proj": "ffn.w2"}
_NANOGPT_TOP = {"transformer.wte.weight": "token_embeddings.weight",
                "transformer.wpe.weight": "position_embeddings.weight",
                "transformer.ln_f.weight": "ln_final.weight", "transformer.ln_f.bias": "ln_final.bias",
                "lm_head.weight": "lm_head.weight"}
_NANOGPT_KEY = re.compile(r"transformer\.h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
                          r"\.(weight|bias)")
_NANOGPT_MASK = re.compile(r"transformer\.h\.\d+\.attn\.(masked_)?bias")  # the causal-mask buffer, not a weight


def is_nanogpt_state(state: dict[str, Any]) -> bool:
    """A state dict in nanoGPT's ``GPT`` layout (``transformer.wte.weight``, ``transformer.h.N.*``)."""
    return "transformer.wte.weight" in state and any(k.startswith("transformer.h.") for k in state)


def from_nanogpt_state(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """nanoGPT's keys as tinylm's. Its layers are ``nn.Linear`` (weight [out, in], as tinylm's:
    no transpose); ``attn.c_attn`` stacks q, k and v along its rows, W = [W_q; W_k; W_v] (3d, d),
    and is split into ``attn.{q,k,v}_proj``. The causal-mask buffer (``attn.bias``) is dropped.
    A key that is none of these is refused, naming it."""
    out, unknown = {}, []
    for key, value in state.items():
        if key in _NANOGPT_TOP:
            out[_NANOGPT_TOP[key]] = value
        elif (m := _NANOGPT_KEY.fullmatch(key)) is not None:
            i, name, kind = m.groups()
            if name == "attn.c_attn":
                if value.dim() == 0 or value.shape[0] % 3:
                    file_error(path, f"{key} has shape {tuple(value.shape)}: its rows are not q, k and v of equal size",
                               "the file is damaged", error=CheckpointError)
                for proj, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):  # 3 x (d, d) or (d,)
                    out[f"layers.{i}.attn.{proj}.{kind}"] = part
            else:
                out[f"layers.{i}.{_NANOGPT_BLOCK[name]}.{kind}"] = value
        elif not _NANOGPT_MASK.fullmatch(key):
            unknown.append(key)
    if unknown:
        file_error(path, f"a nanoGPT state dict with keys nanoGPT's GPT does not have ({', '.join(unknown[:3])}"
                   f"{' ...' if len(unknown) > 3 else ''})",
                   "load the model in Python and call diagnostics.diagnose(model)", error=CheckpointError)
    return out


def nanogpt_config(model_args: dict[str, Any], state: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """The tinylm config of nanoGPT's ``model_args`` (n_layer, n_head, n_embd, block_size, bias,
    vocab_size, dropout): pre-norm LayerNorm (eps 1e-5, with a bias when ``bias``), exact GELU
    MLP of 4 n_embd, learned positions, biases on every Linear when ``bias`` (absent: True, as
    before nanoGPT had the flag), lm_head tied to the token embeddings."""
    missing = [k for k in NANOGPT_ARGS if k not in model_args]
    if missing:
        file_error(path, f"a nanoGPT checkpoint whose model_args lack {', '.join(missing)}",
                   "the file is damaged or was written by another tool", error=CheckpointError)
    d = model_args["n_embd"]
    emb, head = state.get("token_embeddings.weight"), state.get("lm_head.weight")
    tied = head is None or (emb is not None and head.shape == emb.shape and head.layout == emb.layout == torch.strided
                            and (head.data_ptr() == emb.data_ptr() or torch.equal(head, emb)))
    return dict(vocab_size=model_args["vocab_size"], context_length=model_args["block_size"], d_model=d,
                num_layers=model_args["n_layer"], num_heads=model_args["n_head"],
                d_ff=4 * d if isinstance(d, int) and not isinstance(d, bool) else d, eps=1e-5, norm="pre",
                norm_kind="layer", ffn="gelu", positions="learned", bias=model_args.get("bias", True),
                tie_embeddings=bool(tied), dropout=model_args.get("dropout", 0.0), init="gpt2")


def _read_nanogpt(obj: dict[str, Any], path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], CheckpointInfo]:
    """nanoGPT's train.py checkpoint: {"model", "optimizer", "model_args", "iter_num", "best_val_loss", "config"}."""
    state = from_nanogpt_state(_strip_prefixes(obj["model"]), path)
    config = nanogpt_config(obj["model_args"], state, path)
    info = CheckpointInfo(str(path), "nanogpt", "stored", iteration=_iteration(obj.get("iter_num")),
                          has_optimizer="optimizer" in obj)
    best = obj.get("best_val_loss")
    if isinstance(best, torch.Tensor) and best.numel() == 1:
        best = float(best)
    if isinstance(best, (int, float)) and not isinstance(best, bool):
        info.extra["best_val_loss"] = float(best)
    if isinstance(obj.get("config"), dict):
        info.extra["train_config"] = obj["config"]  # train.py's globals: out_dir, dataset, learning_rate, ...
    return state, config, info


# --------------------------------------------------------------------------- formats we do not read


#: what to do with a model in a format no loader here reads
PYTHON_ROUTE = ("build the model in Python and call diagnostics.diagnose(model, options=DiagnoseOptions(inputs=...)) "
                "(diagnostics/API.md)")
#: the formats load() reads, named in the message for one it does not
READ_FORMATS = "tinylm, CS336 and nanoGPT checkpoints, their bare state dicts, safetensors and Hugging Face directories"


def _sample(keys: Any, n: int = 4) -> str:
    keys = [str(k) for k in keys]
    return ", ".join(keys[:n]) + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


def foreign_message(state: dict[str, Any] | None, top: dict[str, Any] | None = None) -> str:
    """What a file holds that is not a model tinylm rebuilds, and the route that works: its
    top-level keys (when the file is a dict around the weights) and a sample of its state-dict keys."""
    parts = []
    if top is not None:
        parts.append(f"top-level keys: {_sample(top, 8)}")
    if state:
        parts.append(f"state-dict keys such as {_sample(state)}, without the 2-D token_embeddings.weight and "
                     "layers.N.* of a tinylm/CS336 model")
    found = f" ({'; '.join(parts)})" if parts else ""
    return f"not a model tinylm can rebuild{found}: tinylm reads {READ_FORMATS}; for another model, {PYTHON_ROUTE}"


def _nested_state(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The first value of a dict that is a state dict (e.g. a training framework's ``state_dict`` entry)."""
    return next((v for v in obj.values() if _is_state_dict(v)), None)


def read_state(path: str | os.PathLike, unsafe: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, CheckpointInfo]:
    """Read a file into (state_dict, stored config dict or None, info); no model is built."""
    path = Path(path)
    head = _check_file(path)
    torch_file = head[:4] == b"PK\x03\x04" or head[:1] == b"\x80"  # torch.save's zip, or its legacy pickle
    if _is_safetensors(head, path.stat().st_size) or (path.suffix == ".safetensors" and not torch_file):
        state, meta = _read_safetensors(path)
        config = None
        info = CheckpointInfo(str(path), "safetensors", "inferred")
        if "config" in meta:
            try:
                config = _bounded_json(meta["config"], "config", path)
            except json.JSONDecodeError:
                file_error(path, "the config in its safetensors metadata is not valid JSON", "re-export it",
                           error=CheckpointError)
            info.config_source = "stored"
        for k, v in meta.items():
            if k not in ("format", "version", "config"):
                try:
                    info.extra[k] = _bounded_json(v, repr(k), path)
                except json.JSONDecodeError:
                    info.extra[k] = v
        info.iteration = _iteration(info.extra.pop("iteration", None))
        info.history = info.extra.pop("history", None)
        return _strip_prefixes(state), config, info

    obj = _torch_load(path, unsafe)
    if isinstance(obj, nn.Module):  # only reachable with unsafe=True
        warnings.warn(f"{path}: loaded a whole pickled module (unsafe=True); its code ran on load")
        cfg = getattr(obj, "config", None)
        info = CheckpointInfo(str(path), "module-pickle", "stored" if isinstance(cfg, ModelConfig) else "inferred")
        return _strip_prefixes(obj.state_dict()), cfg.to_dict() if isinstance(cfg, ModelConfig) else None, info
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        state = obj.get("model")
        if not _is_state_dict(state):
            file_error(path, "a tinylm checkpoint whose 'model' entry is not a state dict; the file is damaged",
                       error=CheckpointError)
        info = CheckpointInfo(str(path), "tinylm", "stored", version=obj.get("version"))
        info.iteration = _iteration(obj.get("iteration"))
        info.has_optimizer = "optimizer" in obj
        info.history = obj.get("history")
        info.extra = {k: v for k, v in obj.items() if k not in ("format", "version", "config", "model", "optimizer", "iteration", "history")}
        return _strip_prefixes(state), obj.get("config"), info
    if isinstance(obj, dict) and _is_state_dict(obj.get("model")) and isinstance(obj.get("model_args"), dict):
        return _read_nanogpt(obj, path)
    if isinstance(obj, dict) and _is_state_dict(obj.get("model")):
        info = CheckpointInfo(str(path), "training", "inferred", iteration=_iteration(obj.get("iteration")), has_optimizer="optimizer" in obj)
        info.extra["top_level_keys"] = list(obj)
        return _strip_prefixes(obj["model"]), obj.get("config") if isinstance(obj.get("config"), dict) else None, info
    if _is_state_dict(obj):
        state = _strip_prefixes(obj)
        if is_nanogpt_state(state):  # a bare nanoGPT state dict: its sizes are read from the shapes
            info = CheckpointInfo(str(path), "state_dict", "inferred", extra={"layout": "nanogpt"})
            return from_nanogpt_state(state, path), None, info
        return state, None, CheckpointInfo(str(path), "state_dict", "inferred")
    if isinstance(obj, dict) and any(isinstance(k, str) and (isinstance(v, torch.Tensor) or _is_state_dict(v))
                                     for k, v in obj.items()):  # weights in a layout no loader here reads
        file_error(path, foreign_message(_nested_state(obj), obj), error=CheckpointError)
    file_error(path, f"holds a {type(obj).__name__}, not a model state dict",
               "save model.state_dict() or use tinylm.checkpoint.save", error=CheckpointError)


def infer_config(state: dict[str, torch.Tensor], **overrides: Any) -> ModelConfig:
    """Rebuild a ModelConfig from a state dict's keys and shapes, plus ``overrides``.

    Shapes determine vocab_size, d_model, d_ff, num_layers, the FFN kind, tied
    embeddings, norm placement (ln1 and ln_final: pre; ln1 only: post; none:
    none) and, once num_heads is known, the K/V heads of grouped-query attention
    (k_proj's rows / d_k); keys determine learned positions (``position_embeddings.weight``, whose rows
    are context_length), biases (``attn.q_proj.bias``), LayerNorm (a norm bias) and qk-norm
    (``attn.q_norm.weight``; "layer" when it has a bias, else "rms"). A
    non-gated FFN's activation cannot be seen and defaults to "silu" (pass ffn=...); nor
    can a bias-free LayerNorm be told from RMSNorm (pass norm_kind=...). num_heads,
    rope_theta (RoPE models) and context_length (unless learned positions show it)
    cannot be seen in the weights and must be given; the missing ones raise one
    :class:`MissingOptionsError` naming each.
    """
    emb = state.get("token_embeddings.weight")
    blocks = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    if emb is None and not blocks and state:
        refuse(f"the state dict is {foreign_message(state)}", error=CheckpointError)
    if emb is None or emb.dim() != 2:
        refuse("no 2-D 'token_embeddings.weight' in the state dict: not a CS336/tinylm language model "
               f"(first keys: {', '.join(list(state)[:4])})", error=CheckpointError)
    if not blocks:
        refuse("no 'layers.N.*' keys in the state dict: not a CS336/tinylm language model", error=CheckpointError)
    def any_block(suffix: str) -> str | None:  # the first block that has this key (one may be missing)
        return next((f"layers.{i}.{suffix}" for i in sorted(blocks) if f"layers.{i}.{suffix}" in state), None)

    w1 = state.get(any_block("ffn.w1.weight") or "")
    if w1 is None or w1.dim() != 2:
        refuse("no 2-D 'layers.N.ffn.w1.weight': cannot tell d_ff", "is this a CS336/tinylm model?",
               error=CheckpointError)
    if any_block("ln1.weight") or any_block("ln2.weight"):
        norm = "pre" if "ln_final.weight" in state else "post"
    else:
        norm = "none"
    lm = state.get("lm_head.weight")
    # one storage for both: tied (a sparse tensor has no storage to compare; the dense-weights check refuses it later)
    dense = lm is not None and lm.layout == emb.layout == torch.strided
    tied = lm is None or (dense and lm.data_ptr() == emb.data_ptr() and lm.shape == emb.shape)
    fields = dict(
        vocab_size=emb.shape[0],
        d_model=emb.shape[1],
        num_layers=max(blocks) + 1,
        d_ff=w1.shape[0],
        ffn="swiglu" if any_block("ffn.w3.weight") else "silu",
        norm=norm,
        tie_embeddings=bool(tied),
    )
    pos = state.get("position_embeddings.weight")
    if pos is not None and pos.dim() == 2:
        fields.update(positions="learned", context_length=pos.shape[0])
    if any_block("attn.q_proj.bias"):
        fields["bias"] = True
    if any_block("ln1.bias") or any_block("ln2.bias") or "ln_final.bias" in state:
        fields["norm_kind"] = "layer"
    if any_block("attn.q_norm.weight"):  # qk-norm: LayerNorm has a bias, RMSNorm none
        fields["qk_norm"] = "layer" if any_block("attn.q_norm.bias") else "rms"
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if "rope" in fields:  # the legacy boolean flag
        legacy = fields.pop("rope")
        fields.setdefault("positions", "rope" if legacy else "none")
    needed = ["num_heads", "context_length"] + (["rope_theta"] if fields.get("positions", "rope") == "rope" else [])
    missing = [name for name in needed if name not in fields]
    if missing:
        raise MissingOptionsError(missing, known=fields, given={k: overrides.get(k) for k in UNSEEN})
    wk = state.get(any_block("attn.k_proj.weight") or "")
    if "num_kv_heads" not in fields and wk is not None and wk.dim() == 2 and wk.shape[0] != fields["d_model"]:
        d_k, rows = fields["d_model"] // fields["num_heads"], wk.shape[0]  # grouped-query attention: fewer K/V heads
        if d_k and rows % d_k == 0:
            fields["num_kv_heads"] = rows // d_k
    return ModelConfig(**fields)


def _check_sizes(config: ModelConfig, state: dict[str, torch.Tensor], path: str) -> None:
    """The config's sizes against what the weights show, before any module is built: a stored
    config (or an override) that claims more blocks or wider layers than the file holds is refused."""
    seen: dict[str, int] = {}
    emb = state.get("token_embeddings.weight")
    if isinstance(emb, torch.Tensor) and emb.dim() == 2:
        seen["vocab_size"], seen["d_model"] = emb.shape
    blocks = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    if blocks:
        seen["num_layers"] = max(blocks) + 1
    w1 = state.get("layers.0.ffn.w1.weight")
    if isinstance(w1, torch.Tensor) and w1.dim() == 2:
        seen["d_ff"] = w1.shape[0]
    wrong = [f"{k}={getattr(config, k)} but the weights show {v}" for k, v in seen.items() if getattr(config, k) != v]
    if wrong:
        file_error(path, f"the config does not match the weights ({'; '.join(wrong)})",
                   "fix the override or the stored config, or drop it and let the shapes decide", error=CheckpointError)


def _validate_state(model: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}")
        file_error(path, f"the state dict does not match the model ({'; '.join(parts)})",
                   "check the config overrides or the file", error=CheckpointError)
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items() if state[k].shape != v.shape]
    if wrong:
        file_error(path, f"wrong shapes: {'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}",
                   "check the config overrides or the file", error=CheckpointError)
    sparse = [f"{k} ({v.layout})" for k, v in state.items() if v.layout != torch.strided]
    if sparse:
        file_error(path, f"sparse or non-dense weights: {', '.join(sparse[:3])}", "save dense tensors (tensor.to_dense())",
                   error=CheckpointError)
    bad = [f"{k} ({v.dtype})" for k, v in state.items() if not v.is_floating_point()]
    if bad:
        file_error(path, f"non-float weights: {', '.join(bad[:3])}", "weights must be floating point",
                   error=CheckpointError)


#: what a bare nanoGPT state dict's shapes cannot show but its architecture fixes
_NANOGPT_FIXED = {"ffn": "gelu", "norm_kind": "layer", "positions": "learned", "init": "gpt2"}


def _is_tinylm_state(state: dict[str, Any]) -> bool:
    """Holds tinylm's embedding or block keys (a damaged one is refused later, naming what is wrong)."""
    return "token_embeddings.weight" in state or any(re.match(r"layers\.\d+\.", k) for k in state)


def load(path: str | os.PathLike, *, unsafe: bool = False, check: Callable[[ModelConfig], None] | None = None,
         **overrides: Any) -> tuple[TransformerLM, CheckpointInfo]:
    """Load a model from any supported file; returns (model in eval mode, info).

    Args:
        path: a tinylm, CS336 (bare or training state dict), nanoGPT (``train.py``'s
            ``{"model", "model_args", ...}`` or its bare state dict) or safetensors file.
        unsafe: allow a whole pickled module (runs code from the file!).
        check: called with the config before any tensor of the model is allocated (e.g. a
            memory estimate of the forward pass to come); what it raises propagates.
        overrides: config fields: required (num_heads, rope_theta, context_length) where the
            file has no config, optional otherwise.

    The model's tensors are checked against the host's available memory
    (:func:`tinylm.memory.check_model_fits`) before they are allocated.
    """
    state, config_dict, info = read_state(path, unsafe=unsafe)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if info.format in ("training", "state_dict", "module-pickle") and not _is_tinylm_state(state):
        file_error(path, foreign_message(state, info.extra.get("top_level_keys")), error=CheckpointError)
    if config_dict is not None and not isinstance(config_dict, dict):
        file_error(path, f"the stored config is a {type(config_dict).__name__}, not a dict of fields",
                   "the file is damaged or was written by another tool (save with tinylm.checkpoint.save)",
                   error=CheckpointError)
    if config_dict is not None:
        try:
            config = ModelConfig.from_dict({**config_dict, **overrides})
        except ConfigError as e:
            file_error(path, f"stored config is invalid: {e}", error=CheckpointError)
    else:
        fixed = _NANOGPT_FIXED if info.extra.get("layout") == "nanogpt" else {}
        config = infer_config(state, **{**fixed, **overrides})
    _check_sizes(config, state, str(path))
    if config.tie_embeddings and "lm_head.weight" not in state and "token_embeddings.weight" in state:
        state = {**state, "lm_head.weight": state["token_embeddings.weight"]}
    emb = state.get("token_embeddings.weight")
    dtype = emb.dtype if emb is not None and emb.is_floating_point() else torch.float32
    try:  # the sizes a file or a flag claims, before anything is allocated
        check_model_fits(config, dtype, "cpu")
    except MemoryLimitError as e:
        err = MemoryLimitError(f"{path}: {e}")
        err.argument = getattr(e, "argument", None)
        raise err from None
    if check is not None:
        check(config)
    model = TransformerLM(config, device="meta", dtype=dtype)
    _validate_state(model, state, str(path))
    model.materialize("cpu")
    model.load_state_dict(state, strict=True)
    model.eval()
    info.nonfinite = [k for k, v in model.named_parameters() if not torch.isfinite(v).all()]
    return model, info

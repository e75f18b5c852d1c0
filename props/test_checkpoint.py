"""tinylm's own contract: checkpoints round-trip bit for bit, and every way a file is wrong has its one-line error.

Save then load gives the same weights, config and extras in every format; a file that
is missing, empty, cut short, text, a pickle of foreign objects, a state dict of the
wrong model or a safetensors file with oversized metadata is refused with a
``CheckpointError`` whose message names the problem and the fix (asserted whole:
it is what a user reads). Properties of tinylm itself: ``tinylm_only``.
"""

from __future__ import annotations

import collections
import fractions
import json
import os
import pickle
import re
import struct
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.contract import assert_refused
from props.record import prop
from props.strategies import generator, model_configs
from tinylm import checkpoint
from tinylm.checkpoint import CheckpointInfo, MissingOptionsError, atomic_write, infer_config, load, read_state, save
from tinylm.config import ModelConfig
from tinylm.errors import CheckpointError, ConfigError, MissingOptionError, UnsafeCheckpointError
from tinylm.model import TransformerLM

pytestmark = pytest.mark.tinylm_only

SMALL = ModelConfig(vocab_size=12, context_length=6, d_model=8, num_layers=2, num_heads=2, d_ff=10)
FLAGS = dict(num_heads=2, context_length=6, rope_theta=10000.0)
FIX = "pass a file written by torch.save or safetensors"
#: the end of the message for a file in a format tinylm does not read: what it reads, and the route that works
FOREIGN = ("tinylm reads tinylm, CS336 and nanoGPT checkpoints, their bare state dicts, safetensors and Hugging Face "
           "directories; for another model, build the model in Python and call diagnostics.diagnose(model, "
           "options=DiagnoseOptions(inputs=...)) (diagnostics/API.md)")
NOT_TINYLM = "without the 2-D token_embeddings.weight and layers.N.* of a tinylm/CS336 model"


def model_of(cfg: ModelConfig = SMALL, seed: int = 0, dtype=None) -> TransformerLM:
    return TransformerLM(cfg, generator(seed), dtype=dtype)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)




@prop("save/load round trip (.pt and .safetensors): bit-identical weights, the config, extras, iteration and history; "
      "the loaded model is in eval mode and a tied head stays tied")
@settings(max_examples=10, deadline=None)
@given(cfg=model_configs(max_layers=2, max_vocab=20, max_context=6), suffix=st.sampled_from([".pt", ".safetensors"]),
       it=st.integers(0, 10**6), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_round_trip(tmp_path_factory, cfg, suffix, it, dtype):
    path = tmp_path_factory.mktemp("ck") / f"m{suffix}"
    m = model_of(cfg, dtype=dtype)
    history = {"loss": [1.5, 2.0], "steps": [0, 1]}
    save(path, m, iteration=it, history=history, note="hello")
    m2, info = load(path)
    assert same(m.state_dict(), m2.state_dict()) and m2.config == cfg and not m2.training
    assert next(m2.parameters()).dtype == dtype
    assert (info.format, info.config_source, info.iteration, info.history, info.extra) == (
        "tinylm" if suffix == ".pt" else "safetensors", "stored", it, history, {"note": "hello"})
    assert info.path == str(path) and info.nonfinite == [] and info.has_optimizer is False
    assert info.version == (1 if suffix == ".pt" else None)
    assert (m2.lm_head.weight is m2.token_embeddings.weight) == cfg.tie_embeddings
    state, config, _ = read_state(path)
    assert config == cfg.to_dict() and ("lm_head.weight" in state) == (suffix == ".pt" or not cfg.tie_embeddings)


def test_pt_layout_and_safetensors_metadata(tmp_path):
    m = model_of()
    save(tmp_path / "m.pt", m, optimizer={"x": 1})
    obj = torch.load(tmp_path / "m.pt", weights_only=True)
    assert (obj["format"], obj["version"], obj["config"], obj["optimizer"]) == ("tinylm", 1, SMALL.to_dict(), {"x": 1})
    assert same(obj["model"], m.state_dict())
    _, info = load(tmp_path / "m.pt")
    assert info.has_optimizer and info.extra == {}
    from safetensors import safe_open

    save(tmp_path / "t.safetensors", model_of(SMALL.replace(tie_embeddings=True)), step=3)
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta == {"format": "tinylm", "version": "1", "config": json.dumps(SMALL.replace(tie_embeddings=True).to_dict()),
                    "step": "3"}
    assert "lm_head.weight" not in keys and "token_embeddings.weight" in keys


def test_save_refuses(tmp_path):
    assert_refused(ConfigError, "save() needs a model with a tinylm ModelConfig in .config (a TransformerLM)",
            save, tmp_path / "m.pt", torch.nn.Linear(2, 2))
    assert_refused(ConfigError, "extra key(s) ['config', 'format', 'version'] are reserved by the tinylm format",
            save, tmp_path / "m.pt", model_of(), **{"version": 1, "config": 2, "format": 3, "other": 4})
    with pytest.raises(ConfigError) as info:
        save(tmp_path / "m.safetensors", model_of(), blob=object())
    assert re.fullmatch(r"safetensors metadata must be JSON: .+; save extras such as optimizer state as \.pt", str(info.value))
    assert not list(tmp_path.iterdir())


def test_atomic_write(tmp_path):
    path = tmp_path / "deep" / "er" / "m.bin"
    atomic_write(path, lambda tmp: open(tmp, "wb").write(b"one"))
    atomic_write(str(path), lambda tmp: open(tmp, "wb").write(b"two"))
    assert path.read_bytes() == b"two" and os.listdir(path.parent) == ["m.bin"]

    def interrupted(tmp):
        open(tmp, "wb").write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, interrupted)
    assert path.read_bytes() == b"two" and os.listdir(path.parent) == ["m.bin"]

    def removes(tmp):
        os.unlink(tmp)
        raise OSError("gone")

    with pytest.raises(OSError, match="gone"):
        atomic_write(path, removes)


def test_unusable_paths(tmp_path, monkeypatch):
    p = tmp_path / "none.pt"
    assert_refused(CheckpointError, f"{p}: no such file; check the path", load, p)
    assert_refused(CheckpointError, f"{tmp_path}: is a directory; pass the checkpoint file inside it", load, tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_refused(CheckpointError, f"{fifo}: not a regular file; pass a checkpoint file", load, fifo)
    empty = tmp_path / "e.pt"
    empty.write_bytes(b"")
    assert_refused(CheckpointError, f"{empty}: empty file (0 bytes); the save was probably interrupted; use another checkpoint",
            load, empty)
    good = tmp_path / "m.pt"
    save(good, model_of())
    monkeypatch.setattr(os, "access", lambda path, mode: mode != os.R_OK)
    assert_refused(CheckpointError, f"{good}: not readable (permission denied); fix its permissions (chmod u+r)", load, good)


def test_reading_errors_after_the_checks(tmp_path, monkeypatch):
    good = tmp_path / "m.pt"
    save(good, model_of())
    real_open = open

    def failing(err):
        def fake(path, mode="r", *args, **kwargs):
            if str(path) == str(good) and "b" in mode:
                raise err
            return real_open(path, mode, *args, **kwargs)
        return fake

    monkeypatch.setattr("builtins.open", failing(PermissionError(13, "Permission denied")))
    assert_refused(CheckpointError, f"{good}: not readable (permission denied); fix its permissions (chmod u+r)", load, good)
    monkeypatch.setattr("builtins.open", failing(OSError(5, "Input/output error")))
    assert_refused(CheckpointError, f"{good}: cannot be read (Input/output error); check the file and its disk", load, good)
    monkeypatch.setattr("builtins.open", failing(OSError("no strerror")))
    assert_refused(CheckpointError, f"{good}: cannot be read (no strerror); check the file and its disk", load, good)


def test_damaged_files(tmp_path):
    good = tmp_path / "m.pt"
    save(good, model_of())
    data = good.read_bytes()
    for name, body in (("cut.pt", data[: len(data) // 2]), ("head.pt", data[:20])):
        (tmp_path / name).write_bytes(body)
        assert_refused(CheckpointError, f"{tmp_path / name}: truncated or damaged (the save was probably interrupted or the copy "
                f"is incomplete); {FIX}", load, tmp_path / name)
    (tmp_path / "t.pt").write_text("step,loss\n1,2.5\n")
    assert_refused(CheckpointError, f"{tmp_path / 't.pt'}: a text file, not a checkpoint; {FIX}", load, tmp_path / "t.pt")
    (tmp_path / "b.pt").write_bytes(bytes(range(256)) * 4)
    assert_refused(CheckpointError, f"{tmp_path / 'b.pt'}: not a PyTorch checkpoint (unreadable or corrupt data); {FIX}",
            load, tmp_path / "b.pt")
    (tmp_path / "z.pt").write_bytes(b"\x00" * 64)  # NUL bytes decode as UTF-8 but are not text
    assert_refused(CheckpointError, f"{tmp_path / 'z.pt'}: not a PyTorch checkpoint (unreadable or corrupt data); {FIX}",
            load, tmp_path / "z.pt")


@pytest.mark.parametrize("zipped", [True, False])
def test_foreign_pickles_are_named_not_run(tmp_path, zipped):
    path = tmp_path / "f.pt"
    obj = {"a": fractions.Fraction(1, 3), "b": fractions.Fraction(1, 2), "c": re.compile("x"), "d": CheckpointInfo("p", "x", "y"),
           "e": collections.Counter("ab"), "t": torch.zeros(3)}  # (collections is allowed, as torch's own)
    torch.save(obj, path, _use_new_zipfile_serialization=zipped)
    assert_refused(UnsafeCheckpointError, f"{path}: holds pickled Python objects (fractions.Fraction, re._compile, "
            "tinylm.checkpoint.CheckpointInfo), e.g. a whole torch.save(model), which a safe load will not execute; "
            "if you made the file or trust it, rerun with unsafe=True (risk: it runs the code the file names, with "
            "your permissions), or convert it once to a state dict: torch.save(torch.load(p, weights_only=False)"
            ".state_dict(), 'state.pt')", load, path)
    assert_refused(CheckpointError, f"{path}: not a model tinylm can rebuild (top-level keys: a, b, c, d, e, t): "
            f"{FOREIGN}", load, path, unsafe=True)


def test_pickle_globals_read_by_opcode():
    objs = [fractions.Fraction(1, 2), CheckpointInfo("p", "f", "c")]
    for proto in (2, 4):  # STACK_GLOBAL (4) and GLOBAL (2)
        assert checkpoint._pickle_globals(pickle.dumps(objs, protocol=proto)) == [
            "fractions.Fraction", "tinylm.checkpoint.CheckpointInfo"], proto
    assert checkpoint._pickle_globals(pickle.dumps(objs, protocol=0)) == [  # text GLOBAL "module name"
        "fractions.Fraction", "copy_reg._reconstructor", "tinylm.checkpoint.CheckpointInfo", "__builtin__.object"]
    two = pickle.dumps(1, protocol=2) + pickle.dumps(objs, protocol=2) + b"\xff raw bytes"
    assert checkpoint._pickle_globals(two) == ["fractions.Fraction", "tinylm.checkpoint.CheckpointInfo"]
    assert checkpoint._pickle_globals(b"\x80\x04garbage") == []


def test_whole_pickled_module(tmp_path):
    m = model_of()
    torch.save(m, tmp_path / "whole.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"tinylm\.model\.TransformerLM"):
        load(tmp_path / "whole.pt")
    with pytest.warns(UserWarning, match=r"whole\.pt: loaded a whole pickled module \(unsafe=True\); its code ran on load"):
        m2, info = load(tmp_path / "whole.pt", unsafe=True)
    assert (info.format, info.config_source) == ("module-pickle", "stored") and same(m.state_dict(), m2.state_dict())
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    torch.save(plain, tmp_path / "seq.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state, config, info = read_state(tmp_path / "seq.pt", unsafe=True)
    assert config is None and info.config_source == "inferred" and set(state) == {"0.weight", "0.bias"}


def test_tinylm_format_damage(tmp_path):
    p = tmp_path / "m.pt"
    sd = model_of().state_dict()
    torch.save({"format": "tinylm", "version": 1, "config": SMALL.to_dict(), "model": [1]}, p)
    assert_refused(CheckpointError, f"{p}: a tinylm checkpoint whose 'model' entry is not a state dict; the file is damaged", load, p)
    torch.save({"format": "tinylm", "config": [1, 2], "model": sd}, p)
    assert_refused(CheckpointError, f"{p}: the stored config is a list, not a dict of fields; the file is damaged or was "
            "written by another tool (save with tinylm.checkpoint.save)", load, p)
    torch.save({"format": "tinylm", "config": {**SMALL.to_dict(), "num_heads": 3}, "model": sd}, p)
    assert_refused(CheckpointError, f"{p}: stored config is invalid: d_model=8, num_heads=3: d_model must be divisible by num_heads",
            load, p)
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": sd, "iteration": -4, "x": 1}, p)
    m, info = load(p, num_layers=None)  # a None override is no override
    assert info.iteration is None and info.version is None and info.extra == {"x": 1} and info.history is None


@pytest.mark.parametrize("value, expected", [(5, 5), (0, 0), (-1, None), (True, None), (2.0, None), ("7", None),
                                             (torch.tensor(3), None), (None, None)])
def test_iteration_is_a_count(tmp_path, value, expected):
    torch.save({"model": model_of().state_dict(), "iteration": value}, tmp_path / "t.pt")
    _, _, info = read_state(tmp_path / "t.pt")
    assert info.iteration == expected and info.format == "training" and info.has_optimizer is False


def test_training_and_bare_state_dicts(tmp_path):
    m = model_of(SMALL.replace(norm="post"))
    sd = m.state_dict()
    torch.save({"model": sd, "optimizer": {}, "config": SMALL.replace(norm="post").to_dict()}, tmp_path / "t.pt")
    m2, info = load(tmp_path / "t.pt")
    assert info.format == "training" and info.config_source == "inferred" and info.has_optimizer and m2.config.norm == "post"
    torch.save({"model": sd, "config": "post"}, tmp_path / "u.pt")
    assert read_state(tmp_path / "u.pt")[1] is None
    torch.save({"module._orig_mod.module." + k: v for k, v in sd.items()}, tmp_path / "b.pt")
    m3, info = load(tmp_path / "b.pt", **FLAGS)
    assert info.format == "state_dict" and same(m3.state_dict(), sd) and m3.config == SMALL.replace(norm="post")
    for obj, kind in (([1, 2], "list"), ({}, "dict"), ({"a": 1}, "dict"), ({1: torch.zeros(1)}, "dict")):
        torch.save(obj, tmp_path / "x.pt")
        assert_refused(CheckpointError, f"{tmp_path / 'x.pt'}: holds a {kind}, not a model state dict; save model.state_dict() "
                "or use tinylm.checkpoint.save", load, tmp_path / "x.pt")


def _safetensors_file(path, tensors: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=meta)


def test_safetensors_metadata(tmp_path):
    sd = {k: v.contiguous() for k, v in model_of().state_dict().items()}
    p = tmp_path / "m.safetensors"
    _safetensors_file(p, sd, {"config": json.dumps(SMALL.to_dict()), "iteration": "9", "history": '{"a": [1]}',
                              "tag": "not json", "n": "[1, 2]"})
    m, info = load(p)
    assert (info.iteration, info.history, info.extra, info.config_source) == (9, {"a": [1]}, {"tag": "not json", "n": [1, 2]}, "stored")
    _safetensors_file(p, sd, {"config": "{not json"})
    assert_refused(CheckpointError, f"{p}: the config in its safetensors metadata is not valid JSON; re-export it", load, p)
    _safetensors_file(p, sd, {})
    _, info = load(p, **FLAGS)
    assert info.config_source == "inferred" and info.iteration is None and info.extra == {}
    q = tmp_path / "weights.bin"  # sniffed by content, whatever the suffix
    _safetensors_file(q, sd, {"format": "tinylm"})
    assert read_state(q)[2].format == "safetensors"
    deep = "[" * 65 + "]" * 65
    _safetensors_file(p, sd, {"config": json.dumps(SMALL.to_dict()), "x": deep})
    assert_refused(CheckpointError, f"{p}: its 'x' metadata nests 65 levels deep (at most 64); re-export the file without it", load, p)
    _safetensors_file(p, sd, {"config": json.dumps(SMALL.to_dict()), "x": "[" * 64 + "]" * 64, "s": '["[[[[", "\\"[["]'})
    assert load(p)[1].extra["s"] == ["[[[[", '"[[']
    big = json.dumps("a" * (1 << 20))
    _safetensors_file(p, sd, {"config": big})
    assert_refused(CheckpointError, f"{p}: its config metadata is {len(big):,} characters (at most {1 << 20:,} are read); "
            "re-export the file without it", load, p)


def test_bounded_json_counts_nesting_outside_strings(tmp_path):
    bj = checkpoint._bounded_json
    assert bj('{"a": "[[[[[[", "b": "\\\\", "c": [[1]]}', "x", tmp_path) == {"a": "[[[[[[", "b": "\\", "c": [[1]]}
    nested = '{"k": "\\"' + "[" * 70 + '"}'
    assert bj(nested, "x", tmp_path) == {"k": '"' + "[" * 70}
    assert bj("[" * 64 + "]" * 64, "x", tmp_path) is not None
    with pytest.raises(CheckpointError, match="nests 65 levels"):
        bj("[" * 64 + "{" + "}" + "]" * 64, "x", tmp_path)
    with pytest.raises(CheckpointError, match="nests 65 levels"):
        bj("[" * 65 + "]" * 65 + "[]", "x", tmp_path)
    assert bj('"' + "a" * ((1 << 20) - 2) + '"', "x", tmp_path) == "a" * ((1 << 20) - 2)


def test_corrupt_safetensors(tmp_path):
    p = tmp_path / "c.safetensors"
    _safetensors_file(p, {"w": torch.zeros(64)}, {})
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as info:
        load(p)
    assert re.fullmatch(re.escape(f"{p}: corrupt safetensors file (") + r".+\); re-export it", str(info.value))


def test_infer_config_from_shapes_and_flags():
    sd = model_of().state_dict()
    assert infer_config(sd, **FLAGS) == SMALL
    assert infer_config(sd, **{**FLAGS, "vocab_size": None, "num_layers": None}) == SMALL  # None: not given
    no_rope = infer_config(sd, num_heads=2, context_length=6, positions="none")
    assert no_rope == SMALL.replace(positions="none")
    untied = dict(sd, **{"lm_head.weight": sd["token_embeddings.weight"].clone()})
    assert infer_config(untied, **FLAGS).tie_embeddings is False
    shared = dict(sd, **{"lm_head.weight": sd["token_embeddings.weight"]})
    assert infer_config(shared, **FLAGS).tie_embeddings is True
    first_missing = {k: v for k, v in sd.items() if not k.startswith("layers.0.")}
    assert infer_config(first_missing, **FLAGS) == SMALL  # another block tells the sizes
    for missing, placeholder in (("num_heads", "N"), ("context_length", "N"), ("rope_theta", "X")):
        with pytest.raises(MissingOptionError) as info:
            infer_config(sd, **{k: v for k, v in FLAGS.items() if k != missing})
        assert str(info.value) == f"the checkpoint stores no config, so {missing} is unknown; pass {missing}={placeholder}"
    assert_refused(CheckpointError, "the state dict is not a model tinylm can rebuild (state-dict keys such as a, b, c, d "
            f"... (5 in all), {NOT_TINYLM}): {FOREIGN}", infer_config, {k: torch.zeros(1) for k in "abcde"})
    assert_refused(CheckpointError, "no 2-D 'token_embeddings.weight' in the state dict: not a CS336/tinylm language model "
            "(first keys: token_embeddings.weight)", infer_config, {"token_embeddings.weight": torch.zeros(3)})
    assert_refused(CheckpointError, "no 'layers.N.*' keys in the state dict: not a CS336/tinylm language model",
            infer_config, {"token_embeddings.weight": torch.zeros(3, 4), "layers": torch.zeros(1)})
    no_w1 = {k: v for k, v in sd.items() if "ffn.w1" not in k}
    assert_refused(CheckpointError, "no 2-D 'layers.N.ffn.w1.weight': cannot tell d_ff; is this a CS336/tinylm model?",
            infer_config, no_w1)
    flat_w1 = dict(sd, **{"layers.0.ffn.w1.weight": torch.zeros(10), "layers.1.ffn.w1.weight": torch.zeros(10)})
    with pytest.raises(CheckpointError, match="cannot tell d_ff"):
        infer_config(flat_w1)
    only_ln2 = {k: v for k, v in sd.items() if ".ln1." not in k and k != "ln_final.weight"}
    assert infer_config(only_ln2, **FLAGS).norm == "post"


def test_config_and_state_must_match_the_weights(tmp_path):
    sd = model_of().state_dict()
    p = tmp_path / "m.pt"
    torch.save({"format": "tinylm", "config": SMALL.replace(num_layers=3, d_ff=12).to_dict(), "model": sd}, p)
    assert_refused(CheckpointError, f"{p}: the config does not match the weights (num_layers=3 but the weights show 2; d_ff=12 but "
            "the weights show 10); fix the override or the stored config, or drop it and let the shapes decide", load, p)
    assert_refused(CheckpointError, f"{p}: the config does not match the weights (vocab_size=13 but the weights show 12; d_model=16 "
            "but the weights show 8); fix the override or the stored config, or drop it and let the shapes decide",
            load, p, vocab_size=13, d_model=16, num_layers=2, d_ff=10, num_heads=2)
    extra = dict(sd, **{f"x{i}": torch.zeros(1) for i in range(4)})
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": extra}, p)
    assert_refused(CheckpointError, f"{p}: the state dict does not match the model (unexpected 4 key(s): x0, x1, x2 ...); check the "
            "config overrides or the file", load, p)
    fewer = {k: v for k, v in sd.items() if not k.startswith("layers.1.attn")}
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": dict(fewer, y=torch.zeros(1))}, p)
    assert_refused(CheckpointError, f"{p}: the state dict does not match the model (missing 4 key(s): layers.1.attn.q_proj.weight, "
            "layers.1.attn.k_proj.weight, layers.1.attn.v_proj.weight ...; unexpected 1 key(s): y); check the config overrides "
            "or the file", load, p)
    three = {k: v for k, v in sd.items() if k not in ("layers.1.ln1.weight", "layers.1.ln2.weight", "layers.1.ffn.w3.weight")}
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": three}, p)
    assert_refused(CheckpointError, f"{p}: the state dict does not match the model (missing 3 key(s): layers.1.ln1.weight, "
            "layers.1.ln2.weight, layers.1.ffn.w3.weight); check the config overrides or the file", load, p)
    shapes = dict(sd, **{k: torch.zeros(3) for k in ("layers.0.ln1.weight", "layers.0.ln2.weight", "layers.1.ln1.weight",
                                                      "layers.1.ln2.weight")})
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": shapes}, p)
    assert_refused(CheckpointError, f"{p}: wrong shapes: layers.0.ln1.weight (3,) (expected (8,)); layers.0.ln2.weight (3,) (expected "
            "(8,)); layers.1.ln1.weight (3,) (expected (8,)) ...; check the config overrides or the file", load, p)
    one = dict(sd, **{"ln_final.weight": torch.zeros(3)})
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": one}, p)
    assert_refused(CheckpointError, f"{p}: wrong shapes: ln_final.weight (3,) (expected (8,)); check the config overrides or the file",
            load, p)
    ints = dict(sd, **{"ln_final.weight": torch.ones(8, dtype=torch.int64)})
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": ints}, p)
    assert_refused(CheckpointError, f"{p}: non-float weights: ln_final.weight (torch.int64); weights must be floating point", load, p)
    head = dict(sd, **{"lm_head.weight": sd["lm_head.weight"].to_sparse()})  # no config: the shapes are read first
    torch.save(head, p)
    assert_refused(CheckpointError, f"{p}: sparse or non-dense weights: lm_head.weight (torch.sparse_coo); save dense tensors "
            "(tensor.to_dense())", load, p, **FLAGS)
    sparse = dict(sd, **{"ln_final.weight": torch.ones(8).to_sparse()})
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": sparse}, p)
    assert_refused(CheckpointError, f"{p}: sparse or non-dense weights: ln_final.weight (torch.sparse_coo); save dense tensors "
            "(tensor.to_dense())", load, p)


def test_int_embedding_and_nonfinite_parameters(tmp_path):
    sd = model_of().state_dict()
    bad = dict(sd, **{"layers.0.ln1.weight": torch.full((8,), float("nan")), "ln_final.weight": torch.full((8,), float("inf"))})
    save(tmp_path / "m.pt", model_of())
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": bad}, tmp_path / "m.pt")
    _, info = load(tmp_path / "m.pt")
    assert info.nonfinite == ["layers.0.ln1.weight", "ln_final.weight"]
    ints = dict(sd, **{"token_embeddings.weight": torch.zeros(12, 8, dtype=torch.int32)})
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": ints}, tmp_path / "i.pt")
    assert_refused(CheckpointError, f"{tmp_path / 'i.pt'}: non-float weights: token_embeddings.weight (torch.int32); weights must be "
            "floating point", load, tmp_path / "i.pt")


def test_tied_file_without_head_loads(tmp_path):
    m = model_of(SMALL.replace(tie_embeddings=True))
    sd = {k: v for k, v in m.state_dict().items() if k != "lm_head.weight"}
    torch.save(sd, tmp_path / "t.pt")
    m2, _ = load(tmp_path / "t.pt", **FLAGS)
    assert m2.config.tie_embeddings and m2.lm_head.weight is m2.token_embeddings.weight
    assert torch.equal(m2.lm_head.weight, m.lm_head.weight)


@pytest.mark.parametrize("op", ["SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING", "BINSTRING"])
def test_every_string_opcode_before_a_stack_global_is_read(op):
    """A hand-made pickle may spell the module and name of STACK_GLOBAL with any string opcode;
    the scanner names the global whichever it is (nothing is executed)."""
    def s(text: str) -> bytes:
        b = text.encode()
        return {"SHORT_BINUNICODE": b"\x8c" + bytes([len(b)]) + b, "BINUNICODE": b"X" + struct.pack("<I", len(b)) + b,
                "UNICODE": b"V" + b + b"\n", "BINUNICODE8": b"\x8d" + struct.pack("<Q", len(b)) + b,
                "SHORT_BINSTRING": b"U" + bytes([len(b)]) + b, "BINSTRING": b"T" + struct.pack("<i", len(b)) + b}[op]

    data = b"\x80\x04" + s("os") + s("system") + b"\x93."
    assert checkpoint._pickle_globals(data) == ["os.system"]


def test_text_is_judged_by_its_first_512_bytes(tmp_path):
    for name, body in (("a.pt", b"x" * 512 + b"\xff\x00"), ("b.pt", b"y" * 511 + b"\xff")):
        (tmp_path / name).write_bytes(body)
    assert_refused(CheckpointError, f"{tmp_path / 'a.pt'}: a text file, not a checkpoint; {FIX}", load, tmp_path / "a.pt")
    assert_refused(CheckpointError, f"{tmp_path / 'b.pt'}: not a PyTorch checkpoint (unreadable or corrupt data); {FIX}",
            load, tmp_path / "b.pt")


def test_an_unopenable_file_is_not_called_a_broken_zip(tmp_path, monkeypatch):
    p = tmp_path / "z.pt"
    p.write_bytes(b"PK\x03\x04" + b"\x00" * 40)
    assert checkpoint._is_broken_zip(p)

    def no_open(*args, **kwargs):
        raise OSError("gone")

    monkeypatch.setattr("builtins.open", no_open)
    assert checkpoint._is_broken_zip(p) is False and checkpoint._looks_like_text(p) is False


def test_corrupt_safetensors_quotes_the_parser_to_120_characters(tmp_path):
    from safetensors import safe_open

    header = json.dumps({"w": {"dtype": "Q" * 150, "shape": [1], "data_offsets": [0, 4]}}).encode()
    p = tmp_path / "q.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 4)
    try:
        with safe_open(str(p), framework="pt") as f:
            list(f.keys())
    except Exception as e:  # the parser's own words
        why = str(e).splitlines()[0]
    assert len(why) > 120
    assert_refused(CheckpointError, f"{p}: corrupt safetensors file ({why[:120]}); re-export it", load, p)


def test_json_nesting_is_counted_outside_strings_only(tmp_path):
    bj = checkpoint._bounded_json
    after_string = '["a\\\\", "b\\"", ' + "[" * 64 + "]" * 64 + "]"  # strings (escapes too) end where they end
    with pytest.raises(CheckpointError, match="nests 65 levels"):
        bj(after_string, "x", tmp_path)
    reopened = "[" * 63 + "[],[[]]" + "]" * 63  # 64 deep, back to 63, then 65 deep
    with pytest.raises(CheckpointError, match="nests 65 levels"):
        bj(reopened, "x", tmp_path)
    assert bj("[" * 63 + "[],[]" + "]" * 63, "x", tmp_path) is not None


def test_atomic_write_stages_a_hidden_file_beside_the_target(tmp_path):
    seen = []

    def write(tmp):
        seen.append(Path(tmp))
        open(tmp, "wb").write(b"x")

    atomic_write(tmp_path / "m.pt", write)
    (tmp,) = seen
    assert tmp.parent == tmp_path and tmp.name.startswith(".m.pt.") and tmp.name.endswith(".tmp")


def test_norm_placement_from_either_block_norm():
    sd = model_of(SMALL.replace(norm="post")).state_dict()
    only_ln1 = {k: v for k, v in sd.items() if ".ln2." not in k}
    assert infer_config(only_ln1, **FLAGS).norm == "post"


def test_lists_in_messages_name_the_first_three(tmp_path):
    sd = model_of().state_dict()
    p = tmp_path / "m.pt"
    norms = ["layers.0.ln1.weight", "layers.0.ln2.weight", "layers.1.ln1.weight", "layers.1.ln2.weight"]

    def stored(state):
        torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": state}, p)

    stored(dict(sd, **{k: torch.ones(8).to_sparse() for k in norms}))
    assert_refused(CheckpointError, f"{p}: sparse or non-dense weights: layers.0.ln1.weight (torch.sparse_coo), layers.0.ln2.weight "
            "(torch.sparse_coo), layers.1.ln1.weight (torch.sparse_coo); save dense tensors (tensor.to_dense())", load, p)
    stored(dict(sd, **{k: torch.ones(8, dtype=torch.int16) for k in norms}))
    assert_refused(CheckpointError, f"{p}: non-float weights: layers.0.ln1.weight (torch.int16), layers.0.ln2.weight (torch.int16), "
            "layers.1.ln1.weight (torch.int16); weights must be floating point", load, p)
    stored(dict(sd, **{f"x{i}": torch.zeros(1) for i in range(3)}))
    assert_refused(CheckpointError, f"{p}: the state dict does not match the model (unexpected 3 key(s): x0, x1, x2); check the "
            "config overrides or the file", load, p)
    stored(dict(sd, **{k: torch.zeros(3) for k in norms[:3]}))
    assert_refused(CheckpointError, f"{p}: wrong shapes: layers.0.ln1.weight (3,) (expected (8,)); layers.0.ln2.weight (3,) (expected "
            "(8,)); layers.1.ln1.weight (3,) (expected (8,)); check the config overrides or the file", load, p)
    for gone in ("token_embeddings.weight", "layers.0.ffn.w1.weight"):  # the size check skips what is not there
        stored({k: v for k, v in sd.items() if k != gone})
        assert_refused(CheckpointError, f"{p}: the state dict does not match the model (missing 1 key(s): {gone}); check the "
                "config overrides or the file", load, p)
    torch.save({"w": torch.zeros(2)}, p)  # one tensor is still a state dict, of no language model
    assert_refused(CheckpointError, f"{p}: not a model tinylm can rebuild (state-dict keys such as w, {NOT_TINYLM}): "
            f"{FOREIGN}", load, p, **FLAGS)


def test_safetensors_is_sniffed_by_its_header_bounds(tmp_path):
    def sniffed(name: str, body: bytes) -> str:
        (tmp_path / name).write_bytes(body)
        with pytest.raises(CheckpointError) as info:
            load(tmp_path / name, **FLAGS)
        return str(info.value)

    assert "corrupt safetensors file" in sniffed("one.pt", struct.pack("<Q", 1) + b"{")  # n = size - 8 = 1: header only
    assert sniffed("two.pt", struct.pack("<Q", 2) + b"{}").endswith("(first keys: )")  # an empty safetensors file
    for name, body in (("zero.pt", struct.pack("<Q", 0) + b"{}"),  # no header
                       ("long.pt", struct.pack("<Q", 3) + b"{}"),  # header past the end
                       ("brace.pt", struct.pack("<Q", 1) + b"x"),  # no JSON object
                       ("short.pt", b"\x01\x00\x00\x00")):
        assert sniffed(name, body).endswith(f"not a PyTorch checkpoint (unreadable or corrupt data); {FIX}"), name
    (tmp_path / "hi.pt").write_text("hello")  # shorter than a safetensors header: text
    assert_refused(CheckpointError, f"{tmp_path / 'hi.pt'}: a text file, not a checkpoint; {FIX}", load, tmp_path / "hi.pt")


def test_unsafe_names_at_most_three_and_a_load_refused_midway(tmp_path, monkeypatch):
    import decimal

    path = tmp_path / "f.pt"
    torch.save([fractions.Fraction(1, 3), re.compile("x"), CheckpointInfo("p", "x", "y"), decimal.Decimal(1)], path)
    with pytest.raises(UnsafeCheckpointError, match=r"\(fractions\.Fraction, re\._compile, tinylm\.checkpoint\.CheckpointInfo\), e\.g\. a whole"):
        load(path)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    save(tmp_path / "m.pt", model_of())
    monkeypatch.setattr(torch, "load", denied)
    assert_refused(CheckpointError, f"{tmp_path / 'm.pt'}: not readable (permission denied); fix its permissions (chmod u+r)",
            load, tmp_path / "m.pt")


def test_an_untied_config_never_borrows_the_embedding(tmp_path):
    sd = {k: v for k, v in model_of().state_dict().items() if k != "lm_head.weight"}
    p = tmp_path / "m.pt"
    torch.save({"format": "tinylm", "config": SMALL.to_dict(), "model": sd}, p)
    assert_refused(CheckpointError, f"{p}: the state dict does not match the model (missing 1 key(s): lm_head.weight); check the "
            "config overrides or the file", load, p)


def test_read_state_is_safe_by_default_and_records_the_path(tmp_path):
    path = tmp_path / "f.pt"
    torch.save({"a": fractions.Fraction(1, 3)}, path)
    with pytest.raises(UnsafeCheckpointError):
        read_state(path)
    bad = tmp_path / "x.safetensors"  # the suffix alone sends it to the safetensors parser
    bad.write_bytes(b"\x00" * 32)
    with pytest.raises(CheckpointError, match=r"x\.safetensors: corrupt safetensors file \("):
        read_state(bad)
    torch.save({"model": model_of().state_dict()}, tmp_path / "t.pt")
    assert read_state(tmp_path / "t.pt")[2].path == str(tmp_path / "t.pt")
    torch.save(model_of(), tmp_path / "w.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert read_state(tmp_path / "w.pt", unsafe=True)[2].path == str(tmp_path / "w.pt")


def test_every_missing_flag_is_named_at_once(tmp_path):
    # a bare state dict: the sizes the weights cannot show are named together, in one message, with what was given
    path = tmp_path / "bare.pt"
    torch.save(model_of().state_dict(), path)
    assert_refused(MissingOptionsError,
                   "the checkpoint stores no config, so num_heads, context_length, rope_theta are unknown; pass "
                   "num_heads=N, context_length=N, rope_theta=X", load, path)
    with pytest.raises(MissingOptionsError) as info:
        load(path, num_heads=2, context_length=6)
    e = info.value
    assert str(e) == "the checkpoint stores no config, so rope_theta is unknown; pass rope_theta=X"
    assert (e.missing, e.field, e.argument) == (["rope_theta"], "rope_theta", "rope_theta")
    assert e.given == {"num_heads": 2, "rope_theta": None, "context_length": 6}
    assert (e.known["vocab_size"], e.known["d_model"], e.known["num_layers"]) == (12, 8, 2)


def test_a_bare_state_dict_records_its_path(tmp_path):
    path = tmp_path / "bare.pt"
    torch.save(model_of().state_dict(), path)
    _, config, info = read_state(path)
    assert (info.path, info.format, info.config_source, config) == (str(path), "state_dict", "inferred", None)

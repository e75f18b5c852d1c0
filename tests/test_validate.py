"""tinylm.validate: one message pattern, ``name=value: must <rule>[; pass <fix>]``, every caller's error class."""

from __future__ import annotations

import numpy as np
import pytest

from diagnostics.options import DiagnoseOptions, OptionsError, ProbeOptions
from tinylm import ModelConfig
from tinylm.errors import ConfigError, TinyLMError
from tinylm.train import TrainError, TrainOptions
from tinylm.validate import boolean, check_type, choice, fail, file_error, integer, number, refuse

PATTERN = r"^[a-z_0-9]+=.+: must .+"


@pytest.mark.parametrize("value", [1, 5, np.int64(3), np.int32(7)])
def test_integer_accepts_integers_in_range(value):
    assert integer("n", value, low=1, high=10) == int(value)
    assert type(integer("n", value, low=1)) is int


@pytest.mark.parametrize("value", [0, 11, True, 2.0, "3", None, np.float64(3.0)])
def test_integer_refuses_with_the_pattern(value):
    with pytest.raises(TinyLMError, match=r"^n=.*: must be an integer in \[1, 10\]; pass n=N$") as e:
        integer("n", value, low=1, high=10, fix="n=N")
    assert e.value.argument == "n"


def test_number_bounds_and_finiteness():
    assert number("lr", 0.5, low=0.0, strict_low=True) == 0.5
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(TinyLMError, match=r"^lr=.*: must be a finite number > 0.0$"):
            number("lr", bad, low=0.0, strict_low=True)
    assert number("eps", 0.0, low=0.0) == 0.0


def test_choice_boolean_and_fail():
    assert choice("norm", "pre", ("pre", "post")) == "pre"
    with pytest.raises(TinyLMError, match=r"^norm='mid': must be one of pre, post$"):
        choice("norm", "mid", ("pre", "post"))
    with pytest.raises(TinyLMError, match=r"^rope=1: must be True or False$"):
        boolean("rope", 1)
    with pytest.raises(ConfigError, match=r"^x=3: must be odd; pass x=5$"):
        fail("x", 3, "be odd", "x=5", error=ConfigError)


def test_refuse_file_error_and_check_type():
    with pytest.raises(ConfigError, match=r"^no layers; pass some$") as e:
        refuse("no layers", "pass some", error=ConfigError)
    assert e.value.argument is None and e.value.__suppress_context__
    with pytest.raises(TinyLMError, match=r"^/x.npy: empty file; pass a file with tokens$") as e:
        file_error("/x.npy", "empty file", "pass a file with tokens")
    assert e.value.argument == "path"
    assert check_type("options", {}, dict, "a dict") == {}
    with pytest.raises(TypeError, match=r"^options=list: must be a dict; pass options=\{\}$") as e:
        check_type("options", [1], dict, "a dict", fix="options={}", error=TypeError)
    assert e.value.argument == "options"


@pytest.mark.parametrize("make, error", [
    (lambda: ModelConfig(vocab_size=0, context_length=8, d_model=8, num_layers=1, num_heads=2, d_ff=8), ConfigError),
    (lambda: ModelConfig(vocab_size=8, context_length=8, d_model=8, num_layers=1, num_heads=2, d_ff=8, norm="mid"),
     ConfigError),
    (lambda: ModelConfig(vocab_size=8, context_length=8, d_model=8, num_layers=1, num_heads=2, d_ff=8, dropout=1.0),
     ConfigError),
    (lambda: TrainOptions(steps=0), TrainError),
    (lambda: TrainOptions(steps=5, lr=-1.0), TrainError),
    (lambda: TrainOptions(steps=5, beta1=1.0), TrainError),
    (lambda: DiagnoseOptions(batches=0), OptionsError),
    (lambda: DiagnoseOptions(theory="magic"), OptionsError),
    (lambda: ProbeOptions(backward="yes"), OptionsError),
    (lambda: ProbeOptions(modules="layers.0"), OptionsError),
])
def test_every_options_class_speaks_the_pattern(make, error):
    with pytest.raises(error, match=PATTERN):
        make()


def test_pattern_rejects_a_message_off_the_pattern():
    # negative control for PATTERN: the old style "field: bad value" does not match it
    import re

    assert re.match(PATTERN, "seq_len=3: must be an integer >= 4")
    assert not re.match(PATTERN, "seq_len: bad value 3")


# ----------------------------------------------------------------------------- the library names arguments


@pytest.mark.parametrize("make, words", [
    (lambda: TrainOptions(steps=0), "pass steps=N"),
    (lambda: TrainOptions(steps=5, beta1=1.0), "pass beta1=X"),
    (lambda: TrainOptions(steps=5, lr=1e-3, min_lr=1.0), "pass a smaller min_lr=X"),
    (lambda: DiagnoseOptions(batches=0), "pass batches=N"),
    (lambda: DiagnoseOptions(seq_len=1), "pass seq_len=N"),
    (lambda: DiagnoseOptions(theory="magic"), "pass theory=MODE"),
])
def test_library_messages_name_the_python_argument_never_a_flag(make, words):
    with pytest.raises(TinyLMError) as e:
        make()
    assert words in str(e.value) and "--" not in str(e.value)


def _flag_strings(root=None, packages=("tinylm", "diagnostics")) -> list[str]:
    """Strings in the library's code (tinylm/ and diagnostics/; docstrings and comments aside) that read like a flag."""
    import ast
    import re
    from pathlib import Path

    root = root or Path(__file__).resolve().parents[1]
    flag = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(-[a-z0-9]+)*\b")
    found = []
    for path in sorted(p for pkg in packages for p in (root / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        found += [f"{path.relative_to(root)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                  and flag.search(n.value)]
    return found


def test_no_library_module_spells_a_flag():
    """Flags are the command line's words: the one map from arguments to flags is reports.cli's."""
    assert not _flag_strings()


def test_the_flag_scan_finds_a_planted_flag(tmp_path):
    # negative control: a flag in a message is found, the same word in a docstring or an argument name is not
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "m.py").write_text('''"""Pass --seq-len on the command line."""\n'''
                                           "def f(seq_len):\n    raise ValueError(f'seq_len={seq_len}: pass --seq-len N')\n")
    found = _flag_strings(tmp_path, ("lib",))
    assert len(found) == 1 and "m.py:3" in found[0]


# ----------------------------------------------------------------------------- the command line's words


def test_flag_of_is_the_one_map():
    from reports.cli import flag_of

    assert flag_of("seq_len") == "--seq-len" and flag_of("steps") == "--steps" and flag_of("a_b_c") == "--a-b-c"
    assert flag_of("unsafe") == "--unsafe-load"


def test_in_flags_translates_advice_only():
    from reports.cli import in_flags

    flags = {"--seq-len": True, "--steps": True, "--batch-size": True, "--unsafe-load": False}
    assert in_flags("seq_len=1: must be an integer >= 2; pass seq_len=N (or None for the default)", flags) == \
        "seq_len=1: must be an integer >= 2; pass --seq-len N (or None for the default)"
    assert in_flags("iteration 5 >= steps=5; pass a larger steps=N", flags) == \
        "iteration 5 >= steps=5; pass a larger --steps N"
    assert in_flags("batch 4 x 8 would need 9 GiB; try batch_size=2", flags) == "batch 4 x 8 would need 9 GiB; try --batch-size 2"
    assert in_flags("p: pickled; rerun with unsafe=True (risk)", flags) == "p: pickled; rerun with --unsafe-load (risk)"
    # negative controls: a statement of a value, a name the command has no flag for, a keyword of a call
    for same in ("steps=0: must be an integer >= 1", "pass lr=X", "torch.load(p, weights_only=False)", "seq_len=None: x"):
        assert in_flags(same, flags) == same


def test_the_cli_says_flags_and_names_the_data_file(tmp_path, capsys):
    from reports.cli import main

    bad = tmp_path / "t.csv"
    bad.write_text("1,2,3")
    code = main(["train", "--preset", "tiny", "--steps", "1", "--data", str(bad), "-o", str(tmp_path / "m.pt")])
    err = capsys.readouterr().err
    assert code == 2 and f"--data {bad}: unknown suffix '.csv'" in err, err
    code = main(["train", "--preset", "tiny", "--steps", "0", "-o", str(tmp_path / "m.pt")])
    err = capsys.readouterr().err
    assert code == 2 and "steps=0: must be an integer >= 1; pass --steps N" in err, err


def test_a_library_warning_on_the_command_line_names_the_flag():
    import argparse
    import warnings

    from reports.cli import warnings_in_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--unsafe-load", action="store_true")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with warnings_in_flags(parser):
            warnings.warn("m.pt: loaded a whole pickled module (unsafe=True); its code ran on load")
        warnings.warn("outside: unsafe=True")  # negative control: outside the command, as the library said it
    assert [str(w.message) for w in shown] == [
        "m.pt: loaded a whole pickled module (--unsafe-load); its code ran on load", "outside: unsafe=True"]

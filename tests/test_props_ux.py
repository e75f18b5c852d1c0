"""`tinylm props` against a user's implementation, as a CS336 student meets it: found in the
current directory, a correct function without an optional argument skipped (not failed), a
wrong one shown with its claim and minimal example, skips grouped, progress reported."""

from __future__ import annotations

import io
import textwrap

import pytest
from rich.console import Console

from props import impl as impl_mod
from props.live import falsifying_example
from props.runner import missing_of, run_suite
from reports.cli import main
from reports.props_view import render_suite

# A CS336-style implementation: softmax right, cross_entropy right but without label_smoothing,
# log_softmax wrong (an offset), nothing else.
STUDENT = textwrap.dedent('''
    import torch

    def softmax(x, dim=-1):
        e = torch.exp(x - x.amax(dim, keepdim=True))
        return e / e.sum(dim, keepdim=True)

    def log_softmax(x, dim=-1):
        return x - torch.logsumexp(x, dim, keepdim=True) + 1e-3

    def cross_entropy(inputs, targets):
        lse = torch.logsumexp(inputs, -1)
        return (lse - inputs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).mean()
''')
SELECT = "cross_entropy_gradient or cross_entropy_smoothing_ends or log_softmax_stable or rmsnorm_formula"


@pytest.fixture
def student_dir(tmp_path, monkeypatch):
    (tmp_path / "student_lm.py").write_text(STUDENT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_student_implementation_reads_like_pytest(student_dir, capsys):
    """From the directory that holds it, without PYTHONPATH: the correct cross_entropy passes where
    it is called as the student wrote it and is skipped where a property passes label_smoothing;
    the wrong log_softmax fails with its claim and the falsifying input; skips are grouped."""
    seen = []
    run = run_suite(impl="student_lm", select=SELECT, on_progress=lambda *a: seen.append(a))
    by = {r.name: r for r in run.results}
    assert run.impl == "student_lm"
    assert by["cross_entropy_gradient"].outcome == "passed"
    smoothing = by["cross_entropy_smoothing_ends"]
    assert smoothing.outcome == "skipped" and smoothing.missing == ("cross_entropy(label_smoothing)",)
    stable = by["log_softmax_stable"]
    assert stable.outcome == "failed" and "z=tensor(" in stable.example and "impl=" not in stable.example
    assert by["rmsnorm_formula"].missing == ("rmsnorm",)
    # progress: one call per property, counting up to the total
    done = [a for a in seen if a[2]]
    assert [a[0] for a in done] == list(range(1, len(run.results) + 1)) and done[-1][1] == len(run.results)

    # the report: one screen, failure with claim and example, skips grouped by what is missing
    buf = io.StringIO()
    Console(width=100, file=buf, color_system=None).print(render_suite(run))
    out = buf.getvalue()
    flat = " ".join(out.split())
    assert "FAILED log_softmax_stable" in flat and "claim log_softmax(z) = z - logsumexp(z)" in flat
    assert "example z=tensor(" in flat
    assert "cross_entropy(label_smoothing) (" in flat and "rmsnorm (1) rmsnorm_formula" in flat
    assert "passed" not in out.split("FAILURES")[0]  # no table of passing rows without --verbose
    # the command line refuses a module that is not there, before running anything
    assert main(["props", "--impl", "student_lm_missing", "--no-progress"]) == 2
    assert "student_lm_missing" in capsys.readouterr().err


def test_impl_by_file_and_refusals(student_dir, tmp_path_factory):
    loaded = impl_mod.load("student_lm.py")
    assert loaded.provided() == ["softmax", "log_softmax", "cross_entropy"]
    assert loaded.spec.endswith("student_lm.py") and loaded.name == "student_lm.py"
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    import os

    os.chdir(elsewhere)  # the fixture's monkeypatch restores the directory
    with pytest.raises(impl_mod.ImplError, match="neither on the Python path nor in the current directory"):
        impl_mod.load("student_lm_not_here")
    with pytest.raises(impl_mod.ImplError, match="no such file"):
        impl_mod.load("nowhere/student_lm.py")


def test_signature_check_skips_only_what_the_signature_lacks():
    """The wrapper skips a call the signature cannot take and passes everything else through,
    errors raised inside the function included."""
    def cross_entropy(inputs, targets):
        raise ValueError("inside")

    wrapped = impl_mod.Implementation(type("M", (), {"cross_entropy": staticmethod(cross_entropy)})(), "m").cross_entropy
    with pytest.raises(pytest.skip.Exception, match=r"cross_entropy\(inputs, targets\) takes no label_smoothing"):
        wrapped(1, 2, label_smoothing=0.1)
    with pytest.raises(ValueError, match="inside"):  # a call it can take runs it
        wrapped(1, 2)
    assert missing_of("implementation 'm': cross_entropy(inputs, targets) takes no label_smoothing argument") \
        == ("cross_entropy(label_smoothing)",)
    assert missing_of("implementation 'm' provides no transformer_lm, init") == ("init", "transformer_lm")


def test_falsifying_example_is_read_from_hypothesis_notes():
    text = ("assert 5 < 5\nFalsifying example: test_a(\n    impl=Implementation('x'),\n"
            "    x=5,  # or any other generated value\n    data=data(...),\n)\nDraw 1: tensor([1.,\n 2.])\n")
    assert falsifying_example(text) == "x=5, drew tensor([1., 2.])"
    assert falsifying_example("AssertionError: no hypothesis here") == ""

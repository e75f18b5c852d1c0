"""The property suite's tooling: `tinylm props`, its rendering, the impl protocol and the mutation machinery."""

from __future__ import annotations

import io
import os
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from rich.console import Console

from props import impl as impl_mod
from props import mutate
from props.record import check, record
from props.runner import PropertyResult, SuiteRun, run_suite
from props.strategies import model_configs
from reports import cli
from reports.props_view import render_mutation, render_suite


def _render(obj) -> str:
    buf = io.StringIO()
    Console(width=100, file=buf, color_system=None).print(obj)
    return buf.getvalue()


def _fake_run(outcome: str = "passed") -> SuiteRun:
    rows = [
        PropertyResult("softmax_shift_exact", "test_softmax", "softmax(z + c) == softmax(z)", "passed", 25, 0.0, 0.0, "elements"),
        PropertyResult("truncnorm_samples", "test_init", "Var = 0.97334 s^2", outcome, 3, 1.234, 4.892, "|z|", 1e-6,
                       message="Var(x) = 1: |z|=7.1 vs 4.89" if outcome == "failed" else ""),
        PropertyResult("relu_derivatives", "test_activations", "relu' = 1[x > 0]", "passed", 25, 0.0, 0.0, "exact"),
        PropertyResult("rope_formula_and_norm", "test_attention", "RoPE rotates pairs", "skipped",
                       message="implementation 'mine' provides no rope"),
    ]
    return SuiteRun(rows, seconds=12.3, returncode=0 if outcome == "passed" else 1, impl="mine", profile="ci", max_examples=25)


def test_render_suite_rows_and_summary():
    out = _render(render_suite(_fake_run(), verbose=True))
    for text in ("softmax_shift_exact", "truncnorm_samples", "1e-06", "4.89", "1.23 |z|", "skipped", "provides no rope", "1[x > 0]"):
        assert text in out, text
    assert "ALL HOLD: 4 properties" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_render_suite_names_failure():
    run = _fake_run("failed")
    assert not run.ok
    out = _render(render_suite(run))
    assert "FAILURES" in out and "FAILED truncnorm_samples: Var(x) = 1" in out


def test_render_mutation_table():
    m = mutate.MUTANTS[0]
    base = mutate.MutantResult(mutate.BASELINE, False, [], 30.0)
    report = mutate.MutationReport(base, [mutate.MutantResult(m, True, ["softmax_rows_sum_to_one"], 20.0)], 50.0, 2)
    out = _render(render_mutation(report))
    assert m.name in out and "killed" in out and "softmax_rows_sum_to_one" in out and "passes" in out
    assert "EVERY MUTANT KILLED: 1/1" in out
    survived = mutate.MutationReport(base, [mutate.MutantResult(m, False, [], 20.0)], 50.0, 2)
    assert not survived.all_killed and "SURVIVED" in _render(render_mutation(survived))
    assert base.status == "passes" and mutate.MutantResult(mutate.BASELINE, True, ["x"], 1.0).status == "FAILS"
    assert "| `baseline (no mutation)` |" in report.to_markdown() and "| passes |" in report.to_markdown()


def test_record_is_noop_outside_a_run_and_check_fails_loudly():
    record(1.0, 2.0)  # no property running: nothing happens
    check(1.0, 2.0, "fine")
    with pytest.raises(AssertionError, match="too big"):
        check(3.0, 2.0, "too big")
    with pytest.raises(AssertionError):
        check(float("nan"), 2.0, "nan never passes")


@settings(max_examples=15)
@given(cfg=model_configs())
def test_model_configs_always_build(cfg):
    import tinylm

    model = tinylm.TransformerLM(cfg, generator=torch.Generator().manual_seed(0))
    assert model(torch.zeros(1, cfg.context_length, dtype=torch.long)).shape == (1, cfg.context_length, cfg.vocab_size)


def test_impl_load_errors_name_the_fix():
    with pytest.raises(impl_mod.ImplError, match="cannot import module 'no_such_module_xyz'"):
        impl_mod.load("no_such_module_xyz:thing")
    with pytest.raises(impl_mod.ImplError, match="has no attribute 'nope'"):
        impl_mod.load("math:nope")
    with pytest.raises(impl_mod.ImplError, match="provides none of the protocol"):
        impl_mod.load("json")
    tl = impl_mod.load(None)
    assert tl.name == "tinylm" and set(tl.provided()) == set(impl_mod.FUNCTIONS)


def test_cli_bad_input_exits_2(capsys):
    assert cli.main(["props", "--impl", "no_such_module_xyz"]) == 2
    err = capsys.readouterr().err
    assert "no_such_module_xyz" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["props", "--workers", "2"]) == 2
    assert "--mutate only" in capsys.readouterr().err
    assert cli.main(["props", "--mutate", "--only", "no-such-mutant"]) == 2
    assert "unknown mutant" in capsys.readouterr().err


def test_cli_runs_selected_properties(capsys):
    code = cli.main(["props", "-k", "softmax_rows_sum_to_one or xavier", "--verbose"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ALL HOLD: 2 properties (2 passed)" in " ".join(out.split())
    assert "softmax" in out and "xavier" in out  # names fold in an 80-column console


def test_user_impl_skips_missing_and_fails_wrong(tmp_path, monkeypatch):
    (tmp_path / "my_broken_lm.py").write_text(textwrap.dedent('''
        import torch
        def softmax(x, dim):            # no max shift: overflows at large logits
            e = torch.exp(x)
            return e / e.sum(dim, keepdim=True)
    '''))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    run = run_suite(impl="my_broken_lm", select="softmax_rows_sum_to_one or log_softmax_stable")
    by_name = {r.name: r for r in run.results}
    assert by_name["softmax_rows_sum_to_one"].outcome == "failed"
    assert by_name["log_softmax_stable"].outcome == "skipped"
    assert "provides no log_softmax" in by_name["log_softmax_stable"].message
    assert run.impl == "my_broken_lm" and not run.ok


# -- mutation machinery ----------------------------------------------------------------------------


def test_mutants_are_many_distinct_and_apply_to_current_source(tmp_path):
    names = [m.name for m in mutate.MUTANTS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    import tinylm

    original = {p.name: p.read_text() for p in Path(tinylm.__file__).parent.glob("*.py")}
    for i, m in enumerate(mutate.MUTANTS):
        dest = mutate.apply(m, tmp_path / str(i))
        patched = (dest / "tinylm" / m.file).read_text()
        assert patched != original[m.file] and m.new in patched, m.name
    # the installed tinylm is untouched
    assert {p.name: p.read_text() for p in Path(tinylm.__file__).parent.glob("*.py")} == original


def test_stale_mutant_is_reported_not_run(tmp_path):
    stale = mutate.Mutant("stale", "functional.py", "this text is not in the file", "x", "nothing")
    with pytest.raises(mutate.MutantError, match="occurs 0 times"):
        mutate.apply(stale, tmp_path)
    assert mutate.run_mutant(stale).status == "error"


def test_mutant_is_killed_by_its_property():
    m = next(m for m in mutate.MUTANTS if m.name == "softmax-no-max-shift")
    res = mutate.run_mutant(m, select="softmax_rows_sum_to_one or xavier_is_harmonic")
    assert res.killed and res.killers == ["softmax_rows_sum_to_one"], (res.killers, res.error, res.run and res.run.output_tail)
    assert "tinylm-mutant-" in res.run.tinylm_file  # the suite imported the mutated copy, not the repository's tinylm
    assert "xavier_is_harmonic_compromise" in {r.name for r in res.run.results if r.outcome == "passed"}

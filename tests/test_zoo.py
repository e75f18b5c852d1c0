"""The reduced pathology zoo: every quick case of benchmarks/verdict_zoo.py gets its verdict right.

Each case is a small model of known truth (healthy, or built to have one cause at a known
strength); the case is right when the diagnosis reports exactly the expected causes at the
expected worst severity. The whole zoo runs as ``python benchmarks/verdict_zoo.py``.
"""

import pytest

from benchmarks.verdict_zoo import CASES, confusion, run_case

QUICK = [c for c in CASES if c.quick]


def test_the_reduced_zoo_covers_health_and_every_cause():
    causes = {c.cause for c in QUICK}
    assert None in causes and {"score_scale", "saturated_attention", "dead_units", "init_scale", "no_norm",
                                "post_norm_depth", "non_finite", "kind_scale"} <= causes
    assert 12 <= len(QUICK) <= 16 and len(CASES) >= 40


@pytest.mark.parametrize("case", QUICK, ids=[c.name for c in QUICK])
def test_zoo_case_is_right(case):
    r = run_case(case)
    assert r["error"] is None, r["error"]
    assert r["right"], (f"expected {case.cause}/{case.severity}, got {r['causes']}/{r['severity']}: "
                        + " | ".join(r["messages"]))


def test_confusion_table_counts_a_wrong_case_off_the_diagonal():
    """Negative control of the scoring: a case labelled with the wrong cause is not right, and the
    confusion table puts it off the diagonal."""
    import dataclasses

    case = next(c for c in QUICK if c.cause == "no_norm")
    wrong = dataclasses.replace(case, cause="dead_units")
    r = run_case(wrong)
    assert r["error"] is None and not r["right"] and r["primary"] == "no_norm"
    table = confusion([r]).splitlines()
    assert table[0].split()[-1].startswith("no_norm") and table[1].startswith("dead_units")

"""replay on a Hugging Face Llama (transformers, built from a small config, no weights read): an
identical rerun is "identical", and flips in the rerun are found at their site, forward and
backward (a seeded subset of 4 each, every one must be found; the rates over 200 per direction
are benchmarks/bench_replay.py's; why a miss is not expected: tests/test_replay.py)."""

import pytest

pytest.importorskip("transformers")

from benchmarks.bench_replay import injection_sites, inject_once, llama_model, step_of, tokens  # noqa: E402
from diagnostics.jobs.replay import replay  # noqa: E402


def test_llama_rerun_identical_and_flips_found_at_their_site():
    model = llama_model(0)
    r = replay(model, step_of(model, tokens(0)))
    assert r.verdict == "identical", str(r)
    assert {row.site for row in r.rows} >= {"layers.0.attn", "layers.3.ffn", "final_norm", "logits"}
    sites = injection_sites(model)
    for direction, seed in (("forward", 300), ("backward", 400)):
        found = [inject_once(model, sites[(3 * i + 1) % len(sites)], direction, seed + i) for i in range(4)]
        assert all(hit and named for hit, named, _ in found), [t for h, n, t in found if not (h and n)]

"""``tinylm init``: every architectural choice of ModelConfig is a flag, and defaults are the preset's."""

from __future__ import annotations

import pytest

from clihelp import assert_one_line_error
from reports.cli import main
from tinylm import checkpoint


def test_the_gpt2_family_flags_reach_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "m.pt"
    assert main(["init", "--preset", "tiny", "--norm-kind", "layer", "--ffn", "gelu", "--positions", "learned",
                 "--bias", "-o", str(out)]) == 0
    config = checkpoint.load(out)[0].config
    assert (config.norm_kind, config.ffn, config.positions, config.bias) == ("layer", "gelu", "learned", True)
    assert config.init == "cs336"  # the tiny preset's own scheme


@pytest.mark.parametrize("preset, init", [("gpt2-tiny", "gpt2"), ("tiny", "cs336")])
def test_the_init_scheme_defaults_to_the_presets(tmp_path, capsys, preset, init):
    out = tmp_path / "m.pt"
    assert main(["init", "--preset", preset, "-o", str(out)]) == 0
    assert checkpoint.load(out)[0].config.init == init
    assert f"init {init}" in capsys.readouterr().out


def test_no_rope_contradicting_positions_is_one_line(tmp_path, capsys):
    code = main(["init", "--positions", "learned", "--no-rope", "-o", str(tmp_path / "m.pt")])
    assert_one_line_error(code, capsys.readouterr().err, "--no-rope", "--positions learned")
    assert not (tmp_path / "m.pt").exists()

"""The z-loss: ``tinylm.functional.z_loss``, ``TrainOptions.z_loss`` and ``tinylm train --z-loss``."""

from __future__ import annotations

import pytest
import torch

import tinylm
from clihelp import assert_one_line_error
from reports.cli import main
from tinylm import checkpoint
from tinylm.data import get_batch, stdlib_corpus
from tinylm.functional import logsumexp, z_loss
from tinylm.train import TrainError, TrainOptions, load_training


def test_z_loss_value_dtype_and_gradient():
    assert "z_loss" in tinylm.functional.__all__
    x = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    z = z_loss(x)
    lse = torch.logsumexp(x, -1, keepdim=True)
    assert torch.allclose(z, lse.pow(2).mean(), rtol=1e-14, atol=0)
    z.backward()
    assert torch.allclose(x.grad, 2 * lse * torch.softmax(x, -1) / 15, rtol=1e-12, atol=1e-15)
    low = (torch.randn(4, 9) * 30).bfloat16()
    assert z_loss(low).dtype == torch.float32  # log Z in float32 at least
    assert torch.allclose(z_loss(low), torch.logsumexp(low.float(), -1).pow(2).mean())
    assert float(z_loss(torch.log_softmax(torch.randn(4, 7, dtype=torch.float64), -1))) < 1e-28
    with pytest.raises(ValueError, match="last \\(class\\) dimension"):
        z_loss(torch.tensor(1.0))


def test_the_option_is_validated_and_old_options_read_as_off():
    with pytest.raises(TrainError) as e:
        TrainOptions(steps=1, z_loss=-1.0)
    assert str(e.value) == "z_loss=-1.0: must be a finite number >= 0.0; pass z_loss=X"
    with pytest.raises(TrainError, match="z_loss=nan"):
        TrainOptions(steps=1, z_loss=float("nan"))
    stored = TrainOptions(steps=5).to_dict()
    del stored["z_loss"]  # a checkpoint written before the option
    assert TrainOptions.from_dict(stored).z_loss == 0.0


def test_cli_refuses_a_negative_coefficient(tmp_path, capsys):
    code = main(["train", "--z-loss", "-0.5", "--steps", "1", "-o", str(tmp_path / "m.pt"), "--quiet"])
    assert_one_line_error(code, capsys.readouterr().err, "--z-loss", "-0.5", ">= 0")
    assert not (tmp_path / "m.pt").exists()


def _train(tmp_path, name: str, *extra: str) -> tuple[str, list[str]]:
    out = tmp_path / f"{name}.pt"
    argv = ["train", "--preset", "tiny", "--vocab-size", "256", "--d-model", "32", "--num-layers", "1",
            "--num-heads", "2", "--context-length", "16", "--batch-size", "8", "--steps", "30", "--watch-every", "0",
            "--seed", "0", "--threads", "1", "-o", str(out), *extra]
    assert main(argv) == 0
    return str(out)


def test_training_with_z_loss_pulls_log_z_towards_zero_and_reports_the_cross_entropy(tmp_path, capsys):
    plain, pulled = _train(tmp_path, "plain"), _train(tmp_path, "z", "--z-loss", "1")
    out = capsys.readouterr().out
    x, _ = get_batch(stdlib_corpus(), 16, 16, torch.Generator().manual_seed(123))

    def mean_abs_log_z(path: str) -> float:
        model, _ = checkpoint.load(path)
        with torch.no_grad():
            return float(logsumexp(model(x), -1).abs().mean())

    assert mean_abs_log_z(pulled) < mean_abs_log_z(plain) - 0.3, (mean_abs_log_z(pulled), mean_abs_log_z(plain))
    _, resume = load_training(pulled)
    assert resume["options"]["z_loss"] == 1.0  # a resumed run keeps its coefficient
    # the loss shown is the cross-entropy, near ln 256 = 5.5 at the start; the objective adds (log Z)^2, about 30
    firsts = [float(line.split("loss ")[1].split(" ->")[0]) for line in out.splitlines() if " -> " in line]
    assert len(firsts) == 2 and all(4.0 < f < 6.5 for f in firsts), out


def test_train_reports_the_cross_entropy_at_every_step():
    tokens = stdlib_corpus()
    c = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    seen: dict[float, list[float]] = {}
    for coef in (0.0, 1.0):
        model = tinylm.TransformerLM(c, generator=torch.Generator().manual_seed(0))
        losses = seen.setdefault(coef, [])
        tinylm.train.train(model, tokens, TrainOptions(steps=2, batch_size=4, watch_every=0, z_loss=coef),
                           on_step=lambda info: losses.append(info.loss))
    assert seen[0.0][0] == seen[1.0][0]  # step 1: the same weights and batch, the same cross-entropy
    assert seen[0.0][1] != seen[1.0][1]  # step 2: the z-loss changed the update

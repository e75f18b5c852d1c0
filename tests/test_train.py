"""Training: the CS336 schedule, option validation, loss falling, exact resume, checkpoints, the CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tinylm
from tinylm.data import DataError
from tinylm.train import TrainError, TrainOptions, load_training, lr_schedule
from diagnostics.jobs.watch import train_watched as train
from reports.cli import main

SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)


def small_model(seed: int = 0, **changes) -> tinylm.TransformerLM:
    return tinylm.TransformerLM(tinylm.ModelConfig(**{**SMALL, **changes}), generator=torch.Generator().manual_seed(seed))


def periodic_tokens(n: int = 4000, period: int = 7, vocab: int = 32) -> np.ndarray:
    """A stream a model can learn: a fixed random cycle of ``period`` token ids."""
    cycle = np.random.default_rng(0).integers(0, vocab, period)
    return np.resize(cycle, n).astype(np.int64)


# --------------------------------------------------------------------------- schedule


def test_schedule_warmup_is_linear_and_reaches_the_peak():
    lr, floor, warm, total = 1e-3, 1e-4, 10, 100
    got = [lr_schedule(t, lr, floor, warm, total) for t in range(warm)]
    assert got == pytest.approx([lr * (t + 1) / warm for t in range(warm)], rel=1e-12)
    assert lr_schedule(warm - 1, lr, floor, warm, total) == pytest.approx(lr)


def test_schedule_cosine_decays_to_the_floor_and_stays():
    lr, floor, warm, total = 1e-3, 1e-4, 10, 100
    assert lr_schedule(warm, lr, floor, warm, total) == pytest.approx(lr)
    mid = warm + (total - warm) // 2
    assert lr_schedule(mid, lr, floor, warm, total) == pytest.approx(floor + 0.5 * (lr - floor))
    after = [lr_schedule(t, lr, floor, warm, total) for t in range(warm, total + 5)]
    assert all(a >= b for a, b in zip(after, after[1:]))  # never rises after warmup
    assert lr_schedule(total, lr, floor, warm, total) == floor
    assert lr_schedule(total + 50, lr, floor, warm, total) == floor


def test_schedule_negative_control_a_linear_decay_differs():
    # a linear decay from lr to floor is a different schedule: the cosine's midpoint agrees but not its quarter point
    lr, floor, warm, total = 1e-3, 1e-4, 0, 100
    quarter = lr_schedule(25, lr, floor, warm, total)
    linear = lr - 0.25 * (lr - floor)
    assert abs(quarter - linear) > 0.05 * (lr - floor)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("changes, name", [
    (dict(steps=0), "steps=0"), (dict(steps=-3), "steps=-3"), (dict(lr=0.0), "lr=0.0"),
    (dict(lr=math.nan), "lr=nan"), (dict(batch_size=0), "batch_size=0"), (dict(clip=-1.0), "clip=-1.0"),
    (dict(min_lr=1.0, lr=1e-3), "min_lr=1.0"), (dict(beta2=1.0), "beta2=1.0"), (dict(watch_every=-1), "watch_every=-1"),
    (dict(spike_factor=1.0), "spike_factor=1.0"), (dict(steps=True), "steps=True"),
])
def test_bad_options_name_the_field(changes, name):
    with pytest.raises(TrainError, match=name.replace("(", r"\(")):
        TrainOptions(**{"steps": 10, **changes})


def test_data_outside_the_vocabulary_is_refused():
    model = small_model()
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        train(model, np.arange(100), TrainOptions(steps=1))
    with pytest.raises(DataError, match="fewer than context_length"):
        train(model, np.zeros(5, dtype=np.int64), TrainOptions(steps=1))


# --------------------------------------------------------------------------- training


def test_loss_falls_on_learnable_data():
    torch.manual_seed(0)
    model = small_model()
    r = train(model, periodic_tokens(), TrainOptions(steps=30, batch_size=8, lr=2e-2, watch_every=0))
    loss = r.history["series"]["loss"]
    assert len(loss) == 30 and r.iteration == 30
    first, last = np.mean(loss[:5]), np.mean(loss[-5:])
    # the start is near ln V (uniform guess); a 7-cycle is predictable after one period: the loss must drop far below it
    assert first > 0.7 * math.log(32)
    assert last < 0.3 * first, (first, last)


def _grad_norm(model) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))


def test_clipping_bounds_the_global_gradient_norm():
    clip = 1e-3
    r = train(small_model(), periodic_tokens(), TrainOptions(steps=2, batch_size=4, clip=clip, watch_every=0))
    # the gradients the last optimizer step used are left on the parameters: clipped to the global norm
    assert _grad_norm(r.model) <= clip * (1 + 1e-5)
    # the reported norm is the one before clipping
    assert r.history["series"]["grad_norm"][-1] > clip


def test_clipping_negative_control_clip_0_leaves_the_gradient():
    r = train(small_model(), periodic_tokens(), TrainOptions(steps=2, batch_size=4, clip=0.0, watch_every=0))
    assert _grad_norm(r.model) == pytest.approx(r.history["series"]["grad_norm"][-1], rel=1e-5)
    assert _grad_norm(r.model) > 1e-3


def test_resume_reproduces_an_uninterrupted_run_exactly(tmp_path):
    tokens = periodic_tokens()
    opts = TrainOptions(steps=8, batch_size=4, lr=3e-3, watch_every=3, warmup=2, checkpoint_every=4)
    straight = train(small_model(), tokens, opts, output=tmp_path / "straight.pt")

    class Stop(Exception):
        pass

    def stop_after_4(info):
        if info.step == 5:  # the checkpoint at iteration 4 is on disk; die in step 5
            raise Stop

    with pytest.raises(Stop):
        train(small_model(), tokens, opts, output=tmp_path / "crashed.pt", on_step=stop_after_4)
    model, resume = load_training(tmp_path / "crashed.pt")
    assert resume["iteration"] == 4
    resumed = train(model, tokens, opts, output=tmp_path / "crashed.pt", resume=resume)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.history["series"]["loss"] == straight.history["series"]["loss"]
    assert [r["step"] for r in resumed.history["records"]] == [r["step"] for r in straight.history["records"]] == [0, 3, 6]


def test_resume_negative_control_another_seed_differs(tmp_path):
    tokens = periodic_tokens()
    a = train(small_model(), tokens, TrainOptions(steps=4, batch_size=4, seed=0, watch_every=0))
    b = train(small_model(), tokens, TrainOptions(steps=4, batch_size=4, seed=1, watch_every=0))
    assert a.history["series"]["loss"][1:] != b.history["series"]["loss"][1:]


def test_checkpoint_is_weights_only_and_loads_as_a_model(tmp_path):
    path = tmp_path / "m.pt"
    r = train(small_model(), periodic_tokens(), TrainOptions(steps=3, batch_size=2, watch_every=1), output=path)
    obj = torch.load(path, weights_only=True)
    assert obj["format"] == "tinylm" and obj["iteration"] == 3
    assert obj["history"]["format"] == "tinylm-watch" and len(obj["history"]["records"]) == 3
    assert set(obj["optimizer"]) == {"state", "param_groups"}
    model, info = tinylm.checkpoint.load(path)
    assert info.iteration == 3 and info.history["records"][0]["step"] == 0
    for (name, a), b in zip(r.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_already_finished_checkpoint_asks_for_more_steps(tmp_path):
    path = tmp_path / "m.pt"
    train(small_model(), periodic_tokens(), TrainOptions(steps=2, batch_size=2, watch_every=0), output=path)
    model, resume = load_training(path)
    with pytest.raises(TrainError, match="larger steps=N"):
        train(model, periodic_tokens(), TrainOptions(steps=2, batch_size=2), resume=resume)


# --------------------------------------------------------------------------- command line


def _cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_trains_resumes_and_exports(tmp_path, capsys):
    data = tmp_path / "tokens.npy"
    np.save(data, periodic_tokens(3000, vocab=256).astype(np.uint16))
    out = tmp_path / "m.pt"
    common = ["--data", str(data), "--batch-size", "4", "--watch-every", "2", "--lr", "1e-2"]
    code, text, err = _cli(["train", "--preset", "tiny", "--vocab-size", "256", "--d-model", "16", "--num-layers", "2",
                            "--steps", "6", "-o", str(out), *common,
                            "--watch-json", str(tmp_path / "w.json"), "--watch-csv", str(tmp_path / "w.csv")], capsys)
    assert code == 0, err
    assert "6 steps" in text and "wrote" in text
    import json

    hist = json.loads((tmp_path / "w.json").read_text())
    assert [r["step"] for r in hist["records"]] == [0, 2, 4]
    import pandas as pd

    from diagnostics.result import COLUMNS

    rows = pd.read_csv(tmp_path / "w.csv")  # the one tidy schema: a forward variance per record and site
    assert tuple(rows.columns) == COLUMNS
    var = rows[(rows["statistic"] == "var") & (rows["direction"] == "forward")]
    assert len(var) == 3 * len(hist["sites"]) and sorted(set(var["step"])) == [0, 2, 4]
    assert len(rows[rows["statistic"] == "loss"]) == 6
    # resume: the stored data path and options are used; only --steps changes
    code, text, err = _cli(["train", "--resume", str(out), "--steps", "8", "-o", str(out)], capsys)
    assert code == 0, err
    assert "resuming from" in text and "at iteration 6" in text
    model, info = tinylm.checkpoint.load(out)
    assert info.iteration == 8 and len(info.history["series"]["loss"]) == 8


@pytest.mark.parametrize("args, needle", [
    (["--steps", "0"], "steps=0"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--init", "nope"], "nope"),
    (["--vocab-size", "100"], "vocab_size=100"),
    (["--lr", "-1"], "lr=-1.0"),
    (["--data", "/nonexistent/tokens.npy"], "no such file"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, args, needle):
    code, text, err = _cli(["train", "-o", str(tmp_path / "m.pt"), *args], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("tinylm: error:") and needle in err, err
    assert not (tmp_path / "m.pt").exists()


def test_cli_refuses_data_beyond_the_vocabulary(tmp_path, capsys):
    data = tmp_path / "big.npy"
    np.save(data, np.array([1, 2, 3, 300] * 10, dtype=np.uint16))
    code, _, err = _cli(["train", "--vocab-size", "256", "--data", str(data), "-o", str(tmp_path / "m.pt")], capsys)
    assert code == 2 and "token id 300" in err


def test_cli_refuses_to_overwrite_and_to_reshape_a_resumed_model(tmp_path, capsys):
    out = tmp_path / "m.pt"
    out.write_bytes(b"keep me")
    code, _, err = _cli(["train", "--steps", "1", "-o", str(out)], capsys)
    assert code == 2 and "--force" in err and out.read_bytes() == b"keep me"
    code, _, err = _cli(["train", "--resume", str(out), "--norm", "post", "-o", str(tmp_path / "n.pt")], capsys)
    assert code == 2 and "--norm" in err

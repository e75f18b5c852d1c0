"""The watch as a Lightning callback: real ``lightning.pytorch.Trainer.fit`` runs on the CPU of
a tiny tinylm model wrapped in a LightningModule (one epoch of a few dozen steps, no
checkpointing, no progress bar): records at the expected steps with finite statistics, the
watch's step numbering and loss against what ``training_step`` logged through the trainer's
logger, the record's scalars in that logger; an accumulated step against one step of the
whole batch (the same moments); the stop signal at a non-finite loss, with the clean run as
its negative control; the ImportError naming the extra."""

from __future__ import annotations

import importlib
import math
import sys

import pandas as pd
import pytest
import torch

L = pytest.importorskip("lightning.pytorch", reason='the lightning extra: pip install -e ".[lightning]"')

import tinylm  # noqa: E402
from diagnostics.integrations.lightning import WatchCallback  # noqa: E402
from tinylm import functional as F  # noqa: E402

SMALL = dict(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)
B, T, D = 2, 8, 16


class LM(L.LightningModule):
    """A tinylm model kept as ``self.model``; each micro-batch's loss kept in ``losses``."""

    def __init__(self):
        super().__init__()
        self.model = tinylm.TransformerLM(tinylm.ModelConfig(**SMALL), generator=torch.Generator().manual_seed(0))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = F.cross_entropy(self.model(x[:, :-1]), x[:, 1:])
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def batches(n: int, batch: int = B):
    tokens = torch.randint(0, 32, (n, T + 1), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=batch)


def fit(module, callback, data, logger=False, accumulate: int = 1):
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, logger=logger, log_every_n_steps=1,
                        accumulate_grad_batches=accumulate, callbacks=[callback])
    trainer.fit(module, data)
    return trainer


def test_a_fit_records_the_watch_at_its_steps(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module = LM()
    cb = WatchCallback(every=5, log_dir=tmp_path / "watch")
    trainer = fit(module, cb, batches(24 * B), logger=CSVLogger(tmp_path / "logs"))
    h = cb.watch.history
    assert trainer.global_step == 24 and h["series"]["step"] == list(range(24))
    assert [r["step"] for r in h["records"]] == [0, 5, 10, 15, 20]
    assert h["sites"] == ["model.token_embeddings", "model.layers.0", "model.layers.1", "model.lm_head"]
    assert h["series"]["loss"] == pytest.approx(module.losses, rel=1e-6)
    logged = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")
    train_loss = logged[["step", "train_loss"]].dropna()
    assert train_loss["step"].tolist() == h["series"]["step"]  # training_step's logs carry the watch's step
    assert train_loss["train_loss"].tolist() == pytest.approx(h["series"]["loss"], rel=1e-6)
    for rec in h["records"]:
        assert math.isfinite(rec["grad_norm"]) and rec["grad_norm"] > 0 and rec["lr"] == 1e-2
        for site, st in rec["stats"].items():
            assert st["count"] == B * T * (32 if site == "model.lm_head" else D)
            assert all(math.isfinite(st[k]) for k in ("fwd_mean", "fwd_var", "grad_mean", "grad_var")), site
            assert st["fwd_var"] > 0 and st["grad_var"] > 0
        assert set(rec["update_ratio"]) == {n for n, _ in module.named_parameters()}
        assert all(r > 0 for r in rec["update_ratio"].values())
    recorded = {r["step"] for r in h["records"]}
    assert all(math.isnan(g) for t, g in zip(h["series"]["step"], h["series"]["grad_norm"]) if t not in recorded)
    # each record's scalars in the trainer's logger, at the record's step
    var = logged[["step", "watch/gradient_var/model.lm_head"]].dropna()
    assert var["step"].tolist() == [0, 5, 10, 15, 20]
    assert var["watch/gradient_var/model.lm_head"].tolist() == pytest.approx(
        [r["stats"]["model.lm_head"]["grad_var"] for r in h["records"]], rel=1e-6)
    assert cb.failure is None  # the negative control of the stop test below
    assert all(not m._forward_hooks and not m._backward_hooks for m in module.modules())
    assert (tmp_path / "watch" / "watch.csv").is_file()


def test_an_accumulated_step_reads_as_one_step_of_the_whole_batch():
    """accumulate_grad_batches=3 over batches of 2 against batches of 6 without accumulation, on
    the same sequences: the same steps (moments forward and backward equal up to rounding,
    the same grad_norm), and each step's loss the mean of its micro-batches' losses."""
    acc_module, acc = LM(), WatchCallback(every=2)
    trainer = fit(acc_module, acc, batches(24 * B), accumulate=3)
    whole = WatchCallback(every=2)
    fit(LM(), whole, batches(24 * B, batch=3 * B))
    h, w = acc.watch.history, whole.watch.history
    assert trainer.global_step == 8 and h["series"]["step"] == list(range(8))
    assert [r["step"] for r in h["records"]] == [r["step"] for r in w["records"]] == [0, 2, 4, 6]
    micro = acc_module.losses
    assert h["series"]["loss"] == pytest.approx([sum(micro[3 * t:3 * t + 3]) / 3 for t in range(8)], rel=1e-6)
    for ra, rw in zip(h["records"], w["records"]):
        assert ra["grad_norm"] == pytest.approx(rw["grad_norm"], rel=1e-5)
        for site, st in ra["stats"].items():
            assert st["count"] == rw["stats"][site]["count"] == 3 * B * T * (32 if site == "model.lm_head" else D)
            for key in ("fwd_var", "grad_var"):
                assert st[key] == pytest.approx(rw["stats"][site][key], rel=1e-4), (ra["step"], site, key)
            for key, var in (("fwd_mean", "fwd_var"), ("grad_mean", "grad_var")):  # a mean near 0: rounding
                noise = 1e-5 * math.sqrt(rw["stats"][site][var])
                assert st[key] == pytest.approx(rw["stats"][site][key], rel=1e-4, abs=noise), (ra["step"], site, key)


def test_stop_signal_ends_the_fit_at_a_nonfinite_loss():
    module = LM()
    with torch.no_grad():
        module.model.layers[0].ffn.w1.weight[0, 0] = float("nan")
    cb = WatchCallback(every=2, stop="signal")
    trainer = fit(module, cb, batches(24 * B))
    assert trainer.global_step == 1  # stopped after the first step
    assert cb.failure is not None and cb.failure.step == 0 and cb.failure.verdict == "non_finite"
    assert cb.watch.history["events"][0]["kind"] == "nonfinite"


def test_stop_raise_leaves_no_hook_and_closes_the_writers(tmp_path):
    from diagnostics import WatchStop

    module = LM()
    with torch.no_grad():
        module.model.layers[0].ffn.w1.weight[0, 0] = float("nan")
    cb = WatchCallback(every=2, stop="raise", log_dir=tmp_path / "watch")
    with pytest.raises(WatchStop, match="step 0: .* not finite") as stopped:
        fit(module, cb, batches(24 * B))
    assert cb.failure is stopped.value.failure and cb.failure.step == 0
    assert all(not m._forward_hooks and not m._backward_hooks for m in module.modules())
    assert cb.watch.writers == []  # closed (files flushed)
    assert '"type": "event"' in (tmp_path / "watch" / "watch.jsonl").read_text()


def test_a_missing_lightning_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "diagnostics.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r'pip install "tinylm\[lightning\]"'):
        importlib.import_module("diagnostics.integrations.lightning")

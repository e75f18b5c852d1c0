"""The optimizer's figures of a recorded step (diagnostics.measure.optimizer, Watch(optimizer=)).

Each figure against a plain-torch float64 reference computed here from copies of the weights
and gradients taken around the step: eps_share = share of Adam's entries with sqrt(v_hat) < eps,
alignment = cos(Delta W, -g) over all parameters flattened together, alignment_min = the
smallest per-matrix cosine. Controls: plain SGD's update is -lr g (alignment 1, no Adam state:
eps_share NaN), weight decay turns it away from -g (below 1); a large eps makes nearly every
entry eps-dominated and a small one almost none. The watch carries the figures into its
records with no host transfer of their own, removes its optimizer hook on close, and refuses
what is not an optimizer of the model in one line. The trainer callbacks (Hugging Face,
Lightning) and train_watched pass their optimizer; a 2-rank gloo run checks the merge over
DDP ranks and over FSDP2 shards (bounded in time).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tinylm
from diagnostics import OptionsError, Watch
from diagnostics.jobs.history import History, OPTIMIZER_KEYS, check_history, to_rows
from diagnostics.measure.optimizer import OptimizerSignals, optimizer_signals, usable_optimizer
from diagnostics.measure.transfers import TransferCounter

CFG = tinylm.ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=32)


def _model(dtype=torch.float32):
    return tinylm.TransformerLM(CFG, generator=torch.Generator().manual_seed(0)).to(dtype)


def _x(t: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(10 + t))


def _loss(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def reference(opt: torch.optim.Optimizer, named: dict, w0: dict, g: dict) -> dict[str, float]:
    """The three figures in plain float64 torch: ``w0``, ``g`` copies (float64) of the weights and
    gradients before the step, ``named`` the parameters after it."""
    small = total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p) or {}
            if "exp_avg_sq" not in st or "betas" not in group:
                continue
            step = float(st["step"])
            v_hat = st["exp_avg_sq"].double() / (1 - group["betas"][1] ** step)
            small += int((v_hat.sqrt() < group["eps"]).sum())
            total += v_hat.numel()
    dw = {n: named[n].detach().double() - w0[n] for n in g}
    flat_d = torch.cat([dw[n].flatten() for n in g])
    flat_g = torch.cat([g[n].flatten() for n in g])

    def cos(a, b):
        return float(-(a @ b) / (a.norm() * b.norm()))

    each = [cos(dw[n].flatten(), g[n].flatten()) for n in g if g[n].ndim >= 2]
    return {"eps_share": small / total if total else math.nan, "alignment": cos(flat_d, flat_g),
            "alignment_min": min(each)}


def watched_loop(make_opt, steps: int = 3, every: int = 1, dtype=torch.float32, closure: bool = False):
    """The README loop with Watch(optimizer=opt); returns (records, the reference of each step)."""
    model = _model(dtype)
    named = dict(model.named_parameters())
    opt = make_opt(model.parameters())
    watch = Watch(model, every=every, optimizer=opt)
    refs = []
    for t in range(steps):
        x = _x(t)
        seen = {}

        def step_closure():
            opt.zero_grad()
            loss = _loss(model, x)
            loss.backward()
            seen["g"] = {n: p.grad.detach().double().clone() for n, p in named.items() if p.grad is not None}
            return loss

        with watch.step(t):
            w0 = {n: p.detach().double().clone() for n, p in named.items()}
            if closure:
                loss = opt.step(step_closure)
            else:
                loss = step_closure()
                opt.step()
            refs.append(reference(opt, named, w0, seen["g"]))
            opt.zero_grad()
        watch.record(loss, lr=opt.param_groups[0]["lr"])
    watch.close()
    return watch.history["records"], refs


def _same(got: dict, want: dict, rel: float = 1e-9) -> None:
    assert set(got) == set(OPTIMIZER_KEYS)
    for k in OPTIMIZER_KEYS:
        if math.isnan(want[k]):
            assert math.isnan(got[k]), k
        else:
            assert got[k] == pytest.approx(want[k], rel=rel, abs=1e-12), k


ADAMS = [
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True), id="adamw-foreach"),
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False), id="adamw-loop"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True), id="adam-foreach"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, betas=(0.8, 0.95)), id="adam-loop"),
]


@pytest.mark.parametrize("make_opt", ADAMS)
def test_adam_figures_equal_the_float64_reference(make_opt):
    records, refs = watched_loop(make_opt)
    assert [r["step"] for r in records] == [0, 1, 2]
    for rec, ref in zip(records, refs):
        _same(rec["optimizer"], ref)
        assert 0 <= rec["optimizer"]["eps_share"] < 0.5
        assert -1 <= rec["optimizer"]["alignment_min"] <= 1 and -1 <= rec["optimizer"]["alignment"] <= 1


def test_eps_share_near_one_for_a_large_eps_and_near_zero_for_a_small_one():
    """The negative control: the same run, eps 1e-1 against 1e-8 (entries whose gradient is 0,
    such as the embedding rows of absent tokens, stay below any eps)."""
    large, ref = watched_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-1), steps=2)
    small, _ = watched_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-8), steps=2)
    _same(large[-1]["optimizer"], ref[-1])
    assert large[-1]["optimizer"]["eps_share"] > 0.95
    assert small[-1]["optimizer"]["eps_share"] < 0.2


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-9)])
def test_plain_sgd_is_aligned_exactly_and_has_no_eps_share(dtype, tol):
    records, refs = watched_loop(lambda ps: torch.optim.SGD(ps, lr=0.1), dtype=dtype)
    for rec, ref in zip(records, refs):
        _same(rec["optimizer"], ref)
        assert math.isnan(rec["optimizer"]["eps_share"])  # no exp_avg_sq
        assert abs(rec["optimizer"]["alignment"] - 1) < tol  # Delta W = -lr g
        assert abs(rec["optimizer"]["alignment_min"] - 1) < tol


def test_weight_decay_and_momentum_turn_the_update_away_from_the_gradient():
    decayed, refs = watched_loop(lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.5))
    for rec, ref in zip(decayed, refs):
        _same(rec["optimizer"], ref)
        assert rec["optimizer"]["alignment"] < 1 - 1e-6
    momentum, refs = watched_loop(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert momentum[0]["optimizer"]["alignment"] == pytest.approx(1, abs=1e-9)  # no history yet
    assert momentum[-1]["optimizer"]["alignment"] < 1 - 1e-6
    _same(momentum[-1]["optimizer"], refs[-1])


def test_a_closure_step_is_measured_on_the_gradient_it_computes():
    """opt.step(closure) runs the backward inside the step (as Lightning does): the figures
    still describe that step's gradient."""
    records, refs = watched_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-2), closure=True)
    assert len(records) == len(refs) >= 2  # every step recorded and measured: zip drops nothing
    for rec, ref in zip(records, refs):
        _same(rec["optimizer"], ref)


def test_only_recorded_steps_carry_figures_and_a_step_without_update_is_nan():
    records, refs = watched_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps=5, every=2)
    assert [r["step"] for r in records] == [0, 2, 4]
    for rec, ref in zip(records, refs[::2]):
        _same(rec["optimizer"], ref)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    watch = Watch(model, every=1, optimizer=opt)
    for t in range(2):
        with watch.step(t):
            loss = _loss(model, _x(t))
            loss.backward()
            if t == 0:
                opt.step()
            opt.zero_grad()
        watch.record(loss)
    watch.close()
    first, skipped = (r["optimizer"] for r in watch.history["records"])
    assert math.isfinite(first["alignment"])
    assert math.isnan(skipped["alignment"]) and math.isnan(skipped["alignment_min"])  # no step: no gradient seen
    assert skipped["eps_share"] == pytest.approx(first["eps_share"])  # the state as the last step left it


def test_the_signals_alone_equal_the_reference():
    """OptimizerSignals without the watch: arm with the weights before, vector after the step, figures."""
    model = _model()
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    signals = OptimizerSignals(opt, named)
    for t in range(2):
        before = signals.arm({n: p.detach().clone() for n, p in named.items()})
        _loss(model, _x(t)).backward()
        g = {n: p.grad.detach().double().clone() for n, p in named.items()}
        opt.step()
        vec = signals.vector()
        assert vec.dtype == torch.float64 and vec.shape == (2 + 3 * len(named),)
        _same(signals.figures(vec), reference(opt, named, {n: b.double() for n, b in before.items()}, g))
        opt.zero_grad()
    signals.close()
    assert not opt._optimizer_step_post_hooks


def _transfers(with_optimizer: bool) -> list[int]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    watch = Watch(model, every=2, optimizer=opt if with_optimizer else None)
    counts = []
    for t in range(2):
        x = _x(t)
        with TransferCounter() as c:
            with watch.step(t):
                loss = _loss(model, x)
                loss.backward()
                opt.step()
                opt.zero_grad()
            watch.record(loss, lr=1e-2)
        counts.append(c.total)
    assert ("optimizer" in watch.history["records"][0]) == with_optimizer
    watch.close()
    return counts


def test_the_figures_travel_in_the_step_s_one_transfer():
    """A recorded step (0) and one not recorded (1) make the same transfers with the optimizer's
    figures as without them: they move in the record's one exchange."""
    assert _transfers(True) == _transfers(False)


def test_close_removes_the_optimizer_hook_and_nothing_else_is_left():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    watch = Watch(model, every=1, optimizer=opt)
    assert len(opt._optimizer_step_post_hooks) == 1
    with watch.step(0):
        _loss(model, _x(0)).backward()
        opt.step()
    watch.close()
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks
    assert "optimizer" in watch.history["records"][0]
    opt.step()  # still steps after the watch is gone


def test_a_bad_optimizer_is_refused_in_one_line():
    model = _model()
    for bad, says in (("adam", "optimizer=str: must be a torch.optim.Optimizer"),
                      (torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1),
                       "optimizer=SGD: must hold some of the watched parameters")):
        with pytest.raises(OptionsError) as e:
            Watch(model, optimizer=bad)
        assert str(e.value).startswith(says) and "\n" not in str(e.value) and "; pass " in str(e.value)
    assert optimizer_signals(None, dict(model.named_parameters())).record() == {}
    assert usable_optimizer("not one", model) is None
    assert usable_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), model) is None
    from tinylm.train import TrainError, TrainOptions, train

    with pytest.raises(TrainError, match=r"^optimizer=str: must be a torch.optim.Optimizer"):
        train(model, np.tile(np.arange(32), 40), TrainOptions(steps=1, batch_size=2), optimizer="adam")


def test_history_keeps_checks_and_tidies_the_optimizer_figures():
    records, _ = watched_loop(lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps=2)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    watch = Watch(model, every=1, optimizer=opt)
    with watch.step(0):
        loss = _loss(model, _x(0))
        loss.backward()
        opt.step()
    watch.record(loss)
    watch.close()
    h = watch.history
    assert check_history(h) == (h, None)
    rows = [r for r in to_rows(h) if r.kind == "optimizer"]
    assert [(r.step, r.name, r.statistic) for r in rows] == [(0, None, k) for k in OPTIMIZER_KEYS]
    assert [r.value for r in rows] == [h["records"][0]["optimizer"][k] for k in OPTIMIZER_KEYS]
    assert [r.statistic for r in History(h).to_rows() if r.kind == "optimizer"] == list(OPTIMIZER_KEYS)
    # optional: a record without it reads as before; a damaged one is refused
    del h["records"][0]["optimizer"]
    assert check_history(h)[1] is None and not [r for r in to_rows(h) if r.kind == "optimizer"]
    for bad in ("x", {"eps_share": "high"}):
        h["records"][0]["optimizer"] = bad
        got, why = check_history(h)
        assert got is None and "records[0].optimizer" in why


def test_train_watched_measures_the_run_s_optimizer():
    from diagnostics.jobs.watch import train_watched
    from tinylm.train import TrainOptions

    tokens = np.tile(np.arange(32), 40)
    r = train_watched(_model(), tokens, TrainOptions(steps=4, batch_size=4, watch_every=2))
    recs = r.history["records"]
    assert [rec["step"] for rec in recs] == [0, 2]
    for rec in recs:
        f = rec["optimizer"]
        assert 0 <= f["eps_share"] <= 1 and -1 <= f["alignment_min"] <= 1 and -1 <= f["alignment"] <= 1
    assert not r.optimizer._optimizer_step_post_hooks  # train closes the watch


def test_hf_trainer_passes_its_optimizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from diagnostics.integrations.hf import WatchCallback

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            x = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x}

    cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                          disable_tqdm=True, learning_rate=1e-2)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)  # clipped or not, its update is -lr g
    cb = WatchCallback(every=1)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb],
                         optimizers=(sgd, None)).train()
    recs = cb.watch.history["records"]
    assert [r["step"] for r in recs] == [1, 2]
    for rec in recs:
        assert math.isnan(rec["optimizer"]["eps_share"])
        assert rec["optimizer"]["alignment"] == pytest.approx(1, abs=1e-9)
    assert not sgd._optimizer_step_post_hooks


def test_lightning_passes_its_optimizer():
    L = pytest.importorskip("lightning.pytorch")
    from diagnostics.integrations.lightning import WatchCallback

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def training_step(self, batch, batch_idx):
            return _loss(self.model, batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    tokens = torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
    cb = WatchCallback(every=2, log_to_logger=False)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(LM(), data)
    recs = cb.watch.history["records"]
    assert [r["step"] for r in recs] == [0, 2]
    for rec in recs:  # the step runs the backward in a closure: the post-step hook sees its gradient
        assert rec["optimizer"]["alignment"] == pytest.approx(1, abs=1e-9)
    assert not trainer.optimizers[0]._optimizer_step_post_hooks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_measurement_leaves_the_training_as_it_was(dtype):
    """The same loop with and without optimizer=: the same weights to the bit (the figures are
    read, never written back)."""
    finals = []
    for with_optimizer in (False, True):
        model = _model(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        watch = Watch(model, every=1, optimizer=opt if with_optimizer else None)
        for t in range(2):
            with watch.step(t):
                loss = _loss(model, _x(t))
                loss.backward()
                opt.step()
                opt.zero_grad()
            watch.record(loss)
        watch.close()
        finals.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])


# --------------------------------------------------------------------------- two ranks (gloo)

def _rank_batch(rank: int, t: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(100 * t + rank))


def _watched(model, opt, batches) -> list[dict]:
    watch = Watch(model, every=1, optimizer=opt)
    for t, x in enumerate(batches):
        with watch.step(t):
            loss = _loss(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        watch.record(loss)
    watch.close()
    assert not opt._optimizer_step_post_hooks
    return [r["optimizer"] for r in watch.history["records"]]


def _references(batches_of_step) -> list[dict]:
    """One process: AdamW steps on the mean of the given batches' losses; each step's figures."""
    model = _model()
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    refs = []
    for xs in batches_of_step:
        w0 = {n: p.detach().double().clone() for n, p in named.items()}
        (sum(_loss(model, x) for x in xs) / len(xs)).backward()
        g = {n: p.grad.detach().double().clone() for n, p in named.items()}
        opt.step()
        refs.append(reference(opt, named, w0, g))
        opt.zero_grad()
    return refs


def _two_ranks(rank: int, port: int, out: str) -> None:
    import datetime
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        got = {"ddp": _watched(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2),
                               [_rank_batch(rank, t) for t in range(2)])}
        model, mesh = _model(), init_device_mesh("cpu", (2,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        got["fsdp"] = _watched(model, torch.optim.AdamW(model.parameters(), lr=1e-2), [_x(t) for t in range(2)])
        dist.barrier()
        torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_merge_the_figures_of_ddp_replicas_and_fsdp2_shards(tmp_path):
    """DDP (each rank its own batch; the step descends their mean) and FSDP2 (the same batch on
    both ranks; every parameter a DTensor): every rank holds the figures one process computes."""
    from test_watch_ddp import _free_port, run_bounded

    run_bounded(_two_ranks, (_free_port(), str(tmp_path)), limit_s=150)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0 == r1 or all(math.isnan(a[k]) and math.isnan(b[k]) or a[k] == b[k]
                           for part in r0 for a, b in zip(r0[part], r1[part]) for k in a)
    ddp_refs = _references([[_rank_batch(0, t), _rank_batch(1, t)] for t in range(2)])
    fsdp_refs = _references([[_x(t)] for t in range(2)])
    for got, want in zip(r0["ddp"], ddp_refs):
        assert got["eps_share"] == pytest.approx(want["eps_share"], abs=1e-3)
        assert got["alignment"] == pytest.approx(want["alignment"], rel=1e-5)
        assert got["alignment_min"] == pytest.approx(want["alignment_min"], rel=1e-5)
    for got, want in zip(r0["fsdp"], fsdp_refs):
        _same(got, want, rel=1e-6)

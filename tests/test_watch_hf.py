"""The watch as a Hugging Face Trainer callback: a real ``transformers.Trainer`` run of a few
steps on a tiny GPT-2 built from a config (random weights, nothing downloaded), with gradient
accumulation; the history it recorded against the Trainer's own log, step for step (its
numbering, its loss, its grad_norm at the steps it logs); what an accumulated step measures
(the whole batch's step, exactly); the stop signal at a non-finite loss, with the clean run
as its negative control."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason='the hf extra: pip install -e ".[hf]"')
pytest.importorskip("accelerate", reason='the hf extra: pip install -e ".[hf]"')

from diagnostics.integrations.hf import WatchCallback  # noqa: E402

V, T, D, B, ACC, STEPS = 32, 8, 16, 4, 2, 4


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


class OneSequence(Tokens):
    """Every item the same sequence: every micro-batch of a step holds the same tokens."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return super().__getitem__(0)


def tiny_gpt2(dropout: float = 0.1):
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=2, n_head=2, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def train(model, callback, tmp_path, steps=STEPS, batch=B, acc=ACC, logging_steps=1, data=None):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=acc, logging_steps=logging_steps, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data or Tokens(), callbacks=[callback])
    trainer.train()
    return trainer


def test_a_trainer_run_records_the_watch(tmp_path):
    model = tiny_gpt2()
    cb = WatchCallback(every=2, log_dir=tmp_path / "watch")
    trainer = train(model, cb, tmp_path)
    h = cb.watch.history
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    assert len(logs) == STEPS and trainer.state.global_step == STEPS
    assert h["series"]["step"] == [e["step"] for e in logs] == list(range(1, STEPS + 1))  # the Trainer's numbering
    # the loss of each step as the Trainer reports it (the sum over micro-batches of losses
    # normalised by the step's token count), its pre-clipping grad norm and learning rate
    assert h["series"]["loss"] == pytest.approx([e["loss"] for e in logs], rel=1e-5)
    assert h["series"]["grad_norm"] == pytest.approx([e["grad_norm"] for e in logs], rel=1e-9)
    assert h["series"]["lr"] == pytest.approx([e["learning_rate"] for e in logs], rel=1e-9)
    assert h["sites"] == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "lm_head"]
    assert [r["step"] for r in h["records"]] == [2, 4]
    for rec in h["records"]:
        st = rec["stats"]["transformer.h.1"]
        assert st["count"] == ACC * B * T * D  # every micro-batch of the step, forward
        assert st["fwd_var"] > 0 and st["grad_var"] > 0 and math.isfinite(st["grad_var"])
        assert set(rec["update_ratio"]) == {n for n, _ in model.named_parameters()}
        assert all(r > 0 for r in rec["update_ratio"].values())
    assert cb.failure is None  # the negative control of the stop test below
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert (tmp_path / "watch" / "watch.csv").is_file() and (tmp_path / "watch" / "watch.jsonl").is_file()


def nan_gpt2():
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    return model


@pytest.mark.parametrize("logging_steps", [1, 5])  # the fail found in on_log / in on_step_end
def test_stop_signal_ends_the_run_at_a_nonfinite_loss(tmp_path, logging_steps):
    cb = WatchCallback(every=5 * logging_steps, stop="signal")
    trainer = train(nan_gpt2(), cb, tmp_path, logging_steps=logging_steps)
    assert trainer.state.global_step == 1  # stopped after the first step, not at max_steps
    assert cb.failure is not None and cb.failure.step == 1 and cb.failure.verdict == "non_finite"
    assert cb.watch.history["events"][0]["kind"] == "nonfinite"


def test_stop_raise_leaves_no_hook_and_closes_the_writers(tmp_path):
    from diagnostics import WatchStop

    model = nan_gpt2()
    cb = WatchCallback(every=2, stop="raise", log_dir=tmp_path / "watch")
    with pytest.raises(WatchStop, match="step 1: the loss is nan") as stopped:
        train(model, cb, tmp_path)
    assert cb.failure is stopped.value.failure and cb.failure.step == 1
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert cb.watch.writers == []  # closed (files flushed)
    assert '"type": "event"' in (tmp_path / "watch" / "watch.jsonl").read_text()


def test_a_record_interval_off_the_logging_steps_is_warned_of(tmp_path):
    with pytest.warns(UserWarning, match="logging_steps=2: records at steps the Trainer does not log") as caught:
        train(tiny_gpt2(), WatchCallback(every=3), tmp_path, steps=1, logging_steps=2)
    assert sum("logging_steps=2" in str(w.message) for w in caught) == 1  # once, not at every step


def test_records_carry_the_trainers_grad_norm_and_loss_at_the_steps_it_logs(tmp_path):
    """every=5 with logging_steps=5: each record lands on a step the Trainer logs and carries the
    grad_norm it logged there; the watch's per-step losses average to the Trainer's logged loss
    over each logging window; between logs grad_norm is NaN."""
    cb = WatchCallback(every=5)
    trainer = train(tiny_gpt2(), cb, tmp_path, steps=10, logging_steps=5)
    h = cb.watch.history
    logged = {e["step"]: e for e in trainer.state.log_history if "grad_norm" in e}
    assert sorted(logged) == [5, 10] and [r["step"] for r in h["records"]] == [5, 10]
    s = h["series"]
    assert s["step"] == list(range(1, 11))
    for rec in h["records"]:
        t = rec["step"]
        assert math.isfinite(rec["grad_norm"]) and rec["grad_norm"] == pytest.approx(logged[t]["grad_norm"], rel=1e-9)
        assert s["grad_norm"][t - 1] == rec["grad_norm"] and rec["loss"] == s["loss"][t - 1]
        window = s["loss"][t - 5:t]  # the steps since the Trainer's previous log
        assert sum(window) / 5 == pytest.approx(logged[t]["loss"], rel=1e-5)
        assert rec["lr"] == pytest.approx(logged[t]["learning_rate"], rel=1e-9)
    assert all(math.isnan(g) for t, g in zip(s["step"], s["grad_norm"]) if t not in logged)


def _stats(h):
    return {s: h["records"][0]["stats"][s] for s in h["sites"]}


def test_an_accumulated_step_reads_as_one_step_of_the_whole_batch(tmp_path):
    """Accumulation x4 of micro-batches of 4 against one batch of 16 without accumulation, on
    the same sequences (the same sampler order; dropout off): the same step, so the same
    moments forward and backward up to float rounding, the same grad_norm. The exception
    the docstring names: the position embedding's output (1, T, D) is shared by a
    micro-batch's sequences, so its gradient is summed over 4 sequences, not 16."""
    acc = WatchCallback(every=1)
    train(tiny_gpt2(dropout=0.0), acc, tmp_path, steps=1, batch=4, acc=4)
    whole = WatchCallback(every=1)
    train(tiny_gpt2(dropout=0.0), whole, tmp_path, steps=1, batch=16, acc=1)
    a, w = _stats(acc.watch.history), _stats(whole.watch.history)
    for site in a:
        if site == "transformer.wpe":
            assert a[site]["count"] == 4 * w[site]["count"]  # one (1, T, D) output per micro-batch
            assert a[site]["fwd_var"] == pytest.approx(w[site]["fwd_var"], rel=1e-6)
            continue
        assert a[site]["count"] == w[site]["count"] == 16 * T * (V if site == "lm_head" else D)
        for key in ("fwd_var", "grad_var", "grad_absmax"):
            assert a[site][key] == pytest.approx(w[site][key], rel=1e-5), (site, key)
        for key, var in (("fwd_mean", "fwd_var"), ("grad_mean", "grad_var")):  # a mean near 0: rounding
            assert a[site][key] == pytest.approx(w[site][key], rel=1e-5, abs=1e-5 * math.sqrt(w[site][var])), (site, key)
    assert acc.watch.history["series"]["grad_norm"] == pytest.approx(whole.watch.history["series"]["grad_norm"],
                                                                     rel=1e-5)
    assert acc.watch.history["series"]["loss"] == pytest.approx(whole.watch.history["series"]["loss"], rel=1e-5)


def test_accumulation_scales_each_micro_batch_gradient_by_one_over_the_factor(tmp_path):
    """The exact factor against a step of one micro-batch: with every micro-batch the same 4
    sequences, accumulation x4 and no accumulation see the same tensors (forward moments
    equal) and the same micro-batch, whose gradient under the step's loss is 1/4 of its own
    (gradient mean 1/4, variance 1/16), at every site."""
    acc = WatchCallback(every=1)
    train(tiny_gpt2(dropout=0.0), acc, tmp_path, steps=1, batch=4, acc=4, data=OneSequence())
    one = WatchCallback(every=1)
    train(tiny_gpt2(dropout=0.0), one, tmp_path, steps=1, batch=4, acc=1, data=OneSequence())
    a, o = _stats(acc.watch.history), _stats(one.watch.history)
    for site in a:
        assert a[site]["count"] == 4 * o[site]["count"]
        assert a[site]["fwd_var"] == pytest.approx(o[site]["fwd_var"], rel=1e-6)
        assert a[site]["grad_var"] == pytest.approx(o[site]["grad_var"] / 16, rel=1e-5), site
        assert a[site]["grad_mean"] == pytest.approx(o[site]["grad_mean"] / 4, rel=1e-4,
                                                     abs=1e-5 * math.sqrt(a[site]["grad_var"])), site


def test_the_sites_of_a_llama_are_its_embedding_blocks_and_head():
    from diagnostics.jobs.watch import default_sites

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T)
    model = transformers.LlamaForCausalLM(cfg)
    assert default_sites(model) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
                                    "lm_head"]

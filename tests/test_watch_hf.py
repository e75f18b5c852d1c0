"""The watch as a Hugging Face Trainer callback: a real ``transformers.Trainer`` run of a few
steps on a tiny GPT-2 built from a config (random weights, nothing downloaded), with gradient
accumulation; the history it recorded against the Trainer's own log; the stop signal at a
non-finite loss, with the clean run as its negative control."""

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


def tiny_gpt2():
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=2, n_head=2, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def train(model, callback, tmp_path):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=B,
        gradient_accumulation_steps=ACC, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    return trainer


def test_a_trainer_run_records_the_watch(tmp_path):
    model = tiny_gpt2()
    cb = WatchCallback(every=2, log_dir=tmp_path / "watch")
    trainer = train(model, cb, tmp_path)
    h = cb.watch.history
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    assert len(logs) == STEPS and trainer.state.global_step == STEPS
    assert h["series"]["step"] == list(range(STEPS))
    # the loss of each step as the Trainer reports it (the sum over micro-batches of losses
    # normalised by the step's token count), its pre-clipping grad norm and learning rate
    assert h["series"]["loss"] == pytest.approx([e["loss"] for e in logs], rel=1e-5)
    assert h["series"]["grad_norm"] == pytest.approx([e["grad_norm"] for e in logs], rel=1e-9)
    assert h["series"]["lr"] == pytest.approx([e["learning_rate"] for e in logs], rel=1e-9)
    assert h["sites"] == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "lm_head"]
    assert [r["step"] for r in h["records"]] == [0, 2]
    for rec in h["records"]:
        st = rec["stats"]["transformer.h.1"]
        assert st["count"] == ACC * B * T * D  # every micro-batch of the step, forward
        assert st["fwd_var"] > 0 and st["grad_var"] > 0 and math.isfinite(st["grad_var"])
        assert set(rec["update_ratio"]) == {n for n, _ in model.named_parameters()}
        assert all(r > 0 for r in rec["update_ratio"].values())
    assert cb.failure is None  # the negative control of the stop test below
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert (tmp_path / "watch" / "watch.csv").is_file() and (tmp_path / "watch" / "watch.jsonl").is_file()


def test_stop_signal_ends_the_run_at_a_nonfinite_loss(tmp_path):
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    cb = WatchCallback(every=2, stop="signal")
    trainer = train(model, cb, tmp_path)
    assert trainer.state.global_step == 1  # stopped after the first step, not at max_steps
    assert cb.failure is not None and cb.failure.step == 0 and cb.failure.verdict == "non_finite"
    assert cb.watch.history["events"][0]["kind"] == "nonfinite"


def test_the_sites_of_a_llama_are_its_embedding_blocks_and_head():
    from diagnostics.jobs.watch import default_sites

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T)
    model = transformers.LlamaForCausalLM(cfg)
    assert default_sites(model) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
                                    "lm_head"]

"""The command line and Hugging Face directories: ``diagnose DIR`` and ``tinylm export --hf DIR``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tinylm
from clihelp import assert_one_line_error
from reports.cli import main
from tinylm import checkpoint, hf

transformers = pytest.importorskip("transformers")

FAST = ["--batch-size", "1", "--batches", "2", "--seq-len", "8", "--no-progress", "--width", "100"]
SMALL = tinylm.ModelConfig(vocab_size=256, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([*map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def llama_dir(tmp_path, capsys) -> Path:
    """A tiny randomly initialised LlamaForCausalLM written by save_pretrained."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                                      initializer_range=0.1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    capsys.readouterr()  # transformers' progress bar
    return tmp_path / "llama"


def test_diagnose_a_saved_llama_directory(capsys, llama_dir):
    code, out, err = run_cli(capsys, "diagnose", llama_dir, "--check", *FAST)
    assert code == 0, err
    flat = "".join(out.split())  # the report wraps long lines (a temporary path) at its width
    assert str(llama_dir) in flat and "HuggingFacedirectory" in flat and "(llama,mappedexactlyontotinylm)" in flat


@pytest.mark.parametrize("name", ["gpt2", "meta-llama/Llama-3.2-1B"])
def test_a_hub_name_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "diagnose", name, *FAST)
    assert_one_line_error(code, err, name, "local save_pretrained directories", "never downloads")
    code, _, err = run_cli(capsys, "export", name, "--hf", tmp_path / "out")
    assert_one_line_error(code, err, "local save_pretrained directories")


def test_directory_flags_and_directories_without_config_are_refused(capsys, tmp_path, llama_dir):
    code, _, err = run_cli(capsys, "diagnose", llama_dir, "--num-heads", "4", *FAST)
    assert_one_line_error(code, err, "--num-heads", "config.json", "drop")
    code, _, err = run_cli(capsys, "diagnose", llama_dir, "--unsafe-load", *FAST)
    assert_one_line_error(code, err, "--unsafe-load", "always read safely")
    code, _, err = run_cli(capsys, "diagnose", llama_dir, "--json", llama_dir / "config.json", *FAST)
    assert_one_line_error(code, err, "inside the checkpoint directory")
    (tmp_path / "plain").mkdir()
    code, _, err = run_cli(capsys, "diagnose", tmp_path / "plain", *FAST)
    assert_one_line_error(code, err, "is a directory", "config.json")
    edit = json.loads((llama_dir / "config.json").read_text())
    edit["num_key_value_heads"] = 2  # grouped queries map, but these weights have a K/V head per query head
    (llama_dir / "config.json").write_text(json.dumps(edit))
    code, _, err = run_cli(capsys, "diagnose", llama_dir, *FAST)
    assert_one_line_error(code, err, "shapes disagree with config.json", "k_proj")


@pytest.mark.parametrize("family, changes, how", [
    ("Llama", {}, "mapped exactly onto tinylm"),
    ("Mistral", {"sliding_window": 4}, "mapped exactly onto tinylm"),
    ("Qwen2", {}, "read through transformers"),
])
def test_grouped_queries_are_diagnosed_in_their_stored_dtype(capsys, tmp_path, family, changes, how):
    """Llama 3 / Mistral / Qwen2-style directories (2 key/value heads for 4 query heads) saved in
    bfloat16: diagnosed (exit 0) in bfloat16, the header saying why; --dtype overrides."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, **changes)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        getattr(transformers, f"{family}ForCausalLM")(config).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    capsys.readouterr()
    code, out, err = run_cli(capsys, "diagnose", tmp_path / "m", *FAST)
    assert code == 0, err
    flat = "".join(out.split())  # the report wraps long lines (a temporary path) at its width
    assert "".join(how.split()) in flat and "bfloat16(stored)" in flat
    code, out, err = run_cli(capsys, "diagnose", tmp_path / "m", *FAST, "--dtype", "float32")
    assert code == 0, err
    assert "float32(--dtype)" in "".join(out.split())


def test_export_a_checkpoint_then_transformers_loads_it(capsys, tmp_path):
    model = tinylm.TransformerLM(SMALL, generator=torch.Generator().manual_seed(0))
    checkpoint.save(tmp_path / "m.pt", model)
    code, out, err = run_cli(capsys, "export", tmp_path / "m.pt", "--hf", tmp_path / "out")
    assert code == 0, err
    assert "LlamaForCausalLM" in out and str(tmp_path / "out") in out
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    capsys.readouterr()  # transformers' progress bar
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model.eval()(x), theirs.eval()(x).logits
    assert float((a - b).abs().max() / b.abs().max()) <= 1e-5
    # a second export into the now non-empty directory needs --force; the directory is then the input too
    code, _, err = run_cli(capsys, "export", tmp_path / "m.pt", "--hf", tmp_path / "out")
    assert_one_line_error(code, err, "not empty", "--force")
    code, _, err = run_cli(capsys, "export", tmp_path / "m.pt", "--hf", tmp_path / "out", "--force")
    assert code == 0, err
    code, _, err = run_cli(capsys, "export", tmp_path / "out", "--hf", tmp_path / "out", "--force")
    assert_one_line_error(code, err, "would overwrite the checkpoint")


def test_export_a_preset_and_refuse_what_has_no_hf_equivalent(capsys, tmp_path):
    code, out, err = run_cli(capsys, "export", "--preset", "tiny", "--seed", "3", "--hf", tmp_path / "tiny")
    assert code == 0, err
    back, _ = hf.load(tmp_path / "tiny")
    fresh = tinylm.TransformerLM(tinylm.preset("tiny"), generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), back.state_dict().values()))
    post = tinylm.TransformerLM(SMALL.replace(norm="post"))
    checkpoint.save(tmp_path / "post.pt", post)
    code, _, err = run_cli(capsys, "export", tmp_path / "post.pt", "--hf", tmp_path / "post")
    assert_one_line_error(code, err, "norm='post'", "no Hugging Face equivalent")
    assert not (tmp_path / "post").exists()
    code, _, err = run_cli(capsys, "export", tmp_path / "post.pt", "--preset", "tiny", "--hf", tmp_path / "x")
    assert_one_line_error(code, err, "--preset")


def test_an_unmapped_architecture_is_handed_over_as_the_transformers_model(tmp_path, capsys):
    from reports.intake import load_model

    config = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    source = load_model(str(tmp_path / "neox"))
    assert type(source.model).__name__ == "GPTNeoXForCausalLM" and source.format == "hf-transformers"
    assert (source.vocab_size, source.context_length, source.fresh) == (256, 16, False)
    assert "read through transformers" in source.description and str(tmp_path / "neox") in source.description


def test_export_the_gpt2_family_in_the_gpt2_layout_and_diagnose_it(capsys, tmp_path):
    code, out, err = run_cli(capsys, "export", "--preset", "gpt2-tiny", "--hf", tmp_path / "g")
    assert code == 0, err
    assert "GPT2LMHeadModel" in out
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "g", local_files_only=True)
    capsys.readouterr()  # transformers' progress bar
    assert type(theirs).__name__ == "GPT2LMHeadModel"
    ours, _ = hf.load(tmp_path / "g")
    assert ours.config == tinylm.preset("gpt2-tiny")
    code, out, err = run_cli(capsys, "diagnose", tmp_path / "g", *FAST)
    assert code == 0, err
    assert "(gpt2,mappedexactlyontotinylm)" in "".join(out.split())


def test_an_architecture_read_through_transformers_is_measured_and_judged(capsys, tmp_path):
    """A causal LM with no tinylm mapping (GPT-NeoX) is read through transformers and measured by the
    any-module rules: its context bounds --seq-len, the report names what was and was not checked, and a
    model scaled to explode fails --check (exit 1) where its healthy twin passes (exit 0)."""
    config = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.GPTNeoXForCausalLM(config)
    model.save_pretrained(tmp_path / "neox")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(200.0)
    model.save_pretrained(tmp_path / "neox_x200")
    capsys.readouterr()
    code, out, err = run_cli(capsys, "diagnose", tmp_path / "neox", "--check", *FAST)
    assert code == 0, err
    flat = " ".join(out.split())
    assert "read through transformers" in flat and "checked:" in flat and "not checked:" in flat
    code, out, err = run_cli(capsys, "diagnose", tmp_path / "neox_x200", "--check", *FAST)
    assert code == 1, out + err
    code, _, err = run_cli(capsys, "diagnose", tmp_path / "neox", "--seq-len", "32", "--no-progress")
    assert_one_line_error(code, err, "--seq-len 32", "context length 16")

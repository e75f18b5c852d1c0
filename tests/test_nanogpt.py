"""nanoGPT: its train.py checkpoints load as the tinylm model that computes the same function,
and ``diagnose`` takes its GPT module as it is (context from ``config.block_size``, the
forward called with targets so that it returns every position's logits).

``GPT`` below is a plain module that behaves as nanoGPT's model.py does (nn.Linear layers,
c_attn stacking q|k|v along its rows, exact GELU, LayerNorm eps 1e-5 with an optional bias,
learned positions, dropout modules, lm_head tied to wte, ``forward(idx, targets=None) ->
(logits, loss)`` with the last position's logits only when targets is None, and ``.view`` where
nanoGPT uses it: on the targets, which therefore must be contiguous); ``save_like_train_py``
writes a checkpoint exactly as nanoGPT's train.py does.
"""

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
import tinylm
from reports.cli import main
from tinylm import checkpoint
from tinylm.errors import CheckpointError


# ---------------------------------------------------------------- nanoGPT's model.py, as it is


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, flash=True):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout, self.resid_dropout = nn.Dropout(config.dropout), nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = config.n_head, config.n_embd, config.dropout, flash
        if not flash:  # older torch: a causal-mask buffer, saved in the state dict as attn.bias
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                 .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config, flash=True):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(config.n_embd, config.bias), CausalSelfAttention(config, flash)
        self.ln_2, self.mlp = LayerNorm(config.n_embd, config.bias), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config, flash=True):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout), h=nn.ModuleList([Block(config, flash) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            # .view, as nanoGPT: a non-contiguous targets tensor raises "view size is not compatible"
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position
            loss = None
        return logits, loss


# ---------------------------------------------------------------- nanoGPT's train.py, as it saves

#: the globals of nanoGPT's train.py (its defaults), which it stores as checkpoint["config"]
TRAIN_PY_GLOBALS = dict(
    out_dir="out", eval_interval=2000, log_interval=1, eval_iters=200, eval_only=False, always_save_checkpoint=True,
    init_from="scratch", wandb_log=False, wandb_project="owt", wandb_run_name="gpt2", dataset="openwebtext",
    gradient_accumulation_steps=40, batch_size=12, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0,
    bias=False, learning_rate=6e-4, max_iters=600000, weight_decay=1e-1, beta1=0.9, beta2=0.95, grad_clip=1.0,
    decay_lr=True, warmup_iters=2000, lr_decay_iters=600000, min_lr=6e-5, backend="nccl", device="cuda",
    dtype="bfloat16", compile=True)


def save_like_train_py(path, model: GPT, *, compiled=False, iter_num=250):
    """torch.save of the dict nanoGPT's train.py writes (ckpt.pt), with an AdamW that took a step.

    ``compiled``: the state dict of a torch.compile'd model, whose keys carry ``_orig_mod.``.
    """
    cfg = model.config
    model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                      bias=cfg.bias, vocab_size=cfg.vocab_size, dropout=cfg.dropout)
    params = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]
    nodecay = [p for p in params.values() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                                  lr=6e-4, betas=(0.9, 0.95))
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=torch.Generator().manual_seed(5))
    _, loss = model(idx[:, :-1], idx[:, 1:].contiguous())  # train.py's get_batch stacks x and y apart
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = model.state_dict()
    if compiled:
        state = {"_orig_mod." + k: v for k, v in state.items()}
    config = {**TRAIN_PY_GLOBALS, **model_args}
    checkpoint_dict = {"model": state, "optimizer": optimizer.state_dict(), "model_args": model_args,
                       "iter_num": iter_num, "best_val_loss": torch.tensor(4.25), "config": config}
    torch.save(checkpoint_dict, path)


def small_gpt(bias=True, flash=True, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=16, vocab_size=97, n_layer=3, n_head=4, n_embd=32, bias=bias), flash)
    if bias:  # nanoGPT starts biases at zero and LayerNorm at (1, 0): move them so that a wrong map shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


# ---------------------------------------------------------------- the checkpoint loads exactly


@pytest.mark.parametrize("bias,flash,compiled", [(True, True, False), (False, True, False), (True, False, True)],
                         ids=["bias", "no-bias", "mask-buffer-compiled"])
def test_train_py_checkpoint_loads_as_the_same_function(tmp_path, bias, flash, compiled):
    ref = small_gpt(bias=bias, flash=flash)
    path = tmp_path / "ckpt.pt"
    save_like_train_py(path, ref, compiled=compiled)
    model, info = checkpoint.load(path)
    assert info.format == "nanogpt" and info.config_source == "stored"
    assert info.iteration == 250 and info.has_optimizer and info.extra["best_val_loss"] == 4.25
    assert info.extra["train_config"]["dataset"] == "openwebtext"
    c = model.config
    assert (c.vocab_size, c.context_length, c.d_model, c.num_layers, c.num_heads, c.d_ff) == (97, 16, 32, 3, 4, 128)
    assert (c.norm, c.norm_kind, c.ffn, c.positions, c.bias, c.tie_embeddings, c.eps) == \
        ("pre", "layer", "gelu", "learned", bias, True, 1e-5)
    assert next(model.parameters()).dtype == torch.float64
    ids = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = ref(ids, targets=ids)  # (B, T, V): every position
        last, loss = ref(ids)  # (B, 1, V)
        ours = model(ids)
    assert loss is None and last.shape == (3, 1, 97)
    torch.testing.assert_close(ours, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours[:, -1:], last, rtol=0, atol=1e-12)


def test_bare_nanogpt_state_dict_needs_only_the_head_count(tmp_path):
    ref = small_gpt(bias=False)
    path = tmp_path / "state.pt"
    torch.save(ref.state_dict(), path)
    with pytest.raises(checkpoint.MissingOptionsError) as e:
        checkpoint.load(path)
    assert e.value.missing == ["num_heads"]
    model, info = checkpoint.load(path, num_heads=4)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids, targets=ids)[0], rtol=0, atol=1e-12)


def test_nanogpt_checkpoint_through_the_cli(tmp_path, capsys):
    path = tmp_path / "ckpt.pt"
    save_like_train_py(path, small_gpt(dtype=torch.float32))
    code = main(["diagnose", str(path), "--batch-size", "2", "--batches", "1", "--no-progress", "--width", "100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "nanogpt checkpoint" in out and "iteration 250" in out


def test_model_args_missing_a_size_is_one_line(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_like_train_py(path, small_gpt())
    obj = torch.load(path, weights_only=True)
    del obj["model_args"]["n_head"]
    torch.save(obj, path)
    with pytest.raises(CheckpointError, match="model_args lack n_head"):
        checkpoint.load(path)


# ---------------------------------------------------------------- formats tinylm does not read


def test_unknown_dict_names_its_keys_and_the_python_route(tmp_path):
    path = tmp_path / "lightning.ckpt"
    torch.save({"epoch": 3, "state_dict": {"encoder.layer.0.weight": torch.zeros(2, 2)}, "hparams": {"lr": 1}}, path)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path)
    msg = str(e.value)
    assert "epoch, state_dict, hparams" in msg and "encoder.layer.0.weight" in msg
    assert "diagnostics.diagnose(model, options=DiagnoseOptions(inputs=...))" in msg and "\n" not in msg


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "training-dict"])
def test_foreign_state_dict_names_its_keys_and_the_python_route(tmp_path, wrapped):
    state = {"encoder.embed.weight": torch.zeros(5, 4), "encoder.blocks.0.w.weight": torch.zeros(4, 4)}
    path = tmp_path / "s.pt"
    torch.save({"model": state, "optimizer": {}, "step": 3} if wrapped else state, path)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path)
    msg = str(e.value)
    assert "encoder.embed.weight" in msg and "diagnostics.diagnose(model" in msg
    assert "not a CS336/tinylm language model" not in msg
    if wrapped:
        assert "model, optimizer, step" in msg


_PICKLED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from model import GPT, GPTConfig
torch.save(GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8)), sys.argv[2])
"""


def test_pickled_model_whose_module_is_missing_names_the_module(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    here = open(__file__).read()
    (src / "model.py").write_text(here[here.index("@dataclass"):here.index("# ------------------------------------"
                                  "---------------------------- nanoGPT's train.py")].join(
        ["import math\nfrom dataclasses import dataclass\nimport torch\nimport torch.nn.functional as F\n"
         "from torch import nn\n\n\n", ""]))
    path = tmp_path / "whole.pt"
    subprocess.run([sys.executable, "-c", _PICKLED, str(src), str(path)], check=True, timeout=120)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path, unsafe=True)
    msg = str(e.value)
    assert "pickles class model.GPT: module 'model' is not importable" in msg
    assert "run from the folder that has model.py" in msg and "diagnostics.diagnose(model)" in msg
    assert "corrupt" not in msg
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    code = main(["diagnose", str(path), "--unsafe-load", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "module 'model' is not importable" in err and len(err.strip().splitlines()) == 1
    code = main(["diagnose", str(path), "--unsafe-load", "--no-progress", "--debug"])
    err = capsys.readouterr().err
    assert "ModuleNotFoundError" in err  # the cause is chained for --debug


_SCRIPT = """
import sys, torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
torch.save(Net(), sys.argv[1])
"""


def test_pickled_model_of_a_script_says_so(tmp_path):
    path = tmp_path / "script.pt"
    subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], check=True, timeout=120)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path, unsafe=True)
    msg = str(e.value)
    assert "pickles class __main__.Net: it was saved from a script (module '__main__')" in msg
    assert "diagnostics.diagnose(model)" in msg and isinstance(e.value.__cause__, AttributeError)


# ---------------------------------------------------------------- diagnose takes nanoGPT's module as it is


def test_diagnose_a_nanogpt_module_without_options():
    model = small_gpt(dtype=torch.float32)
    assert diagnostics.jobs.diagnose_sample.model_context(model) == 16
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = diagnostics.diagnose(model, options=diagnostics.DiagnoseOptions(batch_size=2, batches=1))
    assert result.header.seq_len == 16  # the context, read from config.block_size
    assert result.status != "not judged"
    assert "residual stream gains (forward)" in result.judged and "loss against ln V" in result.judged
    assert len(result.depth) == 4 and all(r.forward_var > 0 for r in result.depth)  # embeddings + 3 blocks
    assert result.header.loss_uniform == pytest.approx(math.log(97))  # the mean next-token CE of every position
    assert abs(result.header.loss - math.log(97)) < 0.5
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_last_position_logits_without_a_targets_parameter_is_explained():
    class LastOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = small_gpt(dtype=torch.float32)

        def forward(self, idx):
            return self.gpt(idx)

    with pytest.raises(diagnostics.OptionsError, match="last position's logits only"):
        diagnostics.diagnose(LastOnly(), options=diagnostics.DiagnoseOptions(batch_size=2, batches=1, seq_len=8))


def test_the_module_views_its_targets_as_nanogpt_does():  # negative control for the two tests above and below
    model = small_gpt(dtype=torch.float32)
    w = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        model(w[:, :-1], w[:, 1:])  # a slice of token windows: what a job must never hand it
    logits, loss = model(w[:, :-1], w[:, 1:].contiguous())
    assert logits.shape == (2, 16, 97) and loss.dim() == 0


def test_diff_and_fingerprint_take_a_nanogpt_module_without_options():
    a, b = small_gpt(dtype=torch.float32), small_gpt(dtype=torch.float32)
    fp = diagnostics.fingerprint(a)
    assert fp.tokens.shape[1] == 17  # the context, read from config.block_size, and the next token
    result = diagnostics.diff(a, b)
    assert result.same and result.rows  # every position's logits (the forward is given targets)


_TORCHRUN = """
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import diagnostics
from test_nanogpt import small_gpt

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(small_gpt(dtype=torch.float32))  # as nanoGPT's train.py
result = diagnostics.diagnose(model)  # no options
dist.barrier()  # both ranks got here: neither crashed
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"status": result.status, "seq_len": result.header.seq_len}, f)
dist.destroy_process_group()
"""


@pytest.mark.distributed
@pytest.mark.slow  # two interpreters importing torch under torchrun: ~40 s on a busy 2-core machine
def test_diagnose_a_nanogpt_module_under_torchrun(tmp_path):
    """Two ranks on gloo, launched by torchrun, each diagnosing nanoGPT's module with no options."""
    import json
    import os

    (tmp_path / "run.py").write_text(_TORCHRUN)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(tmp_path / "run.py"), here, str(tmp_path)]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and both ranks: none outlives the test
        proc.communicate()
        pytest.fail("torchrun did not finish in 180 s")
    assert proc.returncode == 0, err[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["seq_len"] == 16 and got["status"] != "not judged"

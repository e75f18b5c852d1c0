"""precision held to torchao's emulated recipes: every linear layer's three GEMMs of tinylm, a
Hugging Face Llama and a GPT-2, on the same inputs and output gradients; theory held to measurement;
negative controls (a wrong exponent width, a wrong block size, a scale off by one binade) caught."""

from __future__ import annotations

import math

import pytest
import torch

import tinylm
from diagnostics.jobs.precision import PrecisionOptions, linear_layers, precision
from diagnostics.measure.quant import FORMATS, RECIPES, Cast, FloatFormat, quantize

pytest.importorskip("torchao")
from torchao.float8.config import Float8LinearConfig, ScalingGranularity  # noqa: E402
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale  # noqa: E402
from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

transformers = pytest.importorskip("transformers")

PARITY_DB = 0.5
THEORY_DB = 1.0
RECIPE_NAMES = ("tensorwise", "rowwise", "mxfp8")


def _db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach(), out.detach()
    return 10 * math.log10(float(ref.double().pow(2).sum()) / float((ref.double() - out.double()).pow(2).sum()))


def torchao_sqnr(recipe: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, float]:
    """SQNR of fprop / dgrad / wgrad through torchao's own emulated autograd function, x (M, K), w (N, K), g (M, N)."""
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    if recipe == "mxfp8":
        out = _to_mxfp8_then_scaled_mm(xa, wa, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)
    else:
        base = Float8LinearConfig.from_recipe_name(recipe)
        config = Float8LinearConfig(**{**base.__dict__, "emulate": True})
        mm = LinearMMConfig(*(ScaledMMConfig(True, fast, False, False) for fast in (True, False, False)))
        out = matmul_with_hp_or_float8_args.apply(xa, wa.t(), mm, config)
    out.backward(g)
    return {"fprop": _db(x @ w.t(), out), "dgrad": _db(g @ w, xa.grad), "wgrad": _db(g.t() @ x, wa.grad)}


def captured(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, tuple]:
    """Each linear layer's (x (M, K), W (N, K), g (M, N)) from one plain forward and backward."""
    got: dict[str, list] = {}
    hooks = []
    for name, mod in linear_layers(model):
        if isinstance(mod, torch.nn.Embedding) or "embed" in name or name.endswith(("wte", "wpe")):
            continue

        def hook(m, args, out, _n=name):
            w = m.weight.detach() if type(m).__name__ != "Conv1D" else m.weight.detach().t()
            got[_n] = [args[0].detach().reshape(-1, args[0].shape[-1]), w.contiguous()]
            out.register_hook(lambda g: got[_n].append(g.detach().reshape(-1, g.shape[-1])))
        hooks.append(mod.register_forward_hook(hook))
    try:
        out = model(ids[:, :-1])
        logits = out if isinstance(out, torch.Tensor) else out.logits
        torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), ids[:, 1:].flatten()).backward()
    finally:
        for h in hooks:
            h.remove()
    model.zero_grad(set_to_none=True)
    return {k: tuple(v) for k, v in got.items()}


def _tinylm():
    torch.manual_seed(0)
    return tinylm.TransformerLM(tinylm.ModelConfig(vocab_size=128, context_length=32, d_model=64, num_layers=2,
                                                   num_heads=4, d_ff=128))


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False)).eval()


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)).eval()


@pytest.mark.parametrize("build", [_tinylm, _llama, _gpt2], ids=["tinylm", "llama", "gpt2"])
def test_sqnr_matches_torchao_for_every_linear_and_gemm(build):
    model = build()
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))  # 64 tokens: MX blocks of 32
    result = precision(model, ids, PrecisionOptions(recipes=RECIPE_NAMES, batch_size=2, seq_len=32))
    ops = captured(model, ids)
    rows = {(r.module, r.gemm, r.recipe): r for r in result.rows}
    assert set(result.modules) == set(ops), (result.skipped, sorted(ops))
    worst = 0.0
    for name, (x, w, g) in ops.items():
        for recipe in RECIPE_NAMES:
            theirs = torchao_sqnr(recipe, x, w, g)
            for gemm, db in theirs.items():
                row = rows[(name, gemm, recipe)]
                worst = max(worst, abs(row.sqnr_db - db))
                assert abs(row.sqnr_db - db) <= PARITY_DB, (name, gemm, recipe, row.sqnr_db, db)
                if row.valid:
                    assert abs(row.predicted_sqnr_db - row.sqnr_db) <= THEORY_DB, (name, gemm, recipe, row)
    assert sum(r.valid for r in result.rows) >= 0.6 * len(result.rows)  # theory claims most of them (64 tokens)


# ----------------------------------------------------------------------------- tensor-level parity, negative controls


def _wide(rows=64, k=256, seed=0):
    """Entries over 24 binades: every scaling choice shows in some of them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-20, 4, (rows, k), generator=g).float())


def _reference_cast(recipe: str, x: torch.Tensor) -> torch.Tensor:
    """torchao's dequantized x (cast along its last dimension) for the input of ``recipe``."""
    if recipe == "mxfp8":
        scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        return (data.float().reshape(x.shape[0], -1, 32) * get_fp_scale(scale).unsqueeze(-1)).reshape(x.shape)
    rowwise = recipe == "rowwise"
    scale = tensor_to_scale(x, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE if rowwise
                            else ScalingGranularity.TENSORWISE, axiswise_dim=-1 if rowwise else None,
                            round_scales_to_power_of_2=rowwise)
    return (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_operand_casts_equal_torchao_and_mutants_do_not(recipe):
    x = _wide()
    ref = _reference_cast(recipe, x)
    cast = RECIPES[recipe].fprop[0]
    assert torch.equal(quantize(x, cast)[0], ref)
    assert torch.equal(quantize(x, cast, native=False)[0], ref)  # our own rounding, not torch's cast
    e4m3 = FORMATS["e4m3"]
    mutants = {"exponent width": Cast(FloatFormat("e3m4", 3, 4, -2, 15.5), cast.granularity, cast.scale_rounding,
                                      cast.block),
               "scale one binade off": Cast(FloatFormat("e4m3", 4, 3, -6, 2 * e4m3.max, "float8_e4m3fn"),
                                            cast.granularity, cast.scale_rounding, cast.block)}
    if recipe == "mxfp8":
        mutants["block size"] = Cast(e4m3, "block", "e8m0_rceil", 16)
    for what, mutant in mutants.items():
        assert int((quantize(x, mutant)[0] != ref).sum()) > 0, what


def test_negative_controls_move_sqnr_beyond_parity():
    """The SQNR test above would catch a wrong exponent width or a scale off by one binade."""
    g = torch.Generator().manual_seed(3)
    x, w, gr = torch.randn(64, 128, generator=g), torch.randn(96, 128, generator=g) / 10, torch.randn(64, 96, generator=g)
    theirs = torchao_sqnr("rowwise", x, w, gr)
    from diagnostics.jobs.precision import measure_gemms

    good = {f["gemm"]: f["sqnr_db"] for f in measure_gemms(x, w, gr, [RECIPES["rowwise"]], theory=False)}
    assert all(abs(good[k] - theirs[k]) <= PARITY_DB for k in theirs)
    e4m3 = FORMATS["e4m3"]
    for mutant in (Cast(FORMATS["e5m2"], "row", "pow2_floor"),
                   Cast(FloatFormat("e4m3", 4, 3, -6, 2 * e4m3.max, "float8_e4m3fn"), "row", "pow2_floor")):
        bad = RECIPES["rowwise"].with_cast("input", mutant)
        got = {f["gemm"]: f["sqnr_db"] for f in measure_gemms(x, w, gr, [bad], theory=False)}
        assert abs(got["fprop"] - theirs["fprop"]) > PARITY_DB


@pytest.mark.slow
def test_sqnr_matches_torchao_in_bfloat16():
    """A bf16 model: operands captured in bf16, each side's GEMMs from them (torchao's output cast to bf16)."""
    model = _tinylm().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    result = precision(model, ids, PrecisionOptions(recipes=RECIPE_NAMES, batch_size=2, seq_len=32, theory=False))
    rows = {(r.module, r.gemm, r.recipe): r for r in result.rows}
    for name, (x, w, g) in captured(model, ids).items():
        for recipe in RECIPE_NAMES:
            theirs = torchao_sqnr(recipe, x, w, g)
            for gemm, db in theirs.items():
                assert abs(rows[(name, gemm, recipe)].sqnr_db - db) <= PARITY_DB, (name, gemm, recipe, db)


def test_a_model_torchao_already_converted_is_named_not_misjudged():
    """Layers that ``convert_to_float8_training`` made ``Float8Linear`` are skipped as already
    quantized by torchao, the head it left alone is measured; negative control: the same model
    unconverted has every layer measured and none skipped."""
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    plain = precision(model, None, PrecisionOptions(batch_size=2, seq_len=16, recipes=("tensorwise",)))
    assert not plain.skipped and len(plain.to_frame()["module"].unique()) == 15
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True),
                               module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    got = precision(model, None, PrecisionOptions(batch_size=2, seq_len=16, recipes=("tensorwise",)))
    assert set(got.to_frame()["module"]) == {"lm_head"}
    assert len(got.skipped) == 14 and all("already quantized by torchao (Float8Linear)" in why for _, why in got.skipped)

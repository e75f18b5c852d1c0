"""The parts in their place: the whole model against an independent float64 reference.

``reference_forward`` below recomputes a TransformerLM from its state dict alone,
written from the formulas (explicit per-head loops are avoided, but nothing of the
implementation under test is called): embeddings, each block in its norm placement

    pre : h = x + D(attn(n1(x)));  z = h + D(ffn(n2(h)))
    post: h = n1(x + D(attn(x)));  z = n2(h + D(ffn(h)))
    none: h = x + D(attn(x));      z = h + D(ffn(h))

attention with RoPE at the given token positions (rotation of adjacent pairs by
p theta^(-2k/d_k)), the causal mask and dropout D on the attention weights, the
final norm (pre-norm only) and the head (the embedding matrix when tied).

Every norm gain is redrawn as 1 + 0.5 N(0, 1) (at the fresh gain 1 a block cannot
tell its two norms apart, nor a model whether its final norm runs), every
``ModelConfig`` variant the strategy reaches is built, in float64, and compared
with the reference in eval mode, in train mode without dropout (bitwise equal to
eval), and in train mode with dropout, where the reference replays torch's global
generator in the order the model draws (per block: attention weights, attention
branch, FFN branch). Tolerance: 1e3 (d + d_ff + T) L u_64 relative to the logits'
scale, far below any change of wiring (which moves logits by O(1)).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from props.record import check, prop
from props.strategies import generator, model_configs, seeds
from props.tolerances import unit_roundoff

U64 = unit_roundoff(torch.float64)


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _drop(t, p, on):
    if not on or p == 0:
        return t
    keep = torch.rand(t.shape) >= p  # torch's global generator, float32 draws as the model makes them
    return t * keep.to(t.dtype) / (1 - p)


def _rope(x, pos, theta):
    """x (B, H, T, dk), pos (T,) or (B, T): rotate (x_2k, x_2k+1) by pos * theta^(-2k/dk)."""
    dk = x.shape[-1]
    ang = pos.double()[..., None] * theta ** (-torch.arange(0, dk, 2, dtype=torch.float64) / dk)  # (..., T, dk/2)
    if ang.dim() == 3:
        ang = ang[:, None]  # (B, 1, T, dk/2): the same positions for every head
    c, s = torch.cos(ang), torch.sin(ang)
    pairs = x.unflatten(-1, (dk // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


def _attention(sd, pre, cfg, u, pos, train):
    B, T, d = u.shape
    H, dk = cfg.num_heads, cfg.head_dim

    def heads(name):
        return (u @ sd[pre + name + ".weight"].T).reshape(B, T, H, dk).permute(0, 2, 1, 3)  # (B, H, T, dk)

    q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
    if cfg.rope:
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(dk)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    w = torch.exp(s - s.amax(-1, keepdim=True))
    w = _drop(w / w.sum(-1, keepdim=True), cfg.dropout, train)
    o = torch.einsum("bhij,bhjd->bhid", w, v).permute(0, 2, 1, 3).reshape(B, T, d)
    return o @ sd[pre + "output_proj.weight"].T


def _ffn(sd, pre, cfg, u):
    a = u @ sd[pre + "w1.weight"].T
    h = a * torch.sigmoid(a)
    if cfg.ffn == "swiglu":
        h = h * (u @ sd[pre + "w3.weight"].T)
    return h @ sd[pre + "w2.weight"].T


def reference_forward(sd: dict, cfg, tokens: torch.Tensor, pos: torch.Tensor | None = None, train: bool = False):
    """Logits of a TransformerLM with state dict ``sd`` and config ``cfg``, from the formulas alone."""
    T = tokens.shape[-1]
    pos = torch.arange(T) if pos is None else pos
    x = sd["token_embeddings.weight"][tokens]
    p = cfg.dropout
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        g1 = sd.get(pre + "ln1.weight")
        g2 = sd.get(pre + "ln2.weight")
        attn = lambda u: _drop(_attention(sd, pre + "attn.", cfg, u, pos, train), p, train)  # noqa: E731
        ffn = lambda u: _drop(_ffn(sd, pre + "ffn.", cfg, u), p, train)  # noqa: E731
        if cfg.norm == "pre":
            h = x + attn(_rms(x, g1, cfg.eps))
            x = h + ffn(_rms(h, g2, cfg.eps))
        elif cfg.norm == "post":
            h = _rms(x + attn(x), g1, cfg.eps)
            x = _rms(h + ffn(h), g2, cfg.eps)
        else:
            h = x + attn(x)
            x = h + ffn(h)
    if cfg.norm == "pre":
        x = _rms(x, sd["ln_final.weight"], cfg.eps)
    head = sd["token_embeddings.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    return x @ head.T


def _model_with_random_gains(impl, cfg, seed):
    g = generator(seed)
    model = impl.transformer_lm(cfg, g).double()
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                prm.copy_(1 + 0.5 * torch.randn(prm.shape, generator=g, dtype=torch.float64))
    return model, g


def _positions(cfg, g, B, T, kind):
    """None (the default 0..T-1), or increasing positions with gaps of 1 to 3 within the context, shared
    (T,) or per batch row (B, T). Gaps matter: RoPE scores depend on i - j only, so a common offset is invisible."""
    if kind == "default":
        return None
    rows = B if kind == "batched" else 1
    pos = torch.stack([torch.randperm(cfg.context_length, generator=g)[:T].sort().values for _ in range(rows)])
    return pos if kind == "batched" else pos[0]


def _tol(cfg, logits):
    return 1e3 * (cfg.d_model + cfg.d_ff + cfg.context_length) * cfg.num_layers * U64 * (1 + float(logits.abs().max()))


variants = model_configs(max_layers=2, max_vocab=32, max_context=12)


@prop("whole model = independent float64 reference: every variant, random norm gains and eps, RoPE at given positions, eval mode", needs=("transformer_lm",))
@settings(max_examples=20)
@given(cfg=variants, seed=seeds(), dropout=st.sampled_from([0.0, 0.3]), kind=st.sampled_from(["default", "shared", "batched"]), data=st.data())
def test_model_matches_reference_eval(impl, cfg, seed, dropout, kind, data):
    check_model_against_reference(impl, cfg, seed, dropout, kind, data)


def check_model_against_reference(impl, cfg, seed, dropout, kind, data):
    """The model in eval mode equals the float64 reference on drawn tokens and positions."""
    cfg = cfg.replace(dropout=dropout, eps=data.draw(st.sampled_from([1e-5, 0.05, 0.5]), label="eps"))
    model, g = _model_with_random_gains(impl, cfg, seed)
    model.eval()
    T = data.draw(st.integers(1, cfg.context_length), label="T")
    tok = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    pos = _positions(cfg, g, 2, T, kind)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = model(tok) if pos is None else model(tok, pos)
    ref = reference_forward(sd, cfg, tok, pos)
    err = float((out - ref).abs().max())
    check(err, _tol(cfg, ref), f"model differs from the reference ({cfg.norm}, {cfg.ffn}, rope={cfg.rope}, tie={cfg.tie_embeddings}, pos={kind})")


@prop("train mode: without dropout bitwise = eval; with dropout = the reference replaying the draws (attn weights, attn branch, FFN branch)", needs=("transformer_lm",))
@settings(max_examples=12)
@given(cfg=variants, seed=seeds())
def test_model_train_mode(impl, cfg, seed):
    check_model_train_mode(impl, cfg, seed)


def check_model_train_mode(impl, cfg, seed):
    """Train mode: without dropout bitwise eval; with dropout, the reference replaying the draws."""
    model, g = _model_with_random_gains(impl, cfg.replace(dropout=0.0), seed)
    tok = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=g)
    with torch.no_grad():
        model.train()
        a = model(tok)
        model.eval()
        b = model(tok)
    assert torch.equal(a, b), "without dropout, train and eval mode differ"
    dcfg = cfg.replace(dropout=0.3)
    model, g = _model_with_random_gains(impl, dcfg, seed)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    model.train()
    state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model(tok)
        torch.manual_seed(seed)
        ref = reference_forward(sd, dcfg, tok, train=True)
        ev = reference_forward(sd, dcfg, tok, train=False)
    finally:
        torch.set_rng_state(state)
    assert float((ref - ev).abs().max()) > 1e3 * _tol(dcfg, ref), "dropout changed nothing in the reference"
    check(float((out - ref).abs().max()), _tol(dcfg, ref), "train-mode model with dropout differs from the replayed reference")


@prop("negative control: the reference check rejects a model whose gains were reset to 1 (norms unweighted)", needs=("transformer_lm",))
@settings(max_examples=6)
@given(cfg=model_configs(max_layers=2, max_vocab=32, max_context=8, norms=("pre", "post")), seed=seeds())
def test_reference_rejects_unit_gains(impl, cfg, seed):
    model, g = _model_with_random_gains(impl, cfg, seed)
    model.eval()
    tok = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=g)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = model(tok)
    unit = {k: (torch.ones_like(v) if k.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")) else v) for k, v in sd.items()}
    err = float((out - reference_forward(unit, cfg, tok)).abs().max())
    check(_tol(cfg, out) / err, 1.0, "negative control", kind="tol/err")
    assert err > _tol(cfg, out)


@prop("negative control: with RoPE, positions with gaps change the logits (a dropped token_positions is caught)", needs=("transformer_lm",))
@settings(max_examples=6)
@given(cfg=model_configs(max_layers=2, max_vocab=32, max_context=12, positions=("rope",)), seed=seeds())
def test_reference_positions_matter(impl, cfg, seed):
    cfg = cfg.replace(context_length=max(cfg.context_length, 4))
    model, g = _model_with_random_gains(impl, cfg, seed)
    model.eval()
    T = (cfg.context_length + 1) // 2
    tok = torch.arange(T).remainder(cfg.vocab_size).expand(2, T)  # distinct neighbours: positions are visible
    pos = torch.arange(T) * 2  # every gap 2: not a shift of 0..T-1
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    err = float((reference_forward(sd, cfg, tok, pos) - reference_forward(sd, cfg, tok)).abs().max())
    tol = _tol(cfg, reference_forward(sd, cfg, tok))
    check(tol / max(err, 1e-300), 1.0, "negative control", kind="tol/err")
    assert err > tol, "positions with gaps gave the same logits as 0..T-1"


@pytest.mark.slow
@prop("slow: whole model = reference over 200 variants up to 4 layers and context 24, eval and train with dropout", needs=("transformer_lm",))
@settings(max_examples=200)
@given(cfg=model_configs(max_layers=4, max_vocab=64, max_context=24), seed=seeds(), kind=st.sampled_from(["default", "shared", "batched"]), data=st.data())
def test_model_matches_reference_thorough(impl, cfg, seed, kind, data):
    check_model_against_reference(impl, cfg, seed, 0.3, kind, data)
    check_model_train_mode(impl, cfg, seed)


@prop("every norm placement passes token_positions to attention: model(tok, pos) = reference at positions with gaps", needs=("transformer_lm",))
@pytest.mark.parametrize("norm", ["pre", "post", "none"])
def test_positions_reach_attention_in_every_placement(impl, norm):
    from tinylm.config import ModelConfig

    cfg = ModelConfig(vocab_size=16, context_length=12, d_model=8, num_layers=2, num_heads=2, d_ff=12, norm=norm)
    model, g = _model_with_random_gains(impl, cfg, 3)
    model.eval()
    tok = torch.randint(0, cfg.vocab_size, (2, 6), generator=g)
    pos = torch.arange(6) * 2  # gaps of 2: RoPE sees other relative distances than 0..5
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = model(tok, pos)
    ref = reference_forward(sd, cfg, tok, pos)
    assert float((ref - reference_forward(sd, cfg, tok)).abs().max()) > 1e3 * _tol(cfg, ref)  # the positions are visible
    check(float((out - ref).abs().max()), _tol(cfg, ref), f"{norm}: token_positions did not reach attention")

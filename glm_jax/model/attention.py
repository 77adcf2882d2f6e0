"""Attention and its KV cache: GQA for glm4_moe here, MLA (with or without DSA) in ``mla.py`` (``attention`` picks).

Shapes: B batch, T query tokens, S cache slots (= positions), H hidden, nh/nkv heads, hd head_dim.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import kernels
from ..kernels.formats import NATIVE_MAX_ROWS, QWeight
from . import glm5_next, mla
from .config import ModelConfig
from .layers import F32, apply_rope_half, linear, positions_of, rms_norm, rope_cos_sin, softmax


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype, with_mtp: bool = False) -> list:
    """One dict per layer (+ the MTP layer at the end when ``with_mtp``)."""
    n = cfg.num_hidden_layers + (1 if with_mtp else 0)
    if cfg.model_type == "glm5_next":
        return glm5_next.init_cache(cfg, batch, max_len, dtype)
    if cfg.is_mla:
        return [mla.init_mla_cache(cfg, i, batch, max_len, dtype) for i in range(n)]
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(n)]

def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, with_mtp: bool = True) -> int:
    """KV-cache bytes per position over every layer (and the MTP layer)."""
    n = cfg.num_hidden_layers + (1 if with_mtp and cfg.has_mtp else 0)
    if cfg.model_type == "glm5_next":       # the KDA layers' state is per row: glm5_next.state_bytes_per_row
        return glm5_next.kv_bytes_per_token(cfg, dtype_bytes)
    if cfg.is_mla:
        kb = mla.kv_bytes_per_token(cfg, dtype_bytes)
        return kb["model_total"] + (kb["mtp_layer"] if with_mtp and cfg.has_mtp else 0)
    return n * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes

def gqa_attention(cfg: ModelConfig, p, x, cache, start, rows=None):
    """x [B, T, H] (input-normed).  Writes K/V at positions start..start+T-1 and attends causally over the cache.
    ``rows`` [B, T] bool: real (non-padding) positions (the native projections skip the others)."""
    B, T, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if "qkv" in p:           # q/k/v fused into one matrix (quant.pack_layer)
        qkv = linear(x, p["qkv"], p.get("qkv_b"), rows)
        q = qkv[..., :nh * hd].reshape(B, T, nh, hd)
        k = qkv[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd)
        v = qkv[..., (nh + nkv) * hd:].reshape(B, T, nkv, hd)
    else:
        q = linear(x, p["q_w"], p.get("q_b")).reshape(B, T, nh, hd)
        k = linear(x, p["k_w"], p.get("k_b")).reshape(B, T, nkv, hd)
        v = linear(x, p["v_w"], p.get("v_b")).reshape(B, T, nkv, hd)
    if "q_norm" in p:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    pos = positions_of(start, T)                                     # [B, T]
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, x.dtype)
    q = apply_rope_half(q, cos, sin)
    k = apply_rope_half(k, cos, sin)
    bidx = jnp.arange(B)[:, None]
    ck = cache["k"].at[bidx, pos].set(k.astype(cache["k"].dtype), mode="drop")
    cv = cache["v"].at[bidx, pos].set(v.astype(cache["v"].dtype), mode="drop")
    if _native_attention(p, q, ck):
        real = jnp.ones((B, T), bool) if rows is None else rows
        out = kernels.attention(q, ck, cv, pos, real, hd ** -0.5).astype(q.dtype).reshape(B, T, nh * hd)
        return linear(out, p["o_w"], rows=rows), {"k": ck, "v": cv}, None
    S = ck.shape[1]
    g = nh // nkv
    qg = q.reshape(B, T, nkv, g, hd)
    scores = jnp.einsum("btngd,bsnd->bngts", qg, ck.astype(q.dtype), preferred_element_type=F32) * (hd ** -0.5)
    allowed = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]   # [B, T, S]
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    probs = softmax(scores).astype(q.dtype)
    out = jnp.einsum("bngts,bsnd->btngd", probs, cv.astype(q.dtype)).reshape(B, T, nh * hd)
    return linear(out, p["o_w"], rows=rows), {"k": ck, "v": cv}, None

def _native_attention(p, q, ck) -> bool:
    """Decode / verify rows (at most NATIVE_MAX_ROWS) of a model on the native kernels with an f32 or f16 cache: the native
    attention (kernels.attention, over the cache as it lies); prefills and the xla kernels keep the dots below."""
    w = p.get("qkv", p.get("q_w"))
    return (isinstance(w, QWeight) and w.kernel == "native" and q.shape[0] * q.shape[1] <= NATIVE_MAX_ROWS
            and ck.dtype in (jnp.float32, jnp.float16) and q.dtype == jnp.float32)


def attention(cfg: ModelConfig, p, x, cache, start, layer: int, prev_sel, rows=None):
    if cfg.is_mla:
        return mla.mla_attention(cfg, p, x, cache, start, layer, prev_sel)
    return gqa_attention(cfg, p, x, cache, start, rows)

def attn_block(cfg: ModelConfig, lp, x, cache, start, layer: int, prev_sel=None, rows=None):
    """h = x + Attn(RMSNorm_in(x)).  Returns (h, cache, sel) — sel is the DSA selection (None for GQA)."""
    a, cache, sel = attention(cfg, lp["attn"], rms_norm(x, lp["input_norm"], cfg.rms_norm_eps), cache, start, layer,
                              prev_sel, rows)
    return x + a, cache, sel

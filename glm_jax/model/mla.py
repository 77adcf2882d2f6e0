"""Multi-head latent attention (MLA): glm_moe_dsa (GLM-5) with the DSA sparse-attention indexer, glm4_moe_lite
(GLM-4.7-Flash) without it.

Pure JAX functions over plain dict params (HF orientation ``[out, in]``, math ``x @ W.T``); mirrors
transformers 5.25 ``GlmMoeDsaAttention`` / ``GlmMoeDsaIndexer`` and ``Glm4MoeLiteAttention`` (the same MLA; lite's
q_lora_rank may be None -- one ``q_proj`` --, its RoPE may be the half-split form: ``rope_interleave`` false).

Params of one layer (``load_mla_params``)::

    {"q_a_w":  [q_lora, H],            "q_a_norm": [q_lora],          # q_a_proj, q_a_layernorm (RMSNorm eps 1e-6)
     "q_b_w":  [nH*(nope+rope), q_lora],                               # q_b_proj; per head [nope | rope]
     ("q_proj_w": [nH*(nope+rope), H] instead of the three above where q_lora_rank is None)
     "kv_a_w": [kv_lora+rope, H],       "kv_a_norm": [kv_lora],        # kv_a_proj_with_mqa -> [c | k_rope]; kv_a_layernorm
     "kv_b_w": [nH*(nope+v), kv_lora],                                 # kv_b_proj; per head [k_nope | v]
     "o_w":    [H, nH*v],
     "q_a_b"?, "kv_a_b"?, "o_b"?       (only when cfg.attention_bias)
     "indexer"?: {"wq_b": [nI*dI, q_lora], "wk": [dI, H], "weights_proj": [nI, H] (f32),
                  "k_norm_w": [dI], "k_norm_b": [dI]}                 # only on "full" indexer layers
    }

Cache of one layer (``init_mla_cache``): ``{"ckv": [B,S,kv_lora], "kpe": [B,S,rope]}`` (+ ``"idx_k": [B,S,dI]`` on
full-indexer layers).  ``ckv`` is the kv_a-normed latent, ``kpe`` the RoPE'd shared key, ``idx_k`` the LayerNorm'd,
RoPE'd indexer key; slot j holds position j.

RoPE is HF's interleaved form: lanes (2i, 2i+1) rotate by one frequency and the output is written de-interleaved
(``cat([x_e cos - x_o sin, x_o cos + x_e sin])``).  q and k get the same permutation so the dot products are those of
the interleaved rotation; ``kpe`` / ``idx_k`` are stored in that de-interleaved order.  ``rope_interleave`` false
(glm4_moe_lite only): HF's ``apply_rotary_pos_emb``, halves rotated (``rotate_half``).

Indexer type of a layer: ``cfg.indexer_types[layer]``; the MTP layer (``layer == cfg.num_hidden_layers``) is
``"full"``: the hub GLM-5 checkpoints carry ``model.layers.78.self_attn.indexer.*`` and the MTP block runs alone (there
is no previous layer in its forward whose selection it could reuse).  transformers 5.24 builds no MTP module for
glm_moe_dsa (``get_mtp_config`` raises), so this is the vLLM/SGLang reading of the checkpoint.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels.formats import QWeight, qdot_grouped
from .layers import (
    linear,
    rms_norm,  # noqa: F401  (transformers numerics: f32 statistics, cast back before the weight)
)

MLA_NORM_EPS = 1e-6       # transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not rms_norm_eps
INDEXER_LN_EPS = 1e-6     # indexer.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6), with bias


# ----------------------------------------------------------------------------- config helpers
def indexer_type(cfg, layer: int) -> str:
    """"full" or "shared" for a main layer; the MTP layer (layer == num_hidden_layers) is "full"; "none" for every
    layer of a model without the DSA indexer (glm4_moe_lite)."""
    if not cfg.indexer_types:
        return "none"
    if layer >= cfg.num_hidden_layers:
        return "full"
    return cfg.indexer_types[layer]


def variant_layer(cfg, layer: int) -> int:
    """The layer index a compiled attention of ``layer`` is keyed on: the first main layer of the same indexer type
    (only ``indexer_type`` depends on the layer, so layers of one type share a program; a jit keyed on the layer
    itself compiled one program per layer: ~1 GB at GLM-5.2's 78)."""
    t = indexer_type(cfg, layer)
    if t == "none":
        return 0
    return next((i for i, ti in enumerate(cfg.indexer_types) if ti == t), layer)


def qk_head_dim(cfg) -> int:
    return int(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg) -> float:
    """``qk_head_dim^-0.5`` (x mscale(factor, mscale_all_dim)^2 when rope_type != default and mscale_all_dim set)."""
    s = qk_head_dim(cfg) ** -0.5
    rp = cfg.rope_parameters or {}
    if rp.get("rope_type", rp.get("type", "default")) != "default":
        mad = rp.get("mscale_all_dim", 0)
        if mad:
            m = _yarn_mscale(rp["factor"], mad)
            s = s * m * m
    return float(s)


def rope_inv_freq(cfg) -> tuple[np.ndarray, float]:
    """(inv_freq [rope/2] f32, attention_scaling) exactly as transformers' default / yarn init for this model
    (dim = qk_rope_head_dim: GlmMoeDsaConfig sets head_dim := qk_rope_head_dim)."""
    dim = int(cfg.qk_rope_head_dim)
    rp = cfg.rope_parameters or {}
    base = float(rp.get("rope_theta", cfg.rope_theta))
    rtype = rp.get("rope_type", rp.get("type", "default"))
    ar = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    if rtype == "default":
        return (1.0 / (np.float32(base) ** ar)).astype(np.float32), 1.0
    if rtype != "yarn":
        raise ValueError(f"{cfg.source}: unsupported rope_type {rtype!r} for {cfg.model_type}")
    prf = rp.get("partial_rotary_factor", 1.0)
    dim = int(dim * prf)
    ar = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    factor = rp.get("factor")
    omp = rp["original_max_position_embeddings"]
    if factor is None:
        factor = cfg.max_position_embeddings / omp
    att = rp.get("attention_factor")
    ms, msad = rp.get("mscale"), rp.get("mscale_all_dim")
    if att is None:
        att = float(_yarn_mscale(factor, ms) / _yarn_mscale(factor, msad)) if (ms and msad) else _yarn_mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def corr_dim(nrot):
        return (dim * math.log(omp / (nrot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = np.float32(base) ** ar
    extra = 1.0 / pos_freqs
    inter = 1.0 / (np.float32(factor) * pos_freqs)
    ef = 1 - ramp
    inv = inter * (1 - ef) + extra * ef
    return inv.astype(np.float32), float(att)


def rope_cos_sin(cfg, positions, dtype):
    """positions [...] int -> cos, sin [..., rope/2] (HF: cos(pos*inv_freq) * attention_scaling, cast to dtype)."""
    inv, att = rope_inv_freq(cfg)
    f = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    return (jnp.cos(f) * att).astype(dtype), (jnp.sin(f) * att).astype(dtype)


def apply_rope_interleave(x, cos, sin):
    """x [..., d] with cos/sin broadcastable to [..., d/2]; HF apply_rotary_pos_emb_interleave (de-interleaved out)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_rope_halves(x, cos, sin):
    """HF apply_rotary_pos_emb (rotate_half) with cos/sin of [..., d/2]: x * cat(cos, cos) + rotate_half(x) *
    cat(sin, sin), written per half."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mla_rope(cfg, x, cos, sin):
    """The attention's RoPE on q_rot / k_rot: interleaved pairs unless the config's rope_interleave is false."""
    return (apply_rope_interleave if cfg.rope_interleave else apply_rope_halves)(x, cos, sin)


def layer_norm(x, w, b, eps):
    x32 = x.astype(jnp.float32)
    mu = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)
    return y.astype(x.dtype)


def _lin(x, w, b=None):
    return linear(x, w, b)


# ----------------------------------------------------------------------------- params / cache
def load_mla_params(get: Callable, prefix: str, cfg, layer: int) -> dict:
    """Attention params of one layer from HF keys under ``prefix`` (e.g. ``"model.layers.3.self_attn."``).

    ``get(key, expected_shape)`` is the loader's getter (raises naming the key / shape).  The indexer is loaded on
    ``indexer_type(cfg, layer) == "full"`` layers (the MTP layer included)."""
    H, nH = cfg.hidden_size, cfg.num_attention_heads
    ql, kl = cfg.q_lora_rank, cfg.kv_lora_rank
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if ql is None:
        p = {"q_proj_w": get(prefix + "q_proj.weight", (nH * (nope + rope), H))}
    else:
        p = {"q_a_w": get(prefix + "q_a_proj.weight", (ql, H)),
             "q_a_norm": get(prefix + "q_a_layernorm.weight", (ql,)),
             "q_b_w": get(prefix + "q_b_proj.weight", (nH * (nope + rope), ql))}
    p.update({
        "kv_a_w": get(prefix + "kv_a_proj_with_mqa.weight", (kl + rope, H)),
        "kv_a_norm": get(prefix + "kv_a_layernorm.weight", (kl,)),
        "kv_b_w": get(prefix + "kv_b_proj.weight", (nH * (nope + v), kl)),
        "o_w": get(prefix + "o_proj.weight", (H, nH * v)),
    })
    if cfg.attention_bias:
        if ql is not None:          # transformers' q_proj (no q LoRA) has no bias
            p["q_a_b"] = get(prefix + "q_a_proj.bias", (ql,))
        p["kv_a_b"] = get(prefix + "kv_a_proj_with_mqa.bias", (kl + rope,))
        p["o_b"] = get(prefix + "o_proj.bias", (H,))
    if indexer_type(cfg, layer) == "full":
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        ip = prefix + "indexer."
        p["indexer"] = {
            "wq_b": get(ip + "wq_b.weight", (nI * dI, ql)),
            "wk": get(ip + "wk.weight", (dI, H)),
            # transformers keeps indexer.weights_proj in fp32 (_keep_in_fp32_modules)
            "weights_proj": np.asarray(get(ip + "weights_proj.weight", (nI, H)), np.float32),
            "k_norm_w": get(ip + "k_norm.weight", (dI,)),
            "k_norm_b": get(ip + "k_norm.bias", (dI,)),
        }
    return p


def _cut_kv_b(kv_b, nH: int, nope: int, v: int) -> tuple:
    """kv_b_proj [nH*(nope+v), kl] (numpy or jax) -> (W_UK^T [nH, kl, nope], W_UV [nH, v, kl]) as views."""
    kv_b = kv_b.reshape(nH, nope + v, -1)
    return kv_b[:, :nope, :].swapaxes(1, 2), kv_b[:, nope:, :]


def split_kv_b(p: dict, nH: int, nope: int, v: int) -> tuple:
    """(W_UK^T [nH, kl, nope], W_UV [nH, v, kl]): as loaded on one device (``w_uk_t`` / ``w_uv``, contiguous), else
    cut out of kv_b_proj [nH*(nope+v), kl] -- XLA:CPU copies those slices on every step (2 x 29 MB a layer at
    GLM-5.2's widths in f32: 40 % of a decode step on the 64-expert slice, profiled).  W_UK is kept transposed so
    that both absorbed products contract the weights' last axis (as ``x @ W.T``): contracting W_UK's middle axis
    ran as a strided batched GEMM at ~1.3 GB/s, 20 ms a layer a step there."""
    if "w_uk_t" in p:
        return p["w_uk_t"], p["w_uv"]
    return _cut_kv_b(p["kv_b_w"], nH, nope, v)


def presplit_kv_b(p: dict, nH: int, nope: int, v: int) -> dict:
    """``p`` (an MLA attention's loaded params) with kv_b_proj replaced by contiguous ``w_uk_t`` / ``w_uv``
    (numpy, the loaded dtype): what ``split_kv_b`` would cut on every step, done once."""
    p = dict(p)
    w_uk_t, w_uv = _cut_kv_b(np.asarray(p.pop("kv_b_w")), nH, nope, v)
    p["w_uk_t"], p["w_uv"] = np.ascontiguousarray(w_uk_t), np.ascontiguousarray(w_uv)
    return p


def init_mla_cache(cfg, layer: int, batch: int, max_len: int, dtype) -> dict:
    c = {"ckv": jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
         "kpe": jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype)}
    if indexer_type(cfg, layer) == "full":
        c["idx_k"] = jnp.zeros((batch, max_len, cfg.index_head_dim), dtype)
    return c


def kv_bytes_per_token(cfg, dtype_bytes: int) -> dict:
    """KV-cache bytes per token: per layer kind, summed over the main layers, and the uncompressed equivalent
    (a plain MHA cache of the expanded keys/values: nH * (qk_head_dim + v_head_dim) per layer)."""
    mla = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    idx = (cfg.index_head_dim or 0) * dtype_bytes          # no DSA indexer (glm4_moe_lite): no indexer keys
    n_full = sum(1 for t in cfg.indexer_types if t == "full")
    L = cfg.num_hidden_layers
    unc = cfg.num_attention_heads * (qk_head_dim(cfg) + cfg.v_head_dim) * dtype_bytes
    return {
        "per_layer_shared": mla,
        "per_layer_full": mla + idx,
        "per_layer_uncompressed": unc,
        "model_total": L * mla + n_full * idx,
        "model_total_uncompressed": L * unc,
        "mtp_layer": mla + idx,
        "ratio": (L * unc) / (L * mla + n_full * idx),
    }


# ----------------------------------------------------------------------------- pieces
def _write_rows(cache_arr, new, start):
    """cache_arr [B,S,D], new [B,T,D], start [B] -> row b gets new[b] at positions start[b].."""
    def one(c, n, s):
        return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (s, jnp.zeros((), s.dtype)))
    return jax.vmap(one)(cache_arr, new, start)


def _front(cfg, p, x, positions):
    """q_resid, q_nope [B,T,nH,nope], q_rot [B,T,nH,rope] (RoPE'd), ckv [B,T,kl], kpe [B,T,rope] (RoPE'd), cos, sin."""
    B, T, _ = x.shape
    nH, nope, rope, kl = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if "q_proj_w" in p:                                                # no q LoRA (glm4_moe_lite may)
        q_resid, q = None, _lin(x, p["q_proj_w"])
    else:
        q_resid = rms_norm(_lin(x, p["q_a_w"], p.get("q_a_b")), p["q_a_norm"], MLA_NORM_EPS)
        q = _lin(q_resid, p["q_b_w"])
    q = q.reshape(B, T, nH, nope + rope)
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    kv = _lin(x, p["kv_a_w"], p.get("kv_a_b"))
    ckv = rms_norm(kv[..., :kl], p["kv_a_norm"], MLA_NORM_EPS)
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)                  # [B,T,rope/2]
    q_rot = mla_rope(cfg, q_rot, cos[:, :, None, :], sin[:, :, None, :])
    kpe = mla_rope(cfg, kv[..., kl:], cos, sin)
    return q_resid, q_nope, q_rot, ckv, kpe, cos, sin


def indexer_keys(cfg, ip, x, cos, sin):
    """Indexer keys of the new tokens: LayerNorm(x @ wk^T) with RoPE on the first qk_rope_head_dim lanes. [B,T,dI]"""
    rope = cfg.qk_rope_head_dim
    k = layer_norm(_lin(x, ip["wk"]), ip["k_norm_w"], ip["k_norm_b"], INDEXER_LN_EPS)
    return jnp.concatenate([apply_rope_interleave(k[..., :rope], cos, sin), k[..., rope:]], axis=-1)


def indexer_scores(cfg, ip, x, q_resid, idx_k, cos, sin, visible):
    """score[b,t,s] = sum_h w[b,t,h] relu(qI[b,t,h] . kI[b,s] * dI^-0.5), w = (x @ Wp^T)_f32 * nI^-0.5;
    -inf where not ``visible`` [B,T,S].  All in f32 (HF runs the indexer in fp32)."""
    B, T, _ = x.shape
    nI, dI, rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = _lin(q_resid, ip["wq_b"]).reshape(B, T, nI, dI)
    q = jnp.concatenate([apply_rope_interleave(q[..., :rope], cos[:, :, None, :], sin[:, :, None, :]),
                         q[..., rope:]], axis=-1)
    # one [S, dI] x [dI, T*nI] matmul per row (the keys as the long side): XLA:CPU ran the 4-d einsum
    # "bthd,bsd->bths" ~5x slower at S = 64K, T = 1 (docs/real-scale.md)
    s = jnp.matmul(idx_k.astype(jnp.float32), q.astype(jnp.float32).reshape(B, T * nI, dI).transpose(0, 2, 1))
    s = jax.nn.relu(s * (dI ** -0.5)).reshape(B, -1, T, nI)                                 # [B,S,T,nI]
    w = (x.astype(jnp.float32) @ ip["weights_proj"].astype(jnp.float32).T) * (nI ** -0.5)   # [B,T,nI]
    sc = jnp.einsum("bsth,bth->bts", s, w)
    return jnp.where(visible, sc, -jnp.inf)


def topk_count(cfg, max_len: int) -> int:
    return int(min(cfg.index_topk, max_len))


def selection_mask(sel, S: int):
    """sel [B,T,k] int32 key positions -> bool [B,T,S] (True at selected keys)."""
    B, T, _ = sel.shape
    m = jnp.zeros((B, T, S), bool)
    return jax.vmap(jax.vmap(lambda r, i: r.at[i].set(True)))(m, sel)


# largest gathered key block (T x k x (kv_lora + rope) elements) the sparse path builds; above it (long prefill
# chunks) the dense masked path runs instead: 2**26 elements = 128 MiB in bf16
GATHER_MAX_ELEMS = 1 << 26


def use_gather(cfg, T: int, k: int, S: int) -> bool:
    """Whether attention over a selection of k keys (of S cache slots) gathers those keys (O(k) per query and head)
    instead of masking the dense O(S) scores: when k < S and the gathered block stays under GATHER_MAX_ELEMS."""
    return k < S and T * k * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) <= GATHER_MAX_ELEMS


def _per_head(x, w, spec: str):
    """The absorbed per-head product ``einsum(spec, x, w)`` (x [B, T, nH, in], w [nH, out, in]): w a float array,
    or a grouped QWeight (packed in a quantized dense format: formats.to_qweight_grouped) on the native kernel."""
    if isinstance(w, QWeight):
        return qdot_grouped(x, w).astype(x.dtype)
    return jnp.einsum(spec, x, w)


def _float(w, dtype):
    """A per-head weight as a float array (the non-absorbed form expands the cache through it)."""
    return w.dequant(dtype) if isinstance(w, QWeight) else w


def _sparse_absorbed(cfg, q_nope, q_rot, ckv, kpe, sel, positions, w_uk_t, w_uv, scale, dtype):
    """Absorbed MLA over the selected keys only: gather sel's ckv / kpe rows ([B,T,k,.]), scores [B,nH,T,k],
    selected keys past the query's position masked (sel may hold invisible slots when fewer keys than k are
    visible).  The result equals the dense path with the selection mask (tests/test_mla.py)."""
    f32 = jnp.float32
    ckv_g = jax.vmap(lambda c, i: c[i])(ckv, sel).astype(dtype)                      # [B,T,k,kl] (an f16 cache's
    kpe_g = jax.vmap(lambda c, i: c[i])(kpe, sel).astype(dtype)                      # [B,T,k,rope]  rows widened)
    q_lat = _per_head(q_nope, w_uk_t, "bthd,hcd->bthc")                              # [B,T,nH,kl]
    sc = (jnp.einsum("bthc,btkc->bhtk", q_lat, ckv_g, preferred_element_type=f32)
          + jnp.einsum("bthr,btkr->bhtk", q_rot, kpe_g, preferred_element_type=f32)) * scale
    ok = sel <= positions[:, :, None]                                                # [B,T,k]
    sc = jnp.where(ok[:, None, :, :], sc, -jnp.inf)
    pr = jax.nn.softmax(sc, axis=-1).astype(dtype)
    o_lat = jnp.einsum("bhtk,btkc->bthc", pr, ckv_g)
    return _per_head(o_lat, w_uv, "bthc,hvc->bthv")


# ----------------------------------------------------------------------------- attention
def mla_attention(cfg, p: dict, x, cache: dict, start, layer: int, prev_sel=None, absorbed: bool = True,
                  dense_shortcut: bool = True, gather=None):
    """One MLA(+DSA) attention over a static cache.

    x [B,T,H] (already input-normed); start [B] int32: the T tokens sit at positions start[b]..start[b]+T-1 and
    are written there (ckv, kpe, and idx_k on full layers); queries attend to cache positions j <= own position,
    restricted to the DSA selection.  Full layers compute sel = top-k(indexer score) with k = min(index_topk, S_max)
    over visible keys; shared layers use ``prev_sel`` (the previous layer's sel).

    Returns (out [B,T,H] after o_proj, new cache, sel [B,T,k] int32 | None).  ``sel is None`` means "every visible
    key" and is returned by full layers when index_topk >= S_max with ``dense_shortcut`` (exact: top-k then picks
    every visible key; the indexer keys are still cached); a shared layer given ``prev_sel=None`` is dense too.
    Entries of sel that point at invisible positions (fewer visible keys than k) are masked by causality, which is
    what transformers' min(index_topk, S) does.

    ``absorbed=True``: attention over the compressed cache with W_UK folded into q and W_UV applied after
    attention; ``absorbed=False``: expand the cache through kv_b_proj (transformers' form).  Same algebra.
    ``gather`` (absorbed only, with a selection): True attends over the gathered top-k keys (O(k) per query and
    head), False masks the dense O(S) scores, None (default) picks by ``use_gather``.  Same result.
    """
    B, T, H = x.shape
    S = cache["ckv"].shape[1]
    nH, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    start = jnp.asarray(start, jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]          # [B,T]
    q_resid, q_nope, q_rot, ckv_new, kpe_new, cos, sin = _front(cfg, p, x, positions)

    new_cache = dict(cache)
    new_cache["ckv"] = _write_rows(cache["ckv"], ckv_new, start)
    new_cache["kpe"] = _write_rows(cache["kpe"], kpe_new, start)
    visible = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]   # [B,T,S]

    full = indexer_type(cfg, layer) == "full"
    if full:
        ip = p["indexer"]
        new_cache["idx_k"] = _write_rows(cache["idx_k"], indexer_keys(cfg, ip, x, cos, sin), start)
        k = topk_count(cfg, S)
        if dense_shortcut and k >= S:
            sel = None
        else:
            sc = indexer_scores(cfg, ip, x, q_resid, new_cache["idx_k"], cos, sin, visible)
            sel = jax.lax.top_k(sc, k)[1].astype(jnp.int32)
    else:
        sel = prev_sel

    ckv, kpe = new_cache["ckv"], new_cache["kpe"]
    scale = softmax_scale(cfg)
    w_uk_t, w_uv = split_kv_b(p, nH, nope, v)                                       # [nH,kl,nope], [nH,v,kl]
    if sel is not None and absorbed and (use_gather(cfg, T, sel.shape[-1], S) if gather is None else gather):
        o = _sparse_absorbed(cfg, q_nope, q_rot, ckv, kpe, sel, positions, w_uk_t, w_uv, scale, x.dtype)
        return _lin(o.reshape(B, T, nH * v), p["o_w"], p.get("o_b")), new_cache, sel
    mask = visible if sel is None else (visible & selection_mask(sel, S))
    f32 = jnp.float32
    ckv, kpe = ckv.astype(x.dtype), kpe.astype(x.dtype)                           # an f16 cache widened
    if absorbed:
        q_lat = _per_head(q_nope, w_uk_t, "bthd,hcd->bthc")                          # [B,T,nH,kl]
        sc = (jnp.einsum("bthc,bsc->bhts", q_lat, ckv, preferred_element_type=f32)
              + jnp.einsum("bthr,bsr->bhts", q_rot, kpe, preferred_element_type=f32)) * scale
    else:
        k_nope = jnp.einsum("bsc,hcd->bshd", ckv, _float(w_uk_t, ckv.dtype))
        vals = jnp.einsum("bsc,hdc->bshd", ckv, _float(w_uv, ckv.dtype))
        sc = (jnp.einsum("bthd,bshd->bhts", q_nope, k_nope, preferred_element_type=f32)
              + jnp.einsum("bthr,bsr->bhts", q_rot, kpe, preferred_element_type=f32)) * scale
    sc = jnp.where(mask[:, None, :, :], sc, -jnp.inf)
    pr = jax.nn.softmax(sc, axis=-1).astype(x.dtype)
    if absorbed:
        o_lat = jnp.einsum("bhts,bsc->bthc", pr, ckv)                                # [B,T,nH,kl]
        o = _per_head(o_lat, w_uv, "bthc,hvc->bthv")
    else:
        o = jnp.einsum("bhts,bshv->bthv", pr, vals)
    out = _lin(o.reshape(B, T, nH * v), p["o_w"], p.get("o_b"))
    return out, new_cache, sel

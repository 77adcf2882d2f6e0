"""glm5_next's indexed attention: MLA without RoPE whose DSA indexer selects k-pooled groups of tokens.

Mirrors transformers 5.25 ``Glm5NextTextAttention`` / ``Glm5NextTextIndexer``.  Beside glm_moe_dsa's (``mla.py``):

* no RoPE anywhere (qk_rope_head_dim = 0): the cache holds the kv_a-normed latent ``ckv`` alone;
* q_a_layernorm / kv_a_layernorm use rms_norm_eps (glm_moe_dsa builds them with 1e-6);
* the indexer scores *pools*: the keys of tokens [p*kp, (p+1)*kp) (kp = index_kpool) averaged with per-channel
  softmax weights ``gate(x) + ape[position in pool]``; a pool is a candidate once its last token is visible; the
  top ``index_topk / kp`` pools are expanded back to their tokens, and the incomplete tail (the tokens after the
  last complete pool up to the query) is always appended: a selection of index_topk + kp - 1 token positions,
  -1 where unused;
* "shared" layers reuse the selection of the last "full" one (``sel`` rides along through the KDA layers).

Params of one layer (``load_pooled_params``): mla.py's MLA keys without biases plus, on full layers,
``"indexer": {"wq_b": [nI*dI, q_lora], "wk": [dI, H], "k_norm_w", "k_norm_b": [dI], "weights_proj": [nI, H] f32,
"ape": [kp, dI], "gate_w": [dI, H]}``.  Cache of one layer: ``{"ckv": [B, S, kv_lora]}`` (+ ``"idx_k"``,
``"idx_g"``: [B, S, dI], the normed indexer key and the pooling gate of each token, on full layers).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .layers import F32, linear, rms_norm
from .mla import GATHER_MAX_ELEMS, INDEXER_LN_EPS, _per_head, _write_rows, layer_norm, split_kv_b


def load_pooled_params(get: Callable, prefix: str, cfg, full: bool) -> dict:
    H, nH = cfg.hidden_size, cfg.num_attention_heads
    ql, kl, nope, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    p = {"q_a_w": get(prefix + "q_a_proj.weight", (ql, H)), "q_a_norm": get(prefix + "q_a_layernorm.weight", (ql,)),
         "q_b_w": get(prefix + "q_b_proj.weight", (nH * nope, ql)),
         "kv_a_w": get(prefix + "kv_a_proj_with_mqa.weight", (kl, H)),
         "kv_a_norm": get(prefix + "kv_a_layernorm.weight", (kl,)),
         "kv_b_w": get(prefix + "kv_b_proj.weight", (nH * (nope + v), kl)),
         "o_w": get(prefix + "o_proj.weight", (H, nH * v))}
    if full:
        nI, dI, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
        ip = prefix + "indexer."
        p["indexer"] = {"wq_b": get(ip + "wq_b.weight", (nI * dI, ql)), "wk": get(ip + "wk.weight", (dI, H)),
                        "k_norm_w": get(ip + "k_norm.weight", (dI,)), "k_norm_b": get(ip + "k_norm.bias", (dI,)),
                        "weights_proj": np.asarray(get(ip + "weights_proj.weight", (nI, H)), np.float32),
                        "ape": get(ip + "index_kpool_compress_ape", (kp, dI)),
                        "gate_w": get(ip + "index_kpool_compress_gate", (dI, H))}
    return p


def init_pooled_cache(cfg, full: bool, batch: int, max_len: int, dtype) -> dict:
    c = {"ckv": jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype)}
    if full:
        c["idx_k"] = jnp.zeros((batch, max_len, cfg.index_head_dim), dtype)
        c["idx_g"] = jnp.zeros((batch, max_len, cfg.index_head_dim), dtype)
    return c


def kv_bytes_per_token(cfg, dtype_bytes: int, full: bool) -> int:
    return (cfg.kv_lora_rank + (2 * cfg.index_head_dim if full else 0)) * dtype_bytes


def pooled_keys(idx_k, idx_g, ape):
    """Pool keys [B, P, dI] over the cache's P = ceil(S / kp) groups: per channel, softmax over the pool's tokens
    of gate + ape, weighting their keys (only complete pools are ever candidates; a partial one's value is unused)."""
    B, S, dI = idx_k.shape
    kp = ape.shape[0]
    pad = (-S) % kp
    k = jnp.pad(idx_k.astype(F32), ((0, 0), (0, pad), (0, 0))).reshape(B, -1, kp, dI)
    g = jnp.pad(idx_g.astype(F32), ((0, 0), (0, pad), (0, 0))).reshape(B, -1, kp, dI)
    w = jax.nn.softmax(g + ape.astype(F32)[None, None], axis=2)
    return jnp.sum(w * k, axis=2)


def select(cfg, ip, x, q_resid, cache, positions):
    """The k-pooled selection: [B, T, (index_topk / kp) * kp + kp - 1] int32 token positions, -1 where unused."""
    B, T, _ = x.shape
    nI, dI, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    pk = pooled_keys(cache["idx_k"], cache["idx_g"], ip["ape"])                          # [B, P, dI]
    P = pk.shape[1]
    q = linear(q_resid, ip["wq_b"]).reshape(B, T, nI, dI).astype(F32)
    s = jax.nn.relu(jnp.einsum("bthd,bpd->bthp", q, pk) * (dI ** -0.5))
    w = (x.astype(F32) @ ip["weights_proj"].astype(F32).T) * (nI ** -0.5)                # [B, T, nI]
    sc = jnp.einsum("bthp,bth->btp", s, w)
    ends = (jnp.arange(P, dtype=jnp.int32) + 1) * kp - 1
    visible = ends[None, None, :] <= positions[:, :, None]                               # [B, T, P]
    kpools = min(cfg.index_topk // kp, P)
    _, pid = jax.lax.top_k(jnp.where(visible, sc, -jnp.inf), kpools)                     # [B, T, kpools]
    ok = jnp.take_along_axis(visible, pid, axis=-1)
    toks = pid[..., None] * kp + jnp.arange(kp, dtype=jnp.int32)
    sel = jnp.where(ok[..., None], toks, -1).reshape(B, T, kpools * kp)
    if cfg.index_kpool_always_select_tail and kp > 1:
        n_tail = (positions + 1) % kp
        off = jnp.arange(kp - 1, dtype=jnp.int32)
        tail = (positions + 1 - n_tail)[..., None] + off
        sel = jnp.concatenate([sel, jnp.where(off < n_tail[..., None], tail, -1)], axis=-1)
    return sel.astype(jnp.int32)


def use_gather(cfg, T: int, k: int, S: int) -> bool:
    """Attend over the k gathered selected keys (O(k) per query and head) where k < S and the gathered block
    (T x k x kv_lora) stays under mla.GATHER_MAX_ELEMS; else mask the dense O(S) scores (a long prefill chunk: at
    GLM-5.3-Flash's widths 512 queries x 2063 picks x 512 lanes would gather 2 GB in f32)."""
    return k < S and T * k * cfg.kv_lora_rank <= GATHER_MAX_ELEMS


def selected(sel, S: int):
    """sel [B, T, k] (token positions, -1 unused) -> bool [B, T, S]."""
    B, T, _ = sel.shape
    m = jnp.zeros((B, T, S + 1), bool)
    return jax.vmap(jax.vmap(lambda r, i: r.at[i].set(True)))(m, jnp.where(sel >= 0, sel, S))[..., :S]


def pooled_attention(cfg, p: dict, x, cache: dict, start, full: bool, prev_sel=None, gather=None):
    """One indexed layer over a static cache: x [B, T, H] (input-normed) at positions start[b].., written there.
    Full layers select with their own indexer, shared ones attend over ``prev_sel``.  Attention is absorbed MLA
    over the selection, gathered or masked (``use_gather``; ``gather`` forces either: the same result).
    Returns (out [B, T, H], cache, sel)."""
    B, T, _ = x.shape
    nH, nope, v, kl = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    eps = cfg.rms_norm_eps
    start = jnp.asarray(start, jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    q_resid = rms_norm(linear(x, p["q_a_w"]), p["q_a_norm"], eps)
    q_nope = linear(q_resid, p["q_b_w"]).reshape(B, T, nH, nope)
    cache = dict(cache, ckv=_write_rows(cache["ckv"], rms_norm(linear(x, p["kv_a_w"]), p["kv_a_norm"], eps), start))
    if full:
        ip = p["indexer"]
        k = layer_norm(linear(x, ip["wk"]), ip["k_norm_w"], ip["k_norm_b"], INDEXER_LN_EPS)
        cache["idx_k"] = _write_rows(cache["idx_k"], k, start)
        cache["idx_g"] = _write_rows(cache["idx_g"], linear(x, ip["gate_w"]), start)
        sel = select(cfg, ip, x, q_resid, cache, positions)
    else:
        sel = prev_sel
    S = cache["ckv"].shape[1]
    w_uk_t, w_uv = split_kv_b(p, nH, nope, v)
    q_lat = _per_head(q_nope, w_uk_t, "bthd,hcd->bthc")
    if use_gather(cfg, T, sel.shape[-1], S) if gather is None else gather:
        keys = jax.vmap(lambda c, i: c[i])(cache["ckv"], jnp.clip(sel, 0, S - 1)).astype(x.dtype)  # [B,T,k,kl]
        ok = (sel >= 0) & (sel <= positions[:, :, None])
        spec_s, spec_o = "bthc,btkc->bhtk", "bhtk,btkc->bthc"
    else:
        keys = cache["ckv"].astype(x.dtype)                                                         # [B,S,kl]
        ok = selected(sel, S) & (jnp.arange(S, dtype=jnp.int32)[None, None, :] <= positions[:, :, None])
        spec_s, spec_o = "bthc,bkc->bhtk", "bhtk,bkc->bthc"
    sc = jnp.einsum(spec_s, q_lat, keys, preferred_element_type=F32) * (nope ** -0.5)
    pr = jax.nn.softmax(jnp.where(ok[:, None], sc, -jnp.inf), axis=-1).astype(x.dtype)
    o = _per_head(jnp.einsum(spec_o, pr, keys), w_uv, "bthc,hvc->bthv")
    return linear(o.reshape(B, T, nH * v), p["o_w"]), cache, sel

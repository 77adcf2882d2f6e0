"""KDA (Kimi delta attention): glm5_next's linear attention, a gated delta rule over a per-head recurrent state.

Mirrors transformers 5.25 ``Glm5NextTextLinearAttention`` with its torch reference kernels
(``chunk_kimi_delta_attention`` for prefill, ``recurrent_kimi_delta_attention`` for decode).  Per layer:

    q, k, v = silu(causal depthwise conv over the last K inputs of [x Wq^T | x Wk^T | x Wv^T])   (per head: dk)
    g = lb * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))      (lb = linear_lower_bound; per head and key lane)
    beta = sigmoid(x Wb^T)                                      (per head)
    q, k = l2norm(q), l2norm(k);  q *= dk^-0.5
    S_t = S_{t-1} * exp(g_t);  S_t += k_t (beta_t (v_t - k_t S_t));  o_t = q_t S_t          (S: [heads, dk, dv])
    out = o_proj(rmsnorm(o) * w * sigmoid(g_b(g_a(x))))

Its state replaces the K/V cache: ``{"conv": [B, K-1, 3*nh*dk] (the last K-1 projected inputs), "rec": [B, nh,
dk, dv] f32}``.  Padding positions (``valid`` False, after a row's real tokens) leave both unchanged: their decay is
0 and their beta 0, and the conv state is cut after the last real token.

Params of one layer (HF orientation ``[out, in]``; ``load_kda_params``)::

    {"q_w", "k_w", "v_w": [nh*dk, H], "conv_w": [3*nh*dk, K] f32, "f_a_w": [dk, H], "f_b_w": [nh*dk, dk],
     "dt_bias": [nh*dk] f32, "A_log": [nh] f32, "b_w": [nh, H], "g_a_w": [dk, H], "g_b_w": [nh*dk, dk],
     "o_norm": [dk], "o_w": [H, nh*dk]}
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .layers import F32, linear

CHUNK = 64          # transformers' chunk_kimi_delta_attention chunk size
STATE_KEYS = ("conv", "rec")   # a layer cache's per-row state entries: no position axis (never windowed or grown)
L2_EPS = 1e-6       # FLA's l2norm: x / sqrt(sum x^2 + eps)


def dims(cfg) -> tuple:
    return int(cfg.linear_num_heads), int(cfg.linear_head_dim), int(cfg.linear_conv_kernel_dim)


def init_kda_state(cfg, batch: int) -> dict:
    nh, dk, K = dims(cfg)
    return {"conv": jnp.zeros((batch, K - 1, 3 * nh * dk), F32), "rec": jnp.zeros((batch, nh, dk, dk), F32)}


def state_bytes(cfg) -> int:
    """Bytes of one row's KDA state in one layer (f32; independent of the sequence length)."""
    nh, dk, K = dims(cfg)
    return 4 * ((K - 1) * 3 * nh * dk + nh * dk * dk)


def load_kda_params(get: Callable, prefix: str, cfg) -> dict:
    """One KDA layer's params from HF keys under ``prefix`` (``...layers.N.self_attn.``): q/k/v conv weights are
    stored apart ([D, 1, K] each) and concatenated here in q, k, v order, as transformers' conversion does."""
    nh, dk, K = dims(cfg)
    H, D = cfg.hidden_size, nh * dk
    conv = [np.asarray(get(prefix + f"{n}_conv1d.weight", (D, 1, K)), np.float32)[:, 0, :] for n in "qkv"]
    return {
        "q_w": get(prefix + "q_proj.weight", (D, H)), "k_w": get(prefix + "k_proj.weight", (D, H)),
        "v_w": get(prefix + "v_proj.weight", (D, H)), "conv_w": np.concatenate(conv, axis=0),
        "f_a_w": get(prefix + "f_a_proj.weight", (dk, H)), "f_b_w": get(prefix + "f_b_proj.weight", (D, dk)),
        "dt_bias": np.asarray(get(prefix + "dt_bias", (D,)), np.float32),
        "A_log": np.asarray(get(prefix + "A_log", (nh,)), np.float32),
        "b_w": get(prefix + "b_proj.weight", (nh, H)),
        "g_a_w": get(prefix + "g_a_proj.weight", (dk, H)), "g_b_w": get(prefix + "g_b_proj.weight", (D, dk)),
        "o_norm": get(prefix + "o_norm.weight", (dk,)), "o_w": get(prefix + "o_proj.weight", (H, D)),
    }


def short_conv(xs, conv_state, w, lengths):
    """Causal depthwise conv + silu.  xs [B, T, C] new inputs, conv_state [B, K-1, C] the inputs before them, w [C, K]
    (torch's cross-correlation: out[t] = sum_j w[:, j] * in[t - K + 1 + j]).  Returns (out [B, T, C] f32, the state
    after each row's ``lengths`` real inputs)."""
    K = w.shape[1]
    full = jnp.concatenate([conv_state.astype(F32), xs.astype(F32)], axis=1)             # [B, K-1+T, C]
    T = xs.shape[1]
    out = sum(full[:, j:j + T, :] * w[:, j].astype(F32) for j in range(K))
    new = jax.vmap(lambda f, n: jax.lax.dynamic_slice_in_dim(f, n, K - 1, axis=0))(full, lengths)
    return jax.nn.silu(out), new


def l2norm(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def gates(cfg, p, x, valid):
    """(g [B, T, nh, dk] log-decay, beta [B, T, nh]) in f32; 0 and 0 at padding positions (the state passes)."""
    nh, dk, _ = dims(cfg)
    B, T, _ = x.shape
    f = linear(linear(x, p["f_a_w"]), p["f_b_w"]).astype(F32) + p["dt_bias"].astype(F32)
    f = f.reshape(B, T, nh, dk)
    a = jnp.exp(p["A_log"].astype(F32))[None, None, :, None]
    lb = cfg.linear_lower_bound
    if lb is not None:
        g = lb * jax.nn.sigmoid(a * f)
    else:
        g = -a * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))
    beta = jax.nn.sigmoid(linear(x, p["b_w"]).astype(F32))
    m = valid[:, :, None]
    return jnp.where(m[..., None], g, 0.0), jnp.where(m, beta, 0.0)


def recurrent(q, k, v, g, beta, state):
    """The decode form, one token at a time.  q, k [B, T, nh, dk] (l2-normed, q scaled), v [B, T, nh, dv], g [B, T,
    nh, dk], beta [B, T, nh], state [B, nh, dk, dv] f32.  Returns (o [B, T, nh, dv] f32, state)."""
    def one(S, xs):
        qt, kt, vt, gt, bt = xs
        S = S * jnp.exp(gt)[..., None]
        kv = jnp.einsum("bhkv,bhk->bhv", S, kt)
        delta = (vt - kv) * bt[..., None]
        S = S + kt[..., None] * delta[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, qt)
    xs = tuple(jnp.moveaxis(a.astype(F32), 1, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(one, state.astype(F32), xs)
    return jnp.moveaxis(o, 0, 1), state


def _chunk_step(S, xs):
    """One chunk of ``chunked`` (transformers' chunk_kimi_delta_attention, per chunk): q, k, v, g [B, nh, C, d],
    beta [B, nh, C]."""
    q, k, v, g, beta = xs
    C = q.shape[2]
    g = jnp.cumsum(g, axis=2)
    causal = jnp.tril(jnp.ones((C, C), bool))                                   # [i, j]: j <= i
    decay = jnp.where(causal[..., None], jnp.exp(jnp.where(causal[..., None], g[:, :, :, None, :] - g[:, :, None, :, :],
                                                           0.0)), 0.0)          # [B, nh, C(i), C(j), dk]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    n = jnp.where(strict, -jnp.einsum("bhid,bhjd,bhijd->bhij", k_beta, k, decay), 0.0)
    # the reference's row-by-row substitution computes (I - N)^-1 (N strictly lower): the unit-lower solve
    eye = jnp.eye(C, dtype=F32)
    t = jax.scipy.linalg.solve_triangular(eye - n, jnp.broadcast_to(eye, n.shape), lower=True, unit_diagonal=True)
    u = t @ v_beta
    w = t @ (k_beta * jnp.exp(g))
    inter = (q * jnp.exp(g)) @ S
    intra = jnp.where(causal, jnp.einsum("bhid,bhjd,bhijd->bhij", q, k, decay), 0.0)
    v_new = u - w @ S
    o = inter + intra @ v_new
    g_last = g[:, :, -1:, :]                                                    # [B, nh, 1, dk]
    S = S * jnp.exp(g_last[:, :, 0, :])[..., None] + jnp.swapaxes(k * jnp.exp(g_last - g), -1, -2) @ v_new
    return S, o


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The prefill form: the same outputs and final state as ``recurrent`` (to f32 rounding), a chunk of ``chunk``
    tokens at a time (the sequence zero-padded to a multiple: a zero key and beta leave the state as it is)."""
    B, T, nh, dk = k.shape
    C = min(chunk, T)
    pad = (-T) % C
    def prep(a):
        a = jnp.moveaxis(a.astype(F32), 1, 2)                                   # [B, nh, T, ...]
        a = jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))
        a = a.reshape(B, nh, -1, C, *a.shape[3:])
        return jnp.moveaxis(a, 2, 0)                                            # [n, B, nh, C, ...]
    state, o = jax.lax.scan(_chunk_step, state.astype(F32), tuple(prep(a) for a in (q, k, v, g, beta)))
    o = jnp.moveaxis(o, 0, 2).reshape(B, nh, -1, o.shape[-1])[:, :, :T]
    return jnp.moveaxis(o, 1, 2), state


def kda_attention(cfg, p, x, state: dict, valid, use_chunked: Optional[bool] = None):
    """x [B, T, H] (input-normed), state (``init_kda_state``), valid [B, T] bool (real tokens first in each row).
    ``use_chunked`` (default: T > 1) picks the prefill form.  Returns (out [B, T, H], new state)."""
    nh, dk, _ = dims(cfg)
    B, T, _ = x.shape
    D = nh * dk
    lengths = jnp.sum(valid, axis=1).astype(jnp.int32)
    qkv = jnp.concatenate([linear(x, p["q_w"]), linear(x, p["k_w"]), linear(x, p["v_w"])], axis=-1)
    qkv, conv = short_conv(qkv, state["conv"], p["conv_w"], lengths)
    q, k, v = (qkv[..., i * D:(i + 1) * D].reshape(B, T, nh, dk) for i in range(3))
    g, beta = gates(cfg, p, x, valid)
    q = l2norm(q) * (dk ** -0.5)
    k = l2norm(k)
    form = chunked if (T > 1 if use_chunked is None else use_chunked) else recurrent
    o, rec = form(q, k, v, g, beta, state["rec"])
    gate = linear(linear(x, p["g_a_w"]), p["g_b_w"]).astype(F32).reshape(B, T, nh, dk)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    o = p["o_norm"].astype(F32) * o * jax.nn.sigmoid(gate)
    out = linear(o.reshape(B, T, D).astype(x.dtype), p["o_w"])
    return out, {"conv": conv, "rec": rec}

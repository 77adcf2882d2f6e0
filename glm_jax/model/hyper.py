"""Manifold-constrained hyper-connections (glm5_next): ``hc_mult`` residual streams instead of one.

Mirrors transformers 5.25 ``Glm5NextTextHyperConnection`` / ``Glm5NextTextHyperHead``.  Before a block (attention
or MLP) the N streams [B, T, N, H] give, through one linear map of their RMS-normed concatenation, three weights:

    pre  = sigmoid(s0 * w_pre + b_pre) + eps                  [B, T, N]     collapses the streams into the block input
    post = 2 sigmoid(s1 * w_post + b_post)                    [B, T, N]     spreads the block output over the streams
    comb = sinkhorn(softmax(s2 * w_comb + b_comb) + eps)      [B, T, N, N]  mixes the streams (doubly stochastic)

    streams' = post[n] * block(sum_n pre[n] streams[n]) + sum_m comb[m, n] streams[m]

The model starts with N copies of the embedding and ends with their mean (the hyper head), before the final norm.
Params of one connection: ``{"fn": [(2+N)*N, N*H], "base": [(2+N)*N] f32, "scale": [3] f32}``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layers import F32


def hc_pre(cfg, p, streams):
    """streams [B, T, N, H] -> (post [B, T, N] f32, comb [B, T, N, N] f32, block input [B, T, H])."""
    B, T, N, H = streams.shape
    eps = cfg.hc_eps
    flat = streams.reshape(B, T, N * H).astype(F32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    mixed = jnp.einsum("bti,oi->bto", flat, p["fn"].astype(F32))
    base, scale = p["base"].astype(F32), p["scale"].astype(F32)
    pre = jax.nn.sigmoid(mixed[..., :N] * scale[0] + base[:N]) + eps
    post = 2.0 * jax.nn.sigmoid(mixed[..., N:2 * N] * scale[1] + base[N:2 * N])
    logits = mixed[..., 2 * N:].reshape(B, T, N, N) * scale[2] + base[2 * N:].reshape(N, N)
    comb = sinkhorn(jax.nn.softmax(logits, axis=-1) + eps, cfg.hc_sinkhorn_iters, eps)
    collapsed = jnp.einsum("btn,btnh->bth", pre, streams.astype(F32)).astype(streams.dtype)
    return post, comb, collapsed


def sinkhorn(comb, iters: int, eps: float):
    """Columns, then (rows, columns) ``iters - 1`` times, each divided by its sum + eps (transformers' order)."""
    def rows_cols(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    return jax.lax.fori_loop(0, iters - 1, rows_cols, comb)


def hc_post(post, comb, out, residual):
    """The block's output out [B, T, H] spread over the streams plus the mixed input streams residual [B, T, N, H]."""
    dt = residual.dtype
    return (post.astype(dt)[..., None] * out[:, :, None, :]
            + jnp.einsum("btmn,btmh->btnh", comb.astype(dt), residual))


def expand(x, n: int):
    """The embedding [B, T, H] as n equal streams [B, T, n, H]."""
    return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], n, x.shape[-1]))


def hyper_head(streams):
    """The final collapse: the streams' unweighted mean."""
    return jnp.mean(streams, axis=2)

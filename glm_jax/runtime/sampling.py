"""Sampling (greedy / temperature / top-k / nucleus top-p), one row or per-row parameters (run statistics: stats.py).

The generation loop itself is ``scheduler.Scheduler`` (continuous batching)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..model.layers import softmax

F32 = jnp.float32


def filtered_probs(logits, temperature: float, top_k: int, top_p: float):
    """The sampling distribution [..., V] after temperature, top-k and nucleus top-p (greedy: one-hot argmax)."""
    logits = logits.astype(F32)
    V = logits.shape[-1]
    if temperature <= 0.0:
        return jax.nn.one_hot(jnp.argmax(logits, -1), V, dtype=F32)
    z = logits / temperature
    if 0 < top_k < V:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    p = jax.nn.softmax(z, -1)
    if top_p < 1.0:
        order = jnp.argsort(-p, axis=-1)
        ps = jnp.take_along_axis(p, order, -1)
        cum = jnp.cumsum(ps, -1)
        # always keeps the most likely token (explicitly: a top_p below f32's smallest normal is 0 on the device)
        keep_sorted = ((cum - ps) < top_p) | (jnp.arange(V) == 0)
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), -1)
        p = jnp.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdims=True)
    return p


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(logits, key, temperature: float, top_k: int, top_p: float):
    """Sample one token per row of logits [..., V]."""
    if temperature <= 0.0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    p = filtered_probs(logits, temperature, top_k, top_p)
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)


def filtered_probs_rows(logits, temperature, top_k, top_p):
    """``filtered_probs`` with per-row parameters: logits [B, V], temperature / top_p [B] f32, top_k [B] int32.
    Rows with temperature 0 get their (unused) distribution at temperature 1.  Same arithmetic as
    ``filtered_probs`` row by row; the sorts run only when some row asks for top-k / top-p."""
    logits = logits.astype(F32)
    V = logits.shape[-1]
    z = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    use_k = (top_k > 0) & (top_k < V)

    def cut_k(z):
        zs = -jnp.sort(-z, axis=-1)
        kth = jnp.take_along_axis(zs, jnp.clip(top_k - 1, 0, V - 1)[:, None], -1)
        return jnp.where(use_k[:, None] & (z < kth), -jnp.inf, z)

    z = jax.lax.cond(jnp.any(use_k), cut_k, lambda z: z, z)
    p = softmax(z)              # row-count invariant (model.layers.row_sum): a row's draw must not depend on the width
    use_p = top_p < 1.0

    def cut_p(p):
        order = jnp.argsort(-p, axis=-1)
        ps = jnp.take_along_axis(p, order, -1)
        cum = jnp.cumsum(ps, -1)
        keep_sorted = ((cum - ps) < top_p[:, None]) | (jnp.arange(V) == 0)[None, :]     # the top token: always
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), -1) | ~use_p[:, None]
        p = jnp.where(keep, p, 0.0)
        return p / p.sum(-1, keepdims=True)

    return jax.lax.cond(jnp.any(use_p), cut_p, lambda p: p, p)


def sample_rows(logits, keys, temperature, top_k, top_p):
    """One token per row of logits [B, V] with per-row parameters and PRNG keys [B, 2]: each sampling row splits its
    key once (``key, sk = split(key)``, as the one-row loop did) and samples with ``sk``; greedy rows take the argmax
    and never use a key.  When every row is greedy nothing is split (the threefry rounds were a while loop of ~20 XLA
    ops in every decode step); a sampling row's keys advance once per step either way, so its tokens are the same.
    Returns (tokens [B] int32, keys [B, 2])."""
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)

    def sampled(keys):
        split = jax.vmap(jax.random.split)(keys)                   # [B, 2, 2]
        keys, sk = split[:, 0], split[:, 1]
        p = filtered_probs_rows(logits, temperature, top_k, top_p)
        return jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(sk, jnp.log(p)).astype(jnp.int32), keys

    tok, keys = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda k: (greedy, k), keys)
    return jnp.where(temperature > 0, tok, greedy), keys

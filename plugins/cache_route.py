"""Cache-aware routing (colibri ``CACHE_ROUTE``, PR #199; arXiv 2412.00099). Lossy, opt-in.

Both plugins RE-SELECT the K experts of every position from ``biased`` (the router's selection score; -inf outside
the selected groups is respected) and ``resident`` (set by the engine), keep K valid slots, and take the weights from
the UNBIASED scores of the chosen experts, renormalised like the router (``norm_topk_prob``: sum = rsf; else
``s * rsf``). Slots come out in rank order. Substitutions / agreement with the true top-K are measured by
:func:`glm_jax_plugins.routing.stats`. The "original top-K" (what counts as a substitute) is the incoming selection
(``ids`` / ``valid``), i.e. the router's when cache_route runs first, as :func:`glm_jax_plugins.build` does.

``max_rank(j, m, alpha, p)``, per position:

1. rank all E experts by ``biased`` (descending, ties: lower id first); window = the top max(m, K);
2. always keep the true top-j ("sacred", j clipped to K);
3. fill the remaining K-j slots with RESIDENT experts ranked inside the window, in rank order;
4. fill the rest from the true ranking (skipping experts already chosen);
5. ``alpha < 1`` multiplies the weight of substitutes (experts not in the original top-K) before renormalisation.

``p`` in (0, 1) (colibri ``ROUTE_P``; our reading of "grows the window to that cumulative mass"): the window of a
position becomes the shortest rank prefix whose cumulative unbiased score reaches p x the position's total unbiased
score over all finite-score experts, but never smaller than max(m, K). Experts with a -inf selection score are never
substitutes.

``cache_prior(lam)``: ``biased' = biased + lam * resident``; top-K of ``biased'``; weights as above.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .routing import Plugin, RoutingState, identity, membership, renormalize


def _weights_for(state: RoutingState, new_ids, alpha):
    E = state.scores.shape[-1]
    s = jnp.take_along_axis(state.scores, new_ids, axis=-1).astype(jnp.float32)
    if not (isinstance(alpha, float) and alpha == 1.0):
        orig = membership(state.ids, state.valid.astype(bool), E)                     # [T, E]
        sub = ~jnp.take_along_axis(orig, new_ids, axis=-1)
        s = jnp.where(sub, s * alpha, s)
    valid = jnp.ones(new_ids.shape, bool)
    # weights as the router would write them (s * rsf), then the router's normalisation when norm_topk_prob
    w = renormalize(s * state.routed_scaling_factor, valid, state.norm_topk_prob, state.routed_scaling_factor,
                    reference=None)
    return state.replace(ids=new_ids.astype(jnp.int32), weights=w, valid=valid)


def apply_max_rank(state: RoutingState, j: int = 2, m: int = 12, alpha=1.0, p: float | None = None) -> RoutingState:
    """Functional form of :func:`max_rank`: ``j`` / ``m`` / ``p`` static, ``alpha`` may be a traced scalar."""
    T, E = state.biased.shape
    K = state.ids.shape[-1]
    j0 = min(j, K)
    win = min(max(m, K), E)
    order = jnp.argsort(-state.biased, axis=-1, stable=True)                   # [T, E] expert ids by rank
    b_sorted = jnp.take_along_axis(state.biased, order, axis=-1)
    r = jnp.arange(E)
    finite = jnp.isfinite(b_sorted)
    if p is None:
        in_win = jnp.broadcast_to(r < win, (T, E))
    else:
        s_sorted = jnp.where(finite, jnp.take_along_axis(state.scores, order, axis=-1), 0.0)
        cs = jnp.cumsum(s_sorted, axis=-1)
        before = jnp.concatenate([jnp.zeros_like(cs[:, :1]), cs[:, :-1]], axis=-1)
        in_win = (before < p * cs[:, -1:]) | (r < win)
    sacred = r < j0
    res_sorted = state.resident.astype(bool)[order]
    cand = res_sorted & in_win & finite & ~sacred
    take_res = cand & (jnp.cumsum(cand.astype(jnp.int32), axis=-1) <= K - j0)
    chosen = sacred | take_res
    n_left = K - jnp.sum(chosen.astype(jnp.int32), axis=-1, keepdims=True)
    rest = ~chosen
    chosen = chosen | (rest & (jnp.cumsum(rest.astype(jnp.int32), axis=-1) <= n_left))
    # the K chosen ranks, in rank order
    key = jnp.where(chosen, r, E + r)
    pick = jnp.argsort(key, axis=-1)[:, :K]
    new_ids = jnp.take_along_axis(order, pick, axis=-1)
    return _weights_for(state, new_ids, alpha)


def max_rank(j: int = 2, m: int = 12, alpha: float = 1.0, p: float | None = None) -> Plugin:
    """Max-rank cache-aware routing plugin (see module docstring)."""
    j = int(j)
    m = int(m)
    alpha = float(alpha)
    if j < 0:
        raise ValueError("max_rank: j must be >= 0")
    if p is not None and not (0.0 < p < 1.0):
        p = None

    def apply(state: RoutingState) -> RoutingState:
        return apply_max_rank(state, j, m, alpha, p)

    return Plugin(apply, f"max_rank(j={j}, m={m}, alpha={alpha}, p={p})")


def apply_cache_prior(state: RoutingState, lam) -> RoutingState:
    """Functional form of :func:`cache_prior` (``lam`` may be a traced scalar)."""
    K = state.ids.shape[-1]
    score = state.biased + lam * state.resident.astype(state.biased.dtype)
    _, new_ids = jax.lax.top_k(score, K)
    return _weights_for(state, new_ids, 1.0)


def cache_prior(lam: float | None = None) -> Plugin:
    """Cache-prior routing plugin: add ``lam`` to resident experts' selection score, re-select top-K."""
    if lam is None or lam == 0.0:
        return identity
    lam = float(lam)

    def apply(state: RoutingState) -> RoutingState:
        return apply_cache_prior(state, lam)

    return Plugin(apply, f"cache_prior(lam={lam})")

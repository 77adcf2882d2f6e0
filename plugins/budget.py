"""Expert budget (colibri ``EXPERT_BUDGET``, PR #254): cap the distinct experts one layer loads. Lossy; quarantined
in colibri (issue #303: budget=8 -> hellaswag 30% vs 90% off; budget=4 -> decode noise; MTP acceptance 0%). Keep it
opt-in and measure quality next to speed.

``scope="union"`` (the seed, exactly). Over the union U of the experts routed by all REAL positions (valid slots,
``positions`` True):

1. hits = experts of U with ``resident`` True; they are always kept;
2. ``miss_budget = max(n - |hits|, 0)``;
3. the misses of U are ranked by aggregate gate weight (sum of their weights over real positions; ties: lower expert
   id first) and the top ``miss_budget`` are kept;
4. every other expert is removed from every position (padding rows included, so padding never makes the layer load
   an expert the real positions did not keep);
5. survivors renormalised as the router does (``norm_topk_prob``), else rescaled per position by old/new mass
   (``rescale_when_unnormalized=True``, the seed) or left as they are (False);
6. rescue: a real position left with no valid expert gets its single best original expert (highest incoming weight)
   back, alone, renormalised (so it carries the whole mass). ``state.rescued`` marks those positions.

Hence distinct experts per layer after the plugin <= max(n, |hits|) + (number of rescued positions): with
|hits| >= n every hit is kept and no miss; the rescue may exceed the cap (each rescue adds at most one expert), and
``stats()["rescued"]`` counts it.

``scope="position"``: each position capped to n experts on its own: its hits are kept first, then its misses by
weight (desc, ties by slot), up to max(n, its hits). A row's result depends only on that row (batch-invariant). No
rescue is needed (n >= 1 keeps at least one expert of a non-empty row).

``max_positions``: the guard (colibri ``S <= 4``: decode and MTP verify only, because capping prefill corrupted the
KV cache, #292). The budget applies only when the number of real positions <= max_positions, otherwise the state is
returned unchanged; decided inside jit with ``jnp.where``. None: always applies. Note that with the guard the result
of a row depends on how many real rows share the call.

Residency: which experts count as hits is the ENGINE's decision, made through ``state.resident``: ``cache`` (the
experts in the device/host expert cache at the time of the forward), ``pinned`` (only the pinned / hot-store set, so
the decision does not depend on LRU state), ``none`` (all False: the budget ranks every expert by weight alone and is
then a pure function of the routing, which keeps draft and verify computing the same function, cf. #294/#303).

``n`` None or <= 0 is the identity.
"""
from __future__ import annotations

import jax.numpy as jnp

from .routing import Plugin, RoutingState, identity, membership, expert_mass, renormalize

SCOPES = ("union", "position")


def _guard(state: RoutingState, max_positions):
    if max_positions is None:
        return jnp.bool_(True)
    return jnp.sum(state.positions.astype(jnp.int32)) <= max_positions


def _union(state: RoutingState, n, rescale: bool):
    E = state.scores.shape[-1]
    K = state.ids.shape[-1]
    real = state.positions.astype(bool)
    valid = state.valid.astype(bool)
    w_in = jnp.where(valid, state.weights, 0.0)
    routed = membership(state.ids, valid, E) & real[:, None]            # [T, E]
    in_union = jnp.any(routed, axis=0)                                    # [E]
    agg = jnp.sum(jnp.where(real[:, None], expert_mass(state.ids, w_in, valid, E), 0.0), axis=0)
    hits = in_union & state.resident.astype(bool)
    misses = in_union & ~hits
    miss_budget = jnp.maximum(n - jnp.sum(hits.astype(jnp.int32)), 0)
    key = jnp.where(misses, agg, -jnp.inf)
    order = jnp.argsort(-key, stable=True)                               # misses by aggregate weight, ties by id
    rank = jnp.argsort(order)
    keep_e = hits | (misses & (rank < miss_budget))                       # [E]
    new_valid = valid & keep_e[state.ids]
    # rescue: a real position that had experts and lost them all gets its best original expert back
    lost = real & jnp.any(valid, axis=-1) & ~jnp.any(new_valid, axis=-1)
    best = jnp.argmax(jnp.where(valid, state.weights, -jnp.inf), axis=-1)
    new_valid = new_valid | (lost[:, None] & (jnp.arange(K) == best[:, None]))
    new_w = renormalize(state.weights, new_valid, state.norm_topk_prob, state.routed_scaling_factor,
                        reference=w_in, rescale_when_unnormalized=rescale)
    return state.replace(valid=new_valid, weights=new_w), lost


def _position(state: RoutingState, n, rescale: bool):
    K = state.ids.shape[-1]
    valid = state.valid.astype(bool)
    hit = valid & state.resident.astype(bool)[state.ids]                  # [T, K]
    miss = valid & ~hit
    nh = jnp.sum(hit.astype(jnp.int32), axis=-1, keepdims=True)
    w = jnp.where(valid, state.weights, 0.0)
    slot = jnp.arange(K)
    # rank of slot k among its row's misses: misses j heavier than k, or as heavy with a lower slot index
    ahead = (w[:, :, None] > w[:, None, :]) | ((w[:, :, None] == w[:, None, :]) & (slot[:, None] < slot[None, :]))
    rank = jnp.sum(ahead & miss[:, :, None], axis=1)                      # [T, K]
    new_valid = hit | (miss & (rank < jnp.maximum(n - nh, 0)))
    new_w = renormalize(state.weights, new_valid, state.norm_topk_prob, state.routed_scaling_factor,
                        reference=w, rescale_when_unnormalized=rescale)
    return state.replace(valid=new_valid, weights=new_w), jnp.zeros(valid.shape[:1], bool)


def apply_budget(state: RoutingState, n, scope: str = "union", max_positions=None, *,
                 rescale_when_unnormalized: bool = True) -> RoutingState:
    """Functional form of :func:`expert_budget` with no off switch: ``n`` (>= 1) and ``max_positions`` may be
    traced scalars; ``scope`` and ``rescale_when_unnormalized`` are static."""
    if scope not in SCOPES:
        raise ValueError(f"expert_budget scope must be one of {SCOPES}, got {scope!r}")
    impl = _union if scope == "union" else _position
    out, rescued = impl(state, n, rescale_when_unnormalized)
    on = _guard(state, max_positions)
    valid = jnp.where(on, out.valid, state.valid)
    weights = jnp.where(on, out.weights, state.weights)
    rescued = rescued & on
    if state.rescued is not None:
        rescued = rescued | state.rescued.astype(bool)
    return state.replace(valid=valid, weights=weights, rescued=rescued)


def expert_budget(n: int | None = None, scope: str = "union", max_positions: int | None = None, *,
                  rescale_when_unnormalized: bool = True) -> Plugin:
    """Expert budget plugin (see module docstring)."""
    if scope not in SCOPES:
        raise ValueError(f"expert_budget scope must be one of {SCOPES}, got {scope!r}")
    if n is None or n <= 0:
        return identity
    n = int(n)

    def apply(state: RoutingState) -> RoutingState:
        return apply_budget(state, n, scope, max_positions, rescale_when_unnormalized=rescale_when_unnormalized)

    return Plugin(apply, f"expert_budget(n={n}, scope={scope}, max_positions={max_positions})")

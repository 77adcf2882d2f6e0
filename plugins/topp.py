"""Expert top-p (colibri ``TOPP``): per-position trimming of the routed experts. Lossy.

Per position: sort the valid selected experts by weight (descending, ties by slot), keep the shortest prefix whose
cumulative weight is >= p * total (always at least one expert), mark the rest invalid and renormalise the survivors as
the router does (:func:`glm_jax_plugins.routing.renormalize`; without ``norm_topk_prob`` the survivors are rescaled to
the original mass unless ``rescale_when_unnormalized=False``).

Per position only: it cannot shrink the cross-position union of a batch / MTP verify (that is the expert budget's
job). ``p`` None, >= 1 or <= 0 is the identity (colibri: ``0 < TOPP < 1`` enables it).
"""
from __future__ import annotations

import jax.numpy as jnp

from .routing import Plugin, RoutingState, identity, renormalize


def topp_mask(weights, valid, p: float):
    """``[T, K] bool``: the slots topp keeps (subset of ``valid``)."""
    K = weights.shape[-1]
    w = jnp.where(valid, weights, 0.0).astype(jnp.float32)
    key = jnp.where(valid, w, -jnp.inf)
    order = jnp.argsort(-key, axis=-1, stable=True)            # valid by weight desc, ties by slot, invalid last
    ws = jnp.take_along_axis(w, order, axis=-1)
    vs = jnp.take_along_axis(valid, order, axis=-1)
    csum = jnp.cumsum(ws, axis=-1)
    total = csum[..., -1:]
    before = jnp.concatenate([jnp.zeros_like(csum[..., :1]), csum[..., :-1]], axis=-1)
    first = jnp.arange(K) == 0
    keep_sorted = vs & ((before < p * total) | first)
    inv = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep_sorted, inv, axis=-1)


def apply_topp(state: RoutingState, p, *, rescale_when_unnormalized: bool = True) -> RoutingState:
    """Functional form of :func:`topp` with no off switch (``p`` may be a traced scalar)."""
    keep = topp_mask(state.weights, state.valid, p)
    w = renormalize(state.weights, keep, state.norm_topk_prob, state.routed_scaling_factor,
                    reference=jnp.where(state.valid, state.weights, 0.0),
                    rescale_when_unnormalized=rescale_when_unnormalized)
    return state.replace(valid=keep, weights=w)


def topp(p: float | None = None, *, rescale_when_unnormalized: bool = True) -> Plugin:
    """Expert top-p plugin (see module docstring)."""
    if p is None or p >= 1.0 or p <= 0.0:
        return identity
    p = float(p)

    def apply(state: RoutingState) -> RoutingState:
        return apply_topp(state, p, rescale_when_unnormalized=rescale_when_unnormalized)

    return Plugin(apply, f"topp(p={p})")

"""Gate-weight floor (an example plugin, not built into the engine's flags): per position, drop the routed experts
whose share of the position's gate weight is below ``min_share``; the heaviest expert always stays. Survivors are
renormalised as the router does. Lossy; routing-only (never reads ``resident``) and row-independent, so it keeps
MTP's contract.

    glm-jax --plugin=glm_jax_plugins.weight_floor:weight_floor --plugin_args=min_share=0.15

Unlike TOPP (keep the heaviest experts until they hold p of the mass) the floor looks at each expert on its own: a
position whose weight is spread evenly keeps all its experts, one dominated by a single expert keeps only that one.
``min_share`` None or <= 0 is the identity.
"""
from __future__ import annotations

import jax.numpy as jnp

from .routing import Plugin, RoutingState, identity, renormalize


def apply_weight_floor(state: RoutingState, min_share) -> RoutingState:
    """Functional form (``min_share`` may be a traced scalar)."""
    w = jnp.where(state.valid, state.weights, 0.0)
    share = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-30)
    top = jnp.argmax(jnp.where(state.valid, w, -jnp.inf), axis=-1)
    heaviest = jnp.arange(w.shape[-1]) == top[:, None]
    keep = state.valid & ((share >= min_share) | heaviest)
    new_w = renormalize(state.weights, keep, state.norm_topk_prob, state.routed_scaling_factor, reference=w)
    return state.replace(valid=keep, weights=new_w)


def weight_floor(min_share: float | None = None) -> Plugin:
    """The gate-weight floor plugin (module docstring)."""
    if min_share is None or min_share <= 0.0:
        return identity
    min_share = float(min_share)
    return Plugin(lambda state: apply_weight_floor(state, min_share), f"weight_floor(min_share={min_share})")

"""Per-layer expert budget schedule (an example plugin, not built into the engine's flags): the expert budget
(:mod:`glm_jax_plugins.budget`) with its own N for each layer, read from ``state.layer``. Lossy.

    glm-jax --plugin=glm_jax_plugins.layer_budget:layer_budget --plugin_args=budgets=0,0,2,2

``budgets[l]`` is the budget of the layer with index ``l`` (the decoder layer number; the MTP layer's index is
``num_hidden_layers``); 0 leaves that layer untouched, layers past the end of the list get ``default``. The layer
index is a traced scalar inside the engine, so the budget is picked with a gather and applied with ``jnp.where``:
one compiled program serves every layer.

Scope ``position`` (default) caps each position on its own and applies to every forward (prefill included: a
position's result does not depend on the forward it is in). ``use_resident=False`` (default) ranks experts by weight
alone, so the plugin is routing-only and row-independent and keeps MTP's contract; ``True`` keeps the engine's
resident experts first, like the built-in budget with ``--budget_residency=cache``. No budget anywhere (all 0, or
an empty list with default 0) is the identity.
"""
from __future__ import annotations

import jax.numpy as jnp

from .budget import SCOPES, apply_budget
from .routing import Plugin, RoutingState, identity


def _as_list(budgets) -> list:
    if budgets is None:
        return []
    if isinstance(budgets, str):
        return [int(b) for b in budgets.replace(";", ",").split(",") if b.strip()]
    if isinstance(budgets, (int, float)):
        return [int(budgets)]
    return [int(b) for b in budgets]


def apply_layer_budget(state: RoutingState, table, scope: str = "position", use_resident: bool = False
                       ) -> RoutingState:
    """Functional form: ``table`` int32 [L + 1], the budget of layer l at ``table[min(l, L)]`` (0 = untouched)."""
    if state.layer is None:
        raise ValueError("layer_budget needs state.layer (the engine sets it)")
    table = jnp.asarray(table, jnp.int32)
    n = table[jnp.clip(jnp.asarray(state.layer, jnp.int32), 0, table.shape[0] - 1)]
    src = state if use_resident else state.replace(resident=jnp.zeros_like(state.resident))
    out = apply_budget(src, jnp.maximum(n, 1), scope, None)
    on = n > 0
    rescued = jnp.where(on, out.rescued, False if state.rescued is None else state.rescued)
    return state.replace(valid=jnp.where(on, out.valid, state.valid), weights=jnp.where(on, out.weights,
                                                                                          state.weights),
                         rescued=rescued)


def layer_budget(budgets=None, default: int = 0, scope: str = "position", use_resident: bool = False) -> Plugin:
    """The per-layer budget plugin (module docstring). ``budgets``: a sequence, or a string "0,0,2,2"."""
    if scope not in SCOPES:
        raise ValueError(f"layer_budget: scope must be one of {SCOPES}, got {scope!r}")
    table = _as_list(budgets) + [int(default)]
    if any(b < 0 for b in table):
        raise ValueError(f"layer_budget: budgets must be >= 0, got {table}")
    if not any(table):
        return identity
    tab = tuple(table)

    def apply(state: RoutingState) -> RoutingState:
        return apply_layer_budget(state, tab, scope, use_resident)

    return Plugin(apply, f"layer_budget(budgets={','.join(map(str, tab[:-1]))}, default={tab[-1]}, scope={scope}"
                  + (", use_resident" if use_resident else "") + ")")

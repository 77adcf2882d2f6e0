"""glm_jax_plugins: routing plugins (installed from ``plugins/``; never imports ``glm_jax``).

A plugin is a jittable ``RoutingState -> RoutingState`` (see :mod:`glm_jax_plugins.routing`), applied by the engine
between the router and the MoE seam (``moe_routed``), once per MoE layer.

Composition order used by :func:`build` (the documented order; ``compose`` applies left to right)::

    cache_route  ->  topp  ->  [user plugins, in the order given]  ->  expert_budget

* cache_route first: it RE-SELECTS the K experts from the router's scores (and re-derives the weights from the
  unbiased scores), so anything run before it would be thrown away; its substitutes are measured against the
  router's true top-K, which it can only see if it runs first.
* topp next: a per-position trim of whatever selection is final, renormalised.
* user plugins (``Engine.load(plugins=[...])``, ``--plugin``) after the built-in re-selection and trim, in the given
  order: they see the final per-position picks and may trim them further.  To put one elsewhere, leave the built-in
  flags off and pass the built-in plugins (``topp(p)``, ``expert_budget(n)``, ...) in the list yourself.
* expert_budget last: it is a cross-position cap on the union of the experts the layer will actually load, so it
  must see the final per-position selections (after re-selection and trimming); anything run after it could
  re-grow the union past the cap.
"""
from __future__ import annotations

from .routing import (Plugin, RoutingState, expert_mass, identity, membership, renormalize, stats)
from .topp import apply_topp, topp, topp_mask
from .budget import apply_budget, expert_budget
from .cache_route import apply_cache_prior, apply_max_rank, cache_prior, max_rank
from .weight_floor import apply_weight_floor, weight_floor
from .layer_budget import apply_layer_budget, layer_budget
from . import contract

CACHE_ROUTES = (None, "max_rank", "prior")

__all__ = [
    "RoutingState", "Plugin", "identity", "renormalize", "stats", "membership", "expert_mass",
    "topp", "topp_mask", "expert_budget", "max_rank", "cache_prior", "compose", "build", "CACHE_ROUTES",
    "apply_topp", "apply_budget", "apply_max_rank", "apply_cache_prior",
    "weight_floor", "apply_weight_floor", "layer_budget", "apply_layer_budget", "contract",
]


def compose(*plugins) -> Plugin:
    """Apply ``plugins`` left to right (None and identity entries are skipped)."""
    ps = [p for p in plugins if p is not None and not getattr(p, "is_identity", False)]
    if not ps:
        return identity
    if len(ps) == 1:
        return ps[0] if isinstance(ps[0], Plugin) else Plugin(ps[0], getattr(ps[0], "__name__", "plugin"))

    def apply(state):
        for p in ps:
            state = p(state)
        return state

    return Plugin(apply, " -> ".join(getattr(p, "name", getattr(p, "__name__", "plugin")) for p in ps))


def build(expert_topp: float | None = None, expert_budget: int | None = None, budget_scope: str = "union",
          budget_max_positions: int | None = 4, cache_route: str | None = None, route_j: int = 2,
          route_m: int = 12, route_alpha: float = 1.0, route_lambda: float = 0.1,
          route_p: float | None = None, plugins=()) -> Plugin:
    """The composed routing plugin, in the documented order cache_route -> topp -> plugins -> expert_budget (module
    docstring).  ``plugins``: further ``RoutingState -> RoutingState`` callables, applied in the given order.

    expert_topp: topp(p) (None / >= 1 / <= 0: off). expert_budget: N (None / <= 0: off), budget_scope "union" |
    "position", budget_max_positions: the guard (default 4 = colibri's decode/MTP-verify-only ``S <= 4``; None: always).
    cache_route: None | "max_rank" (max_rank(route_j, route_m, route_alpha, route_p)) | "prior"
    (cache_prior(route_lambda)). Everything off: the identity plugin.
    """
    if cache_route not in CACHE_ROUTES:
        raise ValueError(f"cache_route must be one of {CACHE_ROUTES}, got {cache_route!r}")
    if cache_route == "max_rank":
        cr = max_rank(route_j, route_m, route_alpha, route_p)
    elif cache_route == "prior":
        cr = cache_prior(route_lambda)
    else:
        cr = identity
    from .budget import expert_budget as _budget
    return compose(cr, topp(expert_topp), *plugins, _budget(expert_budget, budget_scope, budget_max_positions))

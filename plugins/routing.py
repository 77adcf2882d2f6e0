"""RoutingState: the pytree routing plugins read and write, plus shared helpers.

A routing plugin is a function ``RoutingState -> RoutingState``: pure, jittable (static shapes, masks instead of
data-dependent shapes, no Python branching on traced values), no host state. The engine's router builds the state
(fp32, DeepSeek "noaux_tc", see glm-architecture.md 1.1)::

    scores = sigmoid(x @ W_gate.T)                          # [T, E]  unbiased
    biased = scores + e_score_correction_bias                # [T, E]  selection score (-inf outside the kept groups)
    ids    = top_k(biased, K)                                # [T, K]
    w      = scores[ids]; w = w / (sum(w) + 1e-20) if norm_topk_prob; weights = w * routed_scaling_factor

Conventions shared by all plugins in this package:

* slots whose ``valid`` is False carry weight 0 on output and are never looked up by the MoE seam;
* plugins keep the slot layout (``ids``) unless they re-select (cache_route), and never change ``scores`` /
  ``biased`` / ``resident`` / ``positions`` (they describe the router's view and the cache, not the decision);
* ``rescued`` is an optional ``[T] bool`` (None until the expert budget ran): positions where the budget's rescue
  re-enabled one expert. It only feeds :func:`stats`.
* ``layer`` (int32 scalar: the decoder layer's index, ``num_hidden_layers`` for the MTP layer) and ``seq_pos``
  (``[T] int32``: each row's position in its sequence) let a plugin act per layer / per position. Inside the engine
  both are traced arrays (one compiled program serves every layer of a kind), so a plugin branches on them with
  ``jnp.where`` / ``lax.select``, never with a Python ``if``. ``num_layers`` (static) is the model's
  ``num_hidden_layers``. None / 0 when a state is built outside the engine.
* ``violation`` (int32 scalar or None) belongs to the engine's contract checks (:mod:`glm_jax_plugins.contract`);
  a plugin passes it through, which ``state.replace(...)`` does.

This module never imports ``glm_jax`` (plugins are leaf modules).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

_DATA_FIELDS = ("ids", "weights", "valid", "scores", "biased", "resident", "positions", "rescued", "layer",
                "seq_pos", "violation")
_META_FIELDS = ("norm_topk_prob", "routed_scaling_factor", "num_layers")

# Epsilon of the router's normalisation (HF: ``w / (w.sum(-1, keepdim=True) + 1e-20)``).
ROUTER_EPS = 1e-20
# Epsilon used by stats() for the KL of distributions with zero mass on some experts.
KL_EPS = 1e-9


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_DATA_FIELDS), meta_fields=list(_META_FIELDS))
@dataclasses.dataclass(frozen=True)
class RoutingState:
    """Routing decision of one MoE layer for T positions (see module docstring).

    ids [T,K] int32, weights [T,K] f32, valid [T,K] bool, scores [T,E] f32 (unbiased sigmoid),
    biased [T,E] f32 (sigmoid + e_score_correction_bias; -inf outside selected groups), resident [E] bool (experts that
    count as cache hits), positions [T] bool (real positions vs padding), rescued [T] bool | None (set by the budget),
    layer int32 [] | None (layer index), seq_pos [T] int32 | None (position of each row in its sequence), violation
    int32 [] | None (engine-owned, see the module docstring).
    Static: norm_topk_prob, routed_scaling_factor, num_layers.
    """

    ids: Any
    weights: Any
    valid: Any
    scores: Any
    biased: Any
    resident: Any
    positions: Any
    rescued: Any = None
    layer: Any = None
    seq_pos: Any = None
    violation: Any = None
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_layers: int = 0

    def replace(self, **kw) -> "RoutingState":
        return dataclasses.replace(self, **kw)

    @property
    def num_experts(self) -> int:
        return self.scores.shape[-1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[-1]


def membership(ids, valid, num_experts: int):
    """``[T, E] bool``: expert e is a valid pick of position t."""
    e = jnp.arange(num_experts, dtype=ids.dtype)
    return jnp.any((ids[..., :, None] == e) & valid[..., :, None], axis=-2)


def expert_mass(ids, weights, valid, num_experts: int):
    """``[T, E] f32``: weight each position puts on each expert (valid slots only)."""
    e = jnp.arange(num_experts, dtype=ids.dtype)
    hit = (ids[..., :, None] == e) & valid[..., :, None]
    return jnp.sum(jnp.where(hit, weights[..., :, None], 0.0), axis=-2)


def renormalize(state_or_weights, valid=None, norm_topk_prob=None, rsf=None, reference=None, *,
                rescale_when_unnormalized: bool = True):
    """Renormalise the surviving (valid) weights the way the router does.

    * ``norm_topk_prob``: ``w = w / (sum(w over valid) + 1e-20) * rsf`` per position. The input weights may be the
      router's weights or raw unbiased scores (any per-position positive scale gives the same result up to fp32
      rounding); ratios between the surviving weights are preserved, so a down-weighting applied earlier (cache_route
      ``alpha``) survives a later renormalisation.
    * not ``norm_topk_prob``: the router's weights are ``s * rsf`` with no normalisation, and are kept unchanged,
      except that, as in the seed (colibri PR #254, "else rescale by old/new mass"), with
      ``rescale_when_unnormalized=True`` (default) and a ``reference`` the survivors are scaled per position by
      ``old_mass / new_mass`` so that their sum equals the reference's total. ``reference``: a RoutingState (its
      valid weights), a ``[T, K]`` array of weights (summed over K; invalid slots must be 0) or a ``[T]`` array of
      masses. Without a reference, or with the flag False, the weights are left as they are. A position with no
      surviving mass stays at 0.

    Invalid slots always come out as 0. Given a RoutingState, ``valid`` / ``norm_topk_prob`` / ``rsf`` default to the
    state's and a RoutingState (with the new weights) is returned; given an array, an array is returned.
    """
    is_state = isinstance(state_or_weights, RoutingState)
    if is_state:
        st = state_or_weights
        weights = st.weights
        valid = st.valid if valid is None else valid
        norm_topk_prob = st.norm_topk_prob if norm_topk_prob is None else norm_topk_prob
        rsf = st.routed_scaling_factor if rsf is None else rsf
    else:
        weights = state_or_weights
        if valid is None or norm_topk_prob is None or rsf is None:
            raise ValueError("renormalize(weights, ...) needs valid, norm_topk_prob and rsf")
    w = jnp.where(valid, weights, 0.0).astype(jnp.float32)
    if norm_topk_prob:
        out = w / (jnp.sum(w, axis=-1, keepdims=True) + ROUTER_EPS) * rsf
    elif rescale_when_unnormalized and reference is not None:
        if isinstance(reference, RoutingState):
            old = jnp.sum(jnp.where(reference.valid, reference.weights, 0.0), axis=-1)
        else:
            reference = jnp.asarray(reference, jnp.float32)
            old = jnp.sum(reference, axis=-1) if reference.ndim == w.ndim else reference
        new = jnp.sum(w, axis=-1)
        factor = jnp.where(new > 0, old / jnp.where(new > 0, new, 1.0), 0.0)
        out = w * factor[..., None]
    else:
        out = w
    out = jnp.where(valid, out, 0.0).astype(jnp.float32)
    if is_state:
        return st.replace(weights=out, valid=valid)
    return out


def stats(before: RoutingState, after: RoutingState) -> dict:
    """Telemetry of a plugin (or a composition), all jnp scalars, over REAL positions only.

    * ``dropped``: valid slots of ``before`` that are invalid in ``after`` (slot-wise; re-selecting plugins keep K
      valid slots, so they drop nothing).
    * ``substitutions``: valid (t, expert) picks of ``after`` that ``before`` did not have (set-wise).
    * ``route_agreement``: fraction of ``before``'s (t, expert) picks still present in ``after`` (1.0 if none).
    * ``kl``: mean over real positions of KL(p || q), p / q the per-expert weight distributions of before / after
      (weights of the valid slots normalised to sum 1), with ``KL_EPS`` added to both for zero mass; positions where
      ``before`` has no mass are skipped.
    * ``distinct_before`` / ``distinct_after``: distinct experts picked by real positions (what a layer must load).
    * ``rescued``: real positions where the expert budget's rescue fired (0 if the budget did not run).
    * ``real_positions``: number of real positions.
    """
    E = before.scores.shape[-1]
    real = before.positions.astype(bool)
    real_f = real.astype(jnp.float32)
    mb = membership(before.ids, before.valid, E) & real[:, None]
    ma = membership(after.ids, after.valid, E) & real[:, None]
    dropped = jnp.sum(before.valid & ~after.valid & real[:, None])
    subs = jnp.sum(ma & ~mb)
    n_before = jnp.sum(mb)
    agree = jnp.where(n_before > 0, jnp.sum(mb & ma) / jnp.maximum(n_before, 1), 1.0)
    pb = expert_mass(before.ids, jnp.maximum(before.weights, 0.0), before.valid, E)
    pa = expert_mass(after.ids, jnp.maximum(after.weights, 0.0), after.valid, E)
    sb = jnp.sum(pb, axis=-1, keepdims=True)
    sa = jnp.sum(pa, axis=-1, keepdims=True)
    p = pb / jnp.where(sb > 0, sb, 1.0)
    q = pa / jnp.where(sa > 0, sa, 1.0)
    kl_t = jnp.sum(jnp.where(p > 0, p * (jnp.log(p + KL_EPS) - jnp.log(q + KL_EPS)), 0.0), axis=-1)
    has = real & (sb[:, 0] > 0)
    kl = jnp.sum(jnp.where(has, kl_t, 0.0)) / jnp.maximum(jnp.sum(has), 1)
    rescued = (jnp.zeros((), jnp.int32) if after.rescued is None
               else jnp.sum(after.rescued.astype(bool) & real).astype(jnp.int32))
    return {
        "dropped": dropped.astype(jnp.int32),
        "substitutions": subs.astype(jnp.int32),
        "route_agreement": agree.astype(jnp.float32),
        "kl": kl.astype(jnp.float32),
        "distinct_before": jnp.sum(jnp.any(mb, axis=0)).astype(jnp.int32),
        "distinct_after": jnp.sum(jnp.any(ma, axis=0)).astype(jnp.int32),
        "rescued": rescued,
        "real_positions": jnp.sum(real_f).astype(jnp.int32),
    }


class Plugin:
    """A named ``RoutingState -> RoutingState`` callable (the name is for logs / telemetry)."""

    __slots__ = ("fn", "name", "is_identity", "__weakref__")

    def __init__(self, fn, name: str, is_identity: bool = False):
        self.fn = fn
        self.name = name
        self.is_identity = is_identity

    def __call__(self, state: RoutingState) -> RoutingState:
        return self.fn(state)

    def __repr__(self) -> str:
        return f"<routing plugin {self.name}>"


identity = Plugin(lambda state: state, "identity", is_identity=True)

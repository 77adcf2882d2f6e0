"""The GLM router ("noaux_tc": sigmoid scores + selection bias, optional group-limited top-k) -> RoutingState, the
arrays every routing plugin (``glm_jax_plugins``) reads and rewrites before the MoE seam (``moe.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm_jax_plugins.routing import RoutingState

from .config import ModelConfig
from ..kernels.formats import QWeight, qdot
from .layers import F32, row_sum


def route(cfg: ModelConfig, mp, hn, positions_valid, resident, layer=None, seq_pos=None) -> RoutingState:
    """The GLM "noaux_tc" router in f32 on hn [T, H] (post-attention-normed).  Returns the routing state; ``layer``
    (the layer index, int or int32 scalar) and ``seq_pos`` ([T] int32, each row's position in its sequence) are
    handed to the plugins (None: unknown)."""
    T = hn.shape[0]
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    h32 = hn.astype(F32)
    rw = mp["router_w"]
    if isinstance(rw, QWeight):     # the native kernels (decode rows): one f32 product, row-invariant by construction
        logits = qdot(h32, rw)
    else:
        if T == 1:  # XLA:CPU runs a one-row dot as a matrix-vector product, whose sums differ in the last bits from
            h32 = jnp.pad(h32, ((0, 1), (0, 0)))    # the GEMM of 2+ rows: a row's routing must not depend on the width
        logits = jnp.einsum("th,eh->te", h32, rw.astype(F32))[:T]
    scores = jax.nn.sigmoid(logits)
    biased = scores + mp["router_bias"].astype(F32)[None, :]
    if cfg.n_group > 1:
        G = cfg.n_group
        grouped = biased.reshape(T, G, E // G)
        gscore = jax.lax.top_k(grouped, 2)[0].sum(-1)                      # [T, G]
        _, gidx = jax.lax.top_k(gscore, cfg.topk_group)
        gmask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], gidx].set(True)
        biased = jnp.where(jnp.repeat(gmask, E // G, axis=1), biased, -jnp.inf)
    _, ids = jax.lax.top_k(biased, K)
    ids = ids.astype(jnp.int32)
    w = jnp.take_along_axis(scores, ids, axis=1)
    if cfg.norm_topk_prob:
        w = w / (row_sum(w) + 1e-20)
    w = w * cfg.routed_scaling_factor
    valid = jnp.broadcast_to(positions_valid[:, None], (T, K))
    return RoutingState(ids=ids, weights=w, valid=valid, scores=scores, biased=biased,
                        resident=resident.astype(bool), positions=positions_valid.astype(bool),
                        layer=None if layer is None else jnp.asarray(layer, jnp.int32),
                        seq_pos=None if seq_pos is None else jnp.asarray(seq_pos, jnp.int32).reshape(T),
                        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=float(cfg.routed_scaling_factor),
                        num_layers=cfg.num_hidden_layers)

def identity_plugin(state: RoutingState) -> RoutingState:
    return state

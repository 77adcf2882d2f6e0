"""The glm5_next (GLM-5.3) text forward: KDA and k-pooled DSA layers between hyper-connections, the clamped SwiGLU,
the MoE seam as the other families call it.

Mirrors transformers 5.25 ``Glm5NextTextDecoderLayer`` / ``Glm5NextTextModel``.  One layer on N streams:

    post, comb, x = hc_pre(attn_hc, streams);  a = Attn(RMSNorm_in(x))            (KDA, or pooled DSA MLA)
    streams = hc_post(post, comb, a, streams)
    post, comb, x = hc_pre(ffn_hc, streams);   m = MLP(RMSNorm_post(x))           (dense, or routed + shared)
    streams = hc_post(post, comb, m, streams)

and logits = lm_head(RMSNorm(mean over the streams)).  Params of one layer: ``{"attn_hc", "ffn_hc": hyper.py's,
"input_norm", "post_norm": [H], "kda": kda.py's | "attn": dsa_pool.py's, "mlp": {gate_w, up_w, down_w} |
"moe": {router_w, router_bias, shared} + "experts" (an ExpertBank)}``.  Cache of one layer: kda.py's state on
linear-attention layers, dsa_pool.py's K/V on indexed ones.

The clamp (``swiglu_limit``: gate <= limit, |up| <= limit) is applied in the dense MLP and the shared expert here,
and in the routed experts by the seam (``moe_routed(..., limit=)``, every backend).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .dsa_pool import init_pooled_cache, pooled_attention
from .hyper import expand, hc_post, hc_pre, hyper_head
from .dsa_pool import kv_bytes_per_token as pooled_kv_bytes
from .kda import init_kda_state, kda_attention, state_bytes
from .layers import embed, head, linear, positions_of, rms_norm
from .moe import moe_routed
from .router import identity_plugin, route


def is_linear(cfg: ModelConfig, layer: int) -> bool:
    return cfg.layer_types[layer] == "linear_attention"


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> list:
    """One entry per main layer: a KDA state (fixed size) or the indexed layer's K/V over max_len positions."""
    return [init_kda_state(cfg, batch) if is_linear(cfg, i)
            else init_pooled_cache(cfg, cfg.indexer_types[i] == "full", batch, max_len, dtype)
            for i in range(cfg.num_hidden_layers)]


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Cache bytes per position: the indexed layers' latent (and indexer keys / pooling gates on full layers)."""
    return sum(pooled_kv_bytes(cfg, dtype_bytes, cfg.indexer_types[i] == "full")
               for i in range(cfg.num_hidden_layers) if not is_linear(cfg, i))


def state_bytes_per_row(cfg: ModelConfig) -> int:
    """Cache bytes per row that do not grow with its positions: every KDA layer's conv and delta-rule state."""
    return sum(state_bytes(cfg) for i in range(cfg.num_hidden_layers) if is_linear(cfg, i))


def fresh_state(state: dict, start):
    """A KDA state where a row's forward starts at position 0 (a new sequence in that row): zeros, as transformers
    starts every sequence; elsewhere the row's own."""
    new = start == 0
    return {k: jnp.where(new.reshape((-1,) + (1,) * (v.ndim - 1)), jnp.zeros_like(v), v) for k, v in state.items()}


def clamped_mlp(p, x, limit: Optional[float]):
    """down(silu(min(gate, limit)) * clip(up, -limit, limit)) (no clamp where limit is None)."""
    gate, up = linear(x, p["gate_w"]), linear(x, p["up_w"])
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return linear(jax.nn.silu(gate) * up, p["down_w"])


def ffn(cfg: ModelConfig, lp, hn, valid_bt, resident, layer: int, start, plugin: Callable = identity_plugin,
        bank=None, slot_of=None):
    """The feed-forward block on hn [B, T, H] (post-normed).  Returns (out [B, T, H], routing (before, after) or
    None)."""
    if "moe" not in lp:
        return clamped_mlp(lp["mlp"], hn, cfg.swiglu_limit), None
    B, T, H = hn.shape
    flat = hn.reshape(B * T, H)
    before = route(cfg, lp["moe"], flat, valid_bt.reshape(B * T), resident, layer, positions_of(start, T))
    after = plugin(before)
    if bank is None:
        bank, slot_of = lp["experts"], lp.get("slot_of")
    routed = moe_routed(flat, after.ids, after.weights, after.valid, bank, slot_of,
                        limit=cfg.swiglu_limit).reshape(B, T, H)
    return routed + clamped_mlp(lp["moe"]["shared"], hn, cfg.swiglu_limit), (before, after)


def layer_forward(cfg: ModelConfig, lp, streams, cache, start, layer: int, prev_sel, valid_bt, resident,
                  plugin: Callable = identity_plugin, use_chunked: Optional[bool] = None):
    """One decoder layer on streams [B, T, N, H].  Returns (streams, cache, sel, routing)."""
    eps = cfg.rms_norm_eps
    post, comb, x = hc_pre(cfg, lp["attn_hc"], streams)
    xn = rms_norm(x, lp["input_norm"], eps)
    if is_linear(cfg, layer):
        a, cache = kda_attention(cfg, lp["kda"], xn, fresh_state(cache, start), valid_bt, use_chunked)
        sel = prev_sel
    else:
        a, cache, sel = pooled_attention(cfg, lp["attn"], xn, cache, start, cfg.indexer_types[layer] == "full",
                                         prev_sel)
    streams = hc_post(post, comb, a, streams)
    post, comb, x = hc_pre(cfg, lp["ffn_hc"], streams)
    m, routing = ffn(cfg, lp, rms_norm(x, lp["post_norm"], eps), valid_bt, resident, layer, start, plugin)
    return hc_post(post, comb, m, streams), cache, sel, routing


def step(cfg: ModelConfig, params, cache, tokens, start, lengths=None, resident=None,
         plugin: Callable = identity_plugin, logit_rows=None, use_chunked: Optional[bool] = None):
    """Run tokens [B, T] at positions start[b].. through every layer with resident experts; the KDA states continue
    from where ``cache`` left them (a row's tokens must follow its state's).  Returns (logits [B, T, V] f32,
    hidden [B, T, H] post-final-norm, cache, routing)."""
    B, T = tokens.shape
    if lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    valid_bt = jnp.arange(T)[None, :] < lengths[:, None]
    streams = expand(embed(params, tokens), cfg.hc_mult)
    new_cache, routing, sel, mi = [], [], None, 0
    for i, lp in enumerate(params["layers"]):
        res = None
        if "moe" in lp:
            res = resident[mi] if resident is not None else jnp.zeros((cfg.n_routed_experts,), bool)
            mi += 1
        streams, c, sel, r = layer_forward(cfg, lp, streams, cache[i], start, i, sel, valid_bt, res, plugin,
                                           use_chunked)
        new_cache.append(c)
        if r is not None:
            routing.append(r)
    hidden = rms_norm(hyper_head(streams), params["norm"], cfg.rms_norm_eps)
    return head(params, hidden, valid_bt if logit_rows is None else logit_rows), hidden, new_cache, routing

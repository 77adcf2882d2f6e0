"""The GLM MoE forward pass: one decoder layer and the whole model (glm4_moe; glm_moe_dsa's attention in mla.py).

Plain functions over the params pytree documented in WORKSPACE.md.  Shapes:
B batch, T query tokens, S cache slots (= positions), H hidden, nh/nkv heads, hd head_dim, E experts, K top-k.
Read it in data-path order: ``layers`` (norm, linear, rope, mlp, embed, head) -> ``attention`` (GQA, or ``mla``)
-> ``router`` (-> RoutingState -> plugins) -> ``moe`` (THE MOE SEAM and its backends) -> this module.

The layer is split into the pieces a streaming engine needs between host round trips:
``attn_block`` (attention + residual), ``route`` (post-norm + router -> RoutingState), the routing plugins
(``glm_jax_plugins``), ``moe_routed`` (the seam: routed experts for a routing plan and an ExpertBank) and
``moe_finish`` (shared expert + residual).  ``step`` chains them for resident experts inside one jit.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp

from ..kernels.formats import ExpertBank, qtake
from .attention import attn_block
from .config import ModelConfig
from .layers import embed, head, head_logits, linear, mlp, positions_of, rms_norm
from .moe import moe_finish, moe_routed
from .router import identity_plugin, route


def _is_split(params) -> bool:
    return hasattr(params, "merge") and hasattr(params, "graphdef")

def as_params(params):
    """``step`` / ``mtp_forward`` take the params pytree, or the NNX model split into one jit argument
    (``nnx_model.Split``): merged here, inside the trace (nnx.split -> jax.jit -> nnx.merge)."""
    return params.params() if _is_split(params) else params

def layer_forward(cfg: ModelConfig, lp, x, cache, start, layer: int, prev_sel, valid_bt, resident,
                  plugin: Callable = identity_plugin, bank: Optional[ExpertBank] = None, slot_of=None,
                  moe_rows: Optional[int] = None):
    """One decoder layer on x [B, T, H] with resident experts (lp["experts"] or ``bank``).

    moe_rows (static, B == 1): only rows [:moe_rows] can be real, so the routed experts run on those rows alone
    (a decode padded to the verify width pays for one row of experts, not T; speculative.py).
    Returns (y, cache, sel, routing) where routing is (before, after) RoutingState or None for dense layers."""
    B, T, H = x.shape
    h, cache, sel = attn_block(cfg, lp, x, cache, start, layer, prev_sel, valid_bt)
    hn = rms_norm(h, lp["post_norm"], cfg.rms_norm_eps)
    if "moe" not in lp:
        return h + mlp(lp["mlp"], hn, valid_bt), cache, sel, None
    flat = hn.reshape(B * T, H)
    before = route(cfg, lp["moe"], flat, valid_bt.reshape(B * T), resident, layer, positions_of(start, T))
    after = plugin(before)
    if bank is None:        # resident experts: the layer's own bank (slot_of: where an expert store put them)
        bank, slot_of = lp["experts"], lp.get("slot_of")
    if (bank.kernel != "native" and moe_rows is not None and B == 1 and moe_rows < T and
            T * after.ids.shape[1] <= bank.local_slots):
        # only where the full-width forward takes the gather path too: its per-(t, k) products are row-count
        # invariant (the dense all-slots path is not, so it keeps the full width)
        R = moe_rows
        part = moe_routed(flat[:R], after.ids[:R], after.weights[:R], after.valid[:R], bank, slot_of, gather=True)
        routed = jnp.zeros_like(flat).at[:R].set(part)
    else:
        routed = moe_routed(flat, after.ids, after.weights, after.valid, bank, slot_of)
    y = moe_finish(lp["moe"], h, hn, routed.reshape(B, T, H), valid_bt)
    return y, cache, sel, (before, after)

def step(cfg: ModelConfig, params, cache, tokens, start, lengths=None, resident=None,
         plugin: Callable = identity_plugin, moe_rows: Optional[int] = None, logit_rows=None):
    """Run tokens [B, T] at positions start[b].. through every layer with resident experts (``params``: the params
    pytree or a split NNX model, ``as_params``).

    lengths [B]: number of real (non-padding) tokens per row (default T).  resident [n_moe_layers, E] bool: what the
    plugins see as resident.  ``logit_rows`` [B, T] bool: positions whose logits are wanted (default: the real
    ones; a prefill needs only its last; with the native kernels the others come out 0).  Returns (logits [B,T,V]
    f32, hidden [B,T,H] post-final-norm, cache, routing) where routing is a list (one per MoE layer) of (before,
    after) RoutingState."""
    if _is_split(params):       # the NNX model split into one jit argument: merged here, its __call__ is this
        return params.merge()(cfg, cache, tokens, start, lengths, resident, plugin, moe_rows, logit_rows)
    B, T = tokens.shape
    if lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    valid_bt = jnp.arange(T)[None, :] < lengths[:, None]
    x = embed(params, tokens)
    new_cache = []
    routing = []
    sel = None
    mi = 0
    for i, lp in enumerate(params["layers"]):
        res = None
        if "moe" in lp:
            res = resident[mi] if resident is not None else jnp.zeros((cfg.n_routed_experts,), bool)
            mi += 1
        x, c, sel, r = layer_forward(cfg, lp, x, cache[i], start, i, sel, valid_bt, res, plugin, moe_rows=moe_rows)
        new_cache.append(c)
        if r is not None:
            routing.append(r)
    new_cache.extend(cache[len(params["layers"]):])        # the MTP layer's cache rides along untouched
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return head(params, hidden, valid_bt if logit_rows is None else logit_rows), hidden, new_cache, routing

def mtp_input(cfg: ModelConfig, params, tokens, hidden, own_embed: bool = False):
    """u = eh_proj(concat[enorm(Embed(x_{t+1})), hnorm(h_t)]) for tokens [B, T] (x_{t+1}) and hidden [B, T, H] (h_t,
    the main model's post-final-norm hidden, or the previous MTP step's output when chaining)."""
    mp = params["mtp"]
    table = mp["embed"] if own_embed and mp.get("embed") is not None else params["embed"]
    e = rms_norm(qtake(table, tokens).astype(mp["enorm"].dtype), mp["enorm"], cfg.rms_norm_eps)
    h = rms_norm(hidden.astype(e.dtype), mp["hnorm"], cfg.rms_norm_eps)
    return linear(jnp.concatenate([e, h], axis=-1), mp["eh_proj"])

def mtp_output(cfg: ModelConfig, params, g, own_head: bool = False):
    """shared_head.norm -> head.  Returns (logits f32 [B, T, V], normed hidden [B, T, H])."""
    mp = params["mtp"]
    hn = rms_norm(g, mp["head_norm"], cfg.rms_norm_eps)
    w = mp["head"] if own_head and mp.get("head") is not None else params["lm_head"]
    return head_logits(hn, w), hn

def mtp_forward(cfg: ModelConfig, params, cache, tokens, hidden, start, lengths=None, resident=None,
                plugin: Callable = identity_plugin, own_head: bool = False, bank: Optional[ExpertBank] = None,
                slot_of=None):
    """The MTP layer on pairs (x_{t+1} = tokens [B, T], h_t = hidden [B, T, H]) at positions start[b]..

    Position convention (vLLM's): the pair (x_{t+1}, h_t) sits at position t, in MTP cache slot t, so the MTP cache
    holds slots 0..p with no hole.  transformers puts it at t+1 (the token's position) with attention over the MTP
    positions only; RoPE depends only on relative positions, so both give the same logits (tests/test_mtp.py checks
    this against transformers' MtpModel within 1e-4).  With HF's t+1 the never-written slot 0 of a static cache would
    be attended as a zero key.

    Draft logits for x_{t+2}.  Uses its own KV cache, ``cache[num_hidden_layers]`` (``init_cache(with_mtp=True)``); the
    other entries ride along untouched.  Embedding and head default to the MAIN model's (as transformers does; vLLM
    loads the checkpoint's ``shared_head.head`` / ``embed_tokens``, which GLM releases store as copies of the main
    ones) -- ``own_head=True`` uses the checkpoint's MTP copies when present.
    Returns (logits [B,T,V] f32, hn [B,T,H] (after shared_head.norm, the chained hidden), cache, routing)."""
    params = as_params(params)
    B, T = tokens.shape
    L = cfg.num_hidden_layers
    if lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    valid_bt = jnp.arange(T)[None, :] < lengths[:, None]
    res = resident if resident is not None else jnp.zeros((cfg.n_routed_experts,), bool)
    u = mtp_input(cfg, params, tokens, hidden, own_head)
    g, c, _, r = layer_forward(cfg, params["mtp"]["layer"], u, cache[L], start, L, None, valid_bt, res, plugin,
                               bank, slot_of)
    logits, hn = mtp_output(cfg, params, g, own_head)
    new_cache = list(cache[:L]) + [c] + list(cache[L + 1:])
    return logits, hn, new_cache, [r]

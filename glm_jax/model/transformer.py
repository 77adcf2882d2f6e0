"""The GLM MoE forward pass: one decoder layer and the whole model (glm4_moe; glm_moe_dsa's attention in mla.py).

Plain functions over the params pytree documented in WORKSPACE.md.  Shapes:
B batch, T query tokens, S cache slots (= positions), H hidden, nh/nkv heads, hd head_dim, E experts, K top-k.
Read it in data-path order: ``layers`` (norm, linear, rope, mlp, embed, head) -> ``attention`` (GQA, or ``mla``)
-> ``router`` (-> RoutingState -> plugins) -> ``moe`` (THE MOE SEAM and its backends) -> this module.

The layer is one body (``layer_forward``) whatever supplies the routed experts: ``moe_route`` (attention + residual,
post-norm, router -> RoutingState, the routing plugins (``glm_jax_plugins``)), an ``ExpertSource`` (the resident
bank here; an expert store in runtime/streaming.py) and ``moe_output`` (the seam on the real rows, shared expert,
residual).  ``step`` chains it for resident experts inside one jit.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp

from ..kernels.formats import ExpertBank, qtake
from .attention import attn_block
from .config import ModelConfig
from .layers import embed, head, head_logits, linear, mlp, positions_of, rms_norm
from .moe import moe_finish, moe_real_rows
from .router import identity_plugin, route


def _is_split(params) -> bool:
    return hasattr(params, "merge") and hasattr(params, "graphdef")

def as_params(params):
    """``step`` / ``mtp_forward`` take the params pytree, or the NNX model split into one jit argument
    (``nnx_model.Split``): merged here, inside the trace (nnx.split -> jax.jit -> nnx.merge)."""
    return params.params() if _is_split(params) else params

# ----------------------------------------------------------------------------- one decoder layer
# The layer body, whatever supplies the routed experts:
#     attention -> post-norm -> router -> plugins -> experts (an ExpertSource) -> routed + shared expert
# ``layer_forward`` chains it inside one trace; a streamed forward that must read the routing on the host between
# the router and the experts runs its two halves, ``moe_route`` and ``moe_output``, as two programs with the store's
# fetch between them.  ``state`` is the layer's entry of the cache: a dict of arrays the attention reads and
# writes (K/V); the body passes it through whole, so per-layer state other than K/V rides in the same dict.

class ExpertSource:
    """What a MoE layer's routed experts come from (the resident bank here; runtime/streaming.py: an expert store
    called from inside the program).  ``resident(mi)``: bool [E], what the plugins see as resident in MoE layer
    ``mi`` (its index among the MoE layers); ``experts(mi, lp, hn, after, valid_bt)``: (bank, slot_of, rows) for
    the routing ``after`` of hn [B, T, H] (rows: static, only rows [:rows] can be real, or None)."""

    def resident(self, mi: int):
        raise NotImplementedError

    def experts(self, mi: int, lp, hn, after, valid_bt):
        raise NotImplementedError


class ResidentExperts(ExpertSource):
    """The layer's own bank (lp["experts"]; lp["slot_of"]: where an expert store put them), or ``bank``.
    ``masks`` [n_moe, E] bool: what the plugins see as resident (None: nothing).  ``moe_rows`` (static, B == 1):
    only rows [:moe_rows] can be real, so the routed experts run on those rows alone (a decode padded to the
    verify width pays for one row of experts, not T; speculative.py) -- where the full-width forward takes the
    gather path too: its per-(t, k) products are row-count invariant (the dense all-slots path is not, so it keeps
    the full width)."""

    def __init__(self, cfg: ModelConfig, masks=None, moe_rows: Optional[int] = None,
                 bank: Optional[ExpertBank] = None, slot_of=None):
        self.cfg, self.masks, self.moe_rows, self.bank, self.slot_of = cfg, masks, moe_rows, bank, slot_of

    def resident(self, mi: int):
        return self.masks[mi] if self.masks is not None else jnp.zeros((self.cfg.n_routed_experts,), bool)

    def experts(self, mi: int, lp, hn, after, valid_bt):
        bank, slot_of = (lp["experts"], lp.get("slot_of")) if self.bank is None else (self.bank, self.slot_of)
        B, T = hn.shape[:2]
        R = self.moe_rows
        short = (bank.kernel != "native" and R is not None and B == 1 and R < T and
                 T * after.ids.shape[1] <= bank.local_slots)
        return bank, slot_of, R if short else None


def dense_layer(cfg: ModelConfig, lp, x, state, start, layer: int, prev_sel, valid_bt, attend=attn_block):
    """A dense layer: attention, then the MLP on the real positions.  Returns (y, state, sel)."""
    h, state, sel = attend(cfg, lp, x, state, start, layer, prev_sel, valid_bt)
    return h + mlp(lp["mlp"], rms_norm(h, lp["post_norm"], cfg.rms_norm_eps), valid_bt), state, sel

def moe_route(cfg: ModelConfig, lp, x, state, start, layer: int, prev_sel, valid_bt, resident,
              plugin: Callable = identity_plugin, layer_id=None, attend=attn_block):
    """A MoE layer's first half: attention -> post-norm -> router -> plugins.  ``layer`` picks the attention's
    variant (static), ``layer_id`` (default ``layer``; may be traced) is the index the plugins see.
    Returns (h, hn, state, sel, before, after) with before / after the RoutingState the plugins got / gave."""
    B, T, H = x.shape
    h, state, sel = attend(cfg, lp, x, state, start, layer, prev_sel, valid_bt)
    hn = rms_norm(h, lp["post_norm"], cfg.rms_norm_eps)
    before = route(cfg, lp["moe"], hn.reshape(B * T, H), valid_bt.reshape(B * T), resident,
                   layer if layer_id is None else layer_id, positions_of(start, T))
    return h, hn, state, sel, before, plugin(before)

def moe_output(mp, h, hn, ids, weights, valid, bank: ExpertBank, slot_of=None, rows: Optional[int] = None):
    """A MoE layer's second half: the routed experts of the real rows (moe_real_rows) + the shared expert + the
    residual.  A real position routes to >= 1 expert (plugins never empty one): ``valid`` marks the real ones."""
    B, T, H = h.shape
    routed = moe_real_rows(hn.reshape(B * T, H), ids, weights, valid, bank, slot_of, rows)
    return moe_finish(mp, h, hn, routed.reshape(B, T, H), valid.any(-1).reshape(B, T))

def layer_forward(cfg: ModelConfig, lp, x, state, start, layer: int, prev_sel, valid_bt, experts: ExpertSource,
                  plugin: Callable = identity_plugin, mi: int = 0, layer_id=None, attend=attn_block):
    """One decoder layer on x [B, T, H]: ``moe_route`` -> ``experts`` -> ``moe_output`` (dense layers: attention +
    MLP).  ``mi``: the layer's index among the MoE layers.  Returns (y, state, sel, routing) where routing is
    (before, after) RoutingState or None for dense layers."""
    if "moe" not in lp:
        return (*dense_layer(cfg, lp, x, state, start, layer, prev_sel, valid_bt, attend), None)
    h, hn, state, sel, before, after = moe_route(cfg, lp, x, state, start, layer, prev_sel, valid_bt,
                                                 experts.resident(mi), plugin, layer_id, attend)
    bank, slot_of, rows = experts.experts(mi, lp, hn, after, valid_bt)
    y = moe_output(lp["moe"], h, hn, after.ids, after.weights, after.valid, bank, slot_of, rows)
    return y, state, sel, (before, after)

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
    experts = ResidentExperts(cfg, resident, moe_rows)
    new_cache = []
    routing = []
    sel = None
    for i, lp in enumerate(params["layers"]):
        x, c, sel, r = layer_forward(cfg, lp, x, cache[i], start, i, sel, valid_bt, experts, plugin, len(routing))
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
    experts = ResidentExperts(cfg, None if resident is None else resident[None], bank=bank, slot_of=slot_of)
    u = mtp_input(cfg, params, tokens, hidden, own_head)
    g, c, _, r = layer_forward(cfg, params["mtp"]["layer"], u, cache[L], start, L, None, valid_bt, experts, plugin)
    logits, hn = mtp_output(cfg, params, g, own_head)
    new_cache = list(cache[:L]) + [c] + list(cache[L + 1:])
    return logits, hn, new_cache, [r]

"""The GLM MoE forward pass in JAX (glm4_moe; glm_moe_dsa attention lives in mla.py).

Plain functions over the params pytree documented in WORKSPACE.md.  Shapes:
B batch, T query tokens, S cache slots (= positions), H hidden, nh/nkv heads, hd head_dim, E experts, K top-k.

The layer is split into the pieces a streaming engine needs between host round trips:
``attn_block`` (attention + residual), ``route`` (post-norm + router -> RoutingState), the routing plugins
(``glm_jax_plugins``), ``moe_routed`` (THE MOE SEAM: routed experts for a routing plan and an ExpertBank) and
``moe_finish`` (shared expert + residual).  ``step`` chains them for resident experts inside one jit.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from glm_jax_plugins.routing import RoutingState

from .config import ModelConfig
from .quant import FLOAT_FORMATS, ExpertBank, QWeight, as_rows, bank_all, bank_take, qdot, qtake, take_dot

F32 = jnp.float32


# ----------------------------------------------------------------------------- basic pieces
def row_sum(x):
    """Sum over the last axis (keepdims) as a fixed tree of elementwise adds, zero-padded to a power of two.
    XLA:CPU's reduce codegen changes its summation order with the number of rows, and a row's numbers must not
    depend on how many rows share the forward (the scheduler's decode widths follow the running rows); zero
    padding leaves the sum bitwise unchanged (an attention window of any power-of-two size)."""
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x


def softmax(x):
    """softmax over the last axis with ``row_sum`` (row-count invariant; max is exact in any order)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0)))
    return e / row_sum(e)


def rms_norm(x, w, eps):
    """transformers numerics: f32 statistics, cast back to the input dtype *before* the weight multiply."""
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(row_sum(x32 * x32) / x.shape[-1] + eps)
    return w * y.astype(x.dtype)


def linear(x, w, b=None, rows=None):
    """x [..., in] @ w[out, in].T (+ b); ``w`` a float array or a QWeight (quant.py: native kernels).  ``rows``
    (bool, x's leading shape): the rows that matter (the native kernels skip padding rows)."""
    y = qdot(x, w, rows).astype(x.dtype) if isinstance(w, QWeight) else jnp.einsum("...i,oi->...o", x, w)
    return y if b is None else y + b


def rope_cos_sin(positions, rot_dim: int, theta: float, dtype):
    """cos/sin tables [..., rot_dim] for half-split ("NeoX") RoPE, as transformers computes them (f32)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.int64).astype(np.float32) / rot_dim))
    freqs = positions.astype(F32)[..., None] * jnp.asarray(inv_freq, F32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope_half(x, cos, sin):
    """Half-split RoPE on the first cos.shape[-1] dims of x [B, T, heads, hd]; cos/sin [B, T, rot]."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([xr * c + rotated * s, xp], axis=-1)


def mlp(p, x, rows=None):
    if "gate_up" in p:       # gate and up fused into one matrix (quant.pack_layer)
        h = linear(x, p["gate_up"], rows=rows)
        I = h.shape[-1] // 2
        return linear(jax.nn.silu(h[..., :I]) * h[..., I:], p["down_w"], rows=rows)
    return linear(jax.nn.silu(linear(x, p["gate_w"])) * linear(x, p["up_w"]), p["down_w"])


def positions_of(start, T):
    return start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


# ----------------------------------------------------------------------------- attention (glm4_moe, GQA)
def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype, with_mtp: bool = False) -> list:
    """One dict per layer (+ the MTP layer at the end when ``with_mtp``)."""
    n = cfg.num_hidden_layers + (1 if with_mtp else 0)
    if cfg.model_type == "glm_moe_dsa":
        from . import mla

        return [mla.init_mla_cache(cfg, i, batch, max_len, dtype) for i in range(n)]
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(n)]


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, with_mtp: bool = True) -> int:
    """KV-cache bytes per position over every layer (and the MTP layer)."""
    n = cfg.num_hidden_layers + (1 if with_mtp and cfg.has_mtp else 0)
    if cfg.model_type == "glm_moe_dsa":
        from . import mla

        kb = mla.kv_bytes_per_token(cfg, dtype_bytes)
        return kb["model_total"] + (kb["mtp_layer"] if with_mtp and cfg.has_mtp else 0)
    return n * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def gqa_attention(cfg: ModelConfig, p, x, cache, start, rows=None):
    """x [B, T, H] (input-normed).  Writes K/V at positions start..start+T-1 and attends causally over the cache.
    ``rows`` [B, T] bool: real (non-padding) positions (the native projections skip the others)."""
    B, T, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if "qkv" in p:           # q/k/v fused into one matrix (quant.pack_layer)
        qkv = linear(x, p["qkv"], p.get("qkv_b"), rows)
        q = qkv[..., :nh * hd].reshape(B, T, nh, hd)
        k = qkv[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd)
        v = qkv[..., (nh + nkv) * hd:].reshape(B, T, nkv, hd)
    else:
        q = linear(x, p["q_w"], p.get("q_b")).reshape(B, T, nh, hd)
        k = linear(x, p["k_w"], p.get("k_b")).reshape(B, T, nkv, hd)
        v = linear(x, p["v_w"], p.get("v_b")).reshape(B, T, nkv, hd)
    if "q_norm" in p:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    pos = positions_of(start, T)                                     # [B, T]
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, x.dtype)
    q = apply_rope_half(q, cos, sin)
    k = apply_rope_half(k, cos, sin)
    bidx = jnp.arange(B)[:, None]
    ck = cache["k"].at[bidx, pos].set(k.astype(cache["k"].dtype), mode="drop")
    cv = cache["v"].at[bidx, pos].set(v.astype(cache["v"].dtype), mode="drop")
    S = ck.shape[1]
    g = nh // nkv
    qg = q.reshape(B, T, nkv, g, hd)
    scores = jnp.einsum("btngd,bsnd->bngts", qg, ck.astype(q.dtype), preferred_element_type=F32) * (hd ** -0.5)
    allowed = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]   # [B, T, S]
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    probs = softmax(scores).astype(q.dtype)
    out = jnp.einsum("bngts,bsnd->btngd", probs, cv.astype(q.dtype)).reshape(B, T, nh * hd)
    return linear(out, p["o_w"], rows=rows), {"k": ck, "v": cv}, None


def attention(cfg: ModelConfig, p, x, cache, start, layer: int, prev_sel, rows=None):
    if cfg.model_type == "glm_moe_dsa":
        from . import mla

        return mla.mla_attention(cfg, p, x, cache, start, layer, prev_sel)
    return gqa_attention(cfg, p, x, cache, start, rows)


def attn_block(cfg: ModelConfig, lp, x, cache, start, layer: int, prev_sel=None, rows=None):
    """h = x + Attn(RMSNorm_in(x)).  Returns (h, cache, sel) — sel is the DSA selection (None for GQA)."""
    a, cache, sel = attention(cfg, lp["attn"], rms_norm(x, lp["input_norm"], cfg.rms_norm_eps), cache, start, layer,
                              prev_sel, rows)
    return x + a, cache, sel


# ----------------------------------------------------------------------------- router + MoE
def route(cfg: ModelConfig, mp, hn, positions_valid, resident, layer=None, seq_pos=None) -> RoutingState:
    """The GLM "noaux_tc" router in f32 on hn [T, H] (post-attention-normed).  Returns the routing state; ``layer``
    (the layer index, int or int32 scalar) and ``seq_pos`` ([T] int32, each row's position in its sequence) are
    handed to the plugins (None: unknown)."""
    T = hn.shape[0]
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    h32 = hn.astype(F32)
    if T == 1:      # XLA:CPU runs a one-row dot as a matrix-vector product, whose sums differ in the last bits from
        h32 = jnp.pad(h32, ((0, 1), (0, 0)))    # the GEMM of 2+ rows: a row's routing must not depend on the width
    logits = jnp.einsum("th,eh->te", h32, mp["router_w"].astype(F32))[:T]
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


def moe_routed(x, ids, weights, valid, bank: ExpertBank, slot_of=None, gather: Optional[bool] = None):
    """THE MOE SEAM.  x [T, H]; ids/weights/valid [T, K]; bank: S expert slots; slot_of [E] id -> slot (None: identity).

    out[t] = sum_k valid[t,k] * weights[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t,k].
    Small T*K gathers the selected slots; otherwise every slot is computed for every token and each token's K
    outputs are picked from those (no data-dependent shapes either way); ``gather`` forces the choice.
    A mesh bank (``bank.mesh`` set; glm_jax/parallel.py) holds its slots sharded over the mesh's ``expert`` axis and
    takes a slot map ``[n, E]`` (shard d's slot of each expert, -1 elsewhere) as ``slot_of``."""
    dt = x.dtype
    if bank.mesh is not None:
        from . import parallel

        return parallel.moe_f32(x, ids, weights, valid, bank, slot_of, gather).astype(dt)
    return _moe_f32(x, ids, weights, valid, bank, slot_of, gather).astype(dt)


def _moe_f32(x, ids, weights, valid, bank: ExpertBank, slot_of=None, gather: Optional[bool] = None):
    """``moe_routed`` on one device's bank, in f32 (a mesh bank's shards each run this on their own slots)."""
    T, K = ids.shape
    S = bank.num_slots
    slots = ids if slot_of is None else jnp.take(slot_of, ids, axis=0)
    dt = x.dtype
    if bank.kernel == "native":     # glm_jax/kernels: each used expert once over its tokens, summed in routing order
        return _native(x, slots, weights, valid, bank, terms=False)
    bank = as_rows(bank)
    slots = jnp.where(valid, jnp.clip(slots, 0, S - 1), 0)
    if (T * K <= S) if gather is None else gather:
        return moe_combine(moe_terms(x, ids, valid, bank, slot_of), weights, valid)
    if bank.fmt not in FLOAT_FORMATS:
        return moe_combine(_slot_terms(x, slots, valid, bank), weights, valid)
    gu, dn = bank_all(bank, dt)                                             # [S,2I,H], [S,H,I]
    I = dn.shape[-1]
    h = jnp.einsum("th,sih->tsi", x, gu)
    a = jax.nn.silu(h[..., :I]) * h[..., I:]
    y = jnp.einsum("tsi,shi->tsh", a, dn).astype(F32)                      # [T,S,H]
    # summed in routing order (k), not slot order: where an expert sits depends on the cache's history, and
    # the output must not (bitwise)
    return moe_combine(jnp.take_along_axis(y, slots[:, :, None], axis=1), weights, valid)


def _native(x, slots, weights, valid, bank: ExpertBank, terms: bool):
    from . import kernels

    S = bank.num_slots
    slots = jnp.where(valid & (slots >= 0), jnp.clip(slots, 0, S - 1), -1).astype(jnp.int32)
    w = jnp.where(valid, weights, 0.0).astype(F32)
    return kernels.moe(x.astype(F32), slots, w, bank.gate_up, bank.gate_up_scale, bank.down, bank.down_scale,
                       bank.fmt, bank.group("gate_up"), bank.group("down"), bank.dims[1], terms=terms)


def _slot_terms(x, slots, valid, bank: ExpertBank):
    """Quantized banks, many tokens: per-(t, k) expert outputs y [T, K, H] f32, computing each slot that some valid
    (t, k) uses once for all T tokens (a scan over the slots; ``lax.cond`` skips the unused ones) with only that
    slot dequantized.  Dequantizing every slot at once would hold S experts in float: 19 GB (bf16) to 38 GB (f32)
    per layer for GLM-5.2's 256 experts, most of them unused by a short prefill."""
    T, K = slots.shape
    H = x.shape[-1]
    used = jnp.zeros((bank.num_slots,), bool).at[slots].max(valid)

    def body(y, s):
        def compute(y):
            gu, dn = bank_take(bank, s[None], x.dtype)                       # [1,2I,H], [1,H,I]
            I = dn.shape[-1]
            h = jnp.einsum("th,ih->ti", x, gu[0])
            a = jax.nn.silu(h[:, :I]) * h[:, I:]
            ys = jnp.einsum("ti,hi->th", a, dn[0]).astype(F32)
            return jnp.where((slots == s)[:, :, None], ys[:, None, :], y)
        return jax.lax.cond(used[s], compute, lambda y: y, y), None

    y, _ = jax.lax.scan(body, jnp.zeros((T, K, H), F32), jnp.arange(bank.num_slots))
    return y


def moe_terms(x, ids, valid, bank: ExpertBank, slot_of=None):
    """The gather path's per-(t, k) expert outputs y [T, K, H] f32 (unweighted; invalid entries read slot 0 and
    must be masked by the caller).  ``moe_combine(where(m, y1, y2), ...)`` over two partial computations is
    bitwise equal to one ``moe_routed`` (the streaming loop's overlap of hits and misses relies on it).  A mesh
    bank: ``slot_of`` is its slot map, invalid entries come out 0."""
    if bank.mesh is not None:
        from . import parallel

        return parallel.moe_terms(x, ids, valid, bank, slot_of)
    S = bank.num_slots
    slots = ids if slot_of is None else jnp.take(slot_of, ids, axis=0)
    if bank.kernel == "native":
        return _native(x, slots, jnp.ones(ids.shape, F32), valid, bank, terms=True)
    bank = as_rows(bank)
    slots = jnp.where(valid, jnp.clip(slots, 0, S - 1), 0)
    if bank.fmt not in FLOAT_FORMATS:      # quantized: no dequantized weight copy (quant.take_dot)
        def one(xs):                        # one row at a time: XLA:CPU's reduce codegen depends on the row
            x1, s1 = xs                     # count, and a row's result must not (decode vs verify, bitwise)
            h = take_dot(bank, "gate_up", s1[None], x1[None, None, :])      # [1,K,2I] f32
            I = h.shape[-1] // 2
            a = jax.nn.silu(h[..., :I]) * h[..., I:]
            return take_dot(bank, "down", s1[None], a)[0]                   # [K,H] f32
        return jax.lax.map(one, (x, slots))                                 # [T,K,H] f32
    gu, dn = bank_take(bank, slots, x.dtype)                                # [T,K,2I,H], [T,K,H,I]
    I = dn.shape[-1]
    h = jnp.einsum("th,tkih->tki", x, gu)
    a = jax.nn.silu(h[..., :I]) * h[..., I:]
    return jnp.einsum("tki,tkhi->tkh", a, dn).astype(F32)


def moe_combine(y, weights, valid):
    """sum_k valid * weights * y: [T, H] f32."""
    return jnp.einsum("tkh,tk->th", y, jnp.where(valid, weights, 0.0).astype(F32))


def moe_finish(mp, h, hn, routed, rows=None):
    """y = h + routed + Shared(hn)."""
    return h + routed + mlp(mp["shared"], hn, rows)


# ----------------------------------------------------------------------------- one decoder layer, full model
def _is_split(params) -> bool:
    return hasattr(params, "merge") and hasattr(params, "graphdef")


def as_params(params):
    """``step`` / ``mtp_forward`` take the params pytree, or the NNX model split into one jit argument
    (``nnx_model.Split``): merged here, inside the trace (nnx.split -> jax.jit -> nnx.merge)."""
    return params.params() if _is_split(params) else params


def identity_plugin(state: RoutingState) -> RoutingState:
    return state


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


def embed(params, tokens):
    e = qtake(params["embed"], tokens)
    return e if not isinstance(params["embed"], QWeight) else e.astype(params["norm"].dtype)


def head_logits(h, w, rows=None):
    """h [..., H] @ w[V, H].T -> logits f32 (w a float array or a QWeight; ``rows``: see linear)."""
    if isinstance(w, QWeight):
        return qdot(h, w, rows)
    return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=F32)


def head(params, h, rows=None):
    """Final norm is applied by the caller; logits in f32."""
    return head_logits(h, params["lm_head"], rows)


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


# ----------------------------------------------------------------------------- the MTP (nextn) layer
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

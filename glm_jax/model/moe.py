"""THE MOE SEAM: routed experts for a routing plan and an ExpertBank, one entry point and its backends side by side.

    moe_routed(x [T, H], ids [T, K], weights [T, K], valid [T, K], bank, slot_of) -> [T, H]

Backends (chosen from the bank's static fields, inside the trace):

* **native** (``bank.kernel == "native"``): ``glm_jax.kernels.moe`` (C++ through jax.ffi), each used expert once over
  its tokens, per-(t, k) outputs summed in routing order k; invalid entries skipped.
* **xla**: a gather of the selected slots for small T*K (``moe_terms``; quantized banks multiply the packed bytes
  without a dequantized copy, ``take_dot``), a scan over the used slots for a quantized prefill (``_slot_terms``),
  every slot for every token for a float prefill (``bank_all``).
* **mesh** (``bank.mesh`` set): the bank's slots sharded over the mesh's ``expert`` axis; inside ``jax.shard_map``
  each device runs the single-device seam (``_moe_f32``: native or xla) on its own slots.  Its slot map
  ``[n, E] int32`` (row d: shard d's slot of each expert, -1 where shard d does not hold it) is ``slot_of``.
  Two ways to bring tokens to their experts and back (``ExpertBank.comm``): ``psum`` (activations are replicated
  over ``expert``; every device computes the (t, k) entries routed to its experts, one all-reduce of the [T, H]
  partial sums) and ``all_to_all`` (each device takes T/n of the tokens, sends each entry's activation to the
  device holding its expert with a fixed capacity, the outputs come back by a second all_to_all, each device
  combines its tokens' K terms in routing order, an all-gather rebuilds [T, H]).  psum adds the shards' partial
  sums in device order: equal to one device to float rounding (~1e-7 relative), not bitwise
  (``tools/bench/mesh.py --mode=comm`` measures both).

Every path sums a token's experts in routing order (k), never slot order: slot placement depends on the expert
cache's history and the output must not (bitwise).  Routing plugins run *before* this module; the expert store
supplies ``bank`` / ``slot_of`` *behind* it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import kernels
from ..kernels.formats import FLOAT_FORMATS, ExpertBank, _groups, as_rows, dequant_jax, parse_format
from .layers import F32, mlp

EXPERT = "expert"      # the mesh axis the routed experts are sharded over
MODEL = "model"        # the mesh axis attention heads and dense MLPs are split over
COMMS = ("psum", "all_to_all")


# ----------------------------------------------------------------------------- the entry point
def moe_routed(x, ids, weights, valid, bank: ExpertBank, slot_of=None, gather: Optional[bool] = None,
               limit: Optional[float] = None):
    """THE MOE SEAM.  x [T, H]; ids/weights/valid [T, K]; bank: S expert slots; slot_of [E] id -> slot (None: identity).

    out[t] = sum_k valid[t,k] * weights[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t,k].
    Small T*K gathers the selected slots; otherwise every slot is computed for every token and each token's K
    outputs are picked from those (no data-dependent shapes either way); ``gather`` forces the choice.
    A mesh bank (``bank.mesh`` set; glm_jax/runtime/mesh.py) holds its slots sharded over the mesh's ``expert`` axis and
    takes a slot map ``[n, E]`` (shard d's slot of each expert, -1 elsewhere) as ``slot_of``.
    ``limit`` (glm5_next's ``swiglu_limit``): the SwiGLU clamp on every backend, silu(min(gate, limit)) *
    clip(up, -limit, limit) as transformers' Glm5NextTextExperts; None: no clamp, the unclamped program unchanged."""
    dt = x.dtype
    if bank.mesh is not None:
        return _mesh_moe(x, ids, weights, valid, bank, slot_of, gather, limit).astype(dt)
    return _moe_f32(x, ids, weights, valid, bank, slot_of, gather, limit).astype(dt)

def moe_real_rows(x, ids, weights, valid, bank: ExpertBank, slot_of=None, rows: Optional[int] = None):
    """``moe_routed`` where only rows [:rows] of x [N, H] can be real (static ``rows``: a padded decode / verify):
    the seam's gather path on those rows alone (its per-(t, k) products are row-count invariant), zeros below them;
    rows None: every row, the seam's own choice of path."""
    if rows is None:
        return moe_routed(x, ids, weights, valid, bank, slot_of)
    part = moe_routed(x[:rows], ids[:rows], weights[:rows], valid[:rows], bank, slot_of, gather=True)
    return real_rows(part, x, rows)

def real_rows(part, like, rows: Optional[int]):
    """``part`` [rows, H] as the first rows of an array shaped ``like`` (the rest zeros); rows None: ``part``."""
    return part if rows is None else jnp.zeros_like(like).at[:rows].set(part)

def swiglu(h, limit: Optional[float] = None):
    """h [..., 2I] (gate | up) -> silu(gate) * up, with the clamp where ``limit`` is set."""
    I = h.shape[-1] // 2
    if limit is None:           # traced in the order the unclamped seam always has: its programs stay as they were
        return jax.nn.silu(h[..., :I]) * h[..., I:]
    return jax.nn.silu(jnp.minimum(h[..., :I], limit)) * jnp.clip(h[..., I:], -limit, limit)

def moe_terms(x, ids, valid, bank: ExpertBank, slot_of=None, limit: Optional[float] = None):
    """The gather path's per-(t, k) expert outputs y [T, K, H] f32 (unweighted; invalid entries read slot 0 and
    must be masked by the caller).  ``moe_combine(where(m, y1, y2), ...)`` over two partial computations is
    bitwise equal to one ``moe_routed`` (the streaming loop's overlap of hits and misses relies on it).  A mesh
    bank: ``slot_of`` is its slot map, invalid entries come out 0."""
    if bank.mesh is not None:
        return _mesh_terms(x, ids, valid, bank, slot_of, limit)
    S = bank.num_slots
    slots = ids if slot_of is None else jnp.take(slot_of, ids, axis=0)
    if bank.kernel == "native":
        return _native(x, slots, jnp.ones(ids.shape, F32), valid, bank, terms=True, limit=limit)
    bank = as_rows(bank)
    slots = jnp.where(valid, jnp.clip(slots, 0, S - 1), 0)
    if bank.fmt not in FLOAT_FORMATS:      # quantized: no dequantized weight copy (quant.take_dot)
        def one(xs):                        # one row at a time: XLA:CPU's reduce codegen depends on the row
            x1, s1 = xs                     # count, and a row's result must not (decode vs verify, bitwise)
            h = take_dot(bank, "gate_up", s1[None], x1[None, None, :])      # [1,K,2I] f32
            a = swiglu(h, limit)
            return take_dot(bank, "down", s1[None], a)[0]                   # [K,H] f32
        return jax.lax.map(one, (x, slots))                                 # [T,K,H] f32
    gu, dn = bank_take(bank, slots, x.dtype)                                # [T,K,2I,H], [T,K,H,I]
    h = jnp.einsum("th,tkih->tki", x, gu)
    a = swiglu(h, limit)
    return jnp.einsum("tki,tkhi->tkh", a, dn).astype(F32)

def moe_combine(y, weights, valid):
    """sum_k valid * weights * y: [T, H] f32."""
    return jnp.einsum("tkh,tk->th", y, jnp.where(valid, weights, 0.0).astype(F32))

def moe_finish(mp, h, hn, routed, rows=None):
    """y = h + routed + Shared(hn)."""
    return h + routed + mlp(mp["shared"], hn, rows)


# ----------------------------------------------------------------------------- one device: native or xla
def _moe_f32(x, ids, weights, valid, bank: ExpertBank, slot_of=None, gather: Optional[bool] = None,
             limit: Optional[float] = None):
    """``moe_routed`` on one device's bank, in f32 (a mesh bank's shards each run this on their own slots)."""
    T, K = ids.shape
    S = bank.num_slots
    slots = ids if slot_of is None else jnp.take(slot_of, ids, axis=0)
    dt = x.dtype
    if bank.kernel == "native":     # glm_jax/kernels: each used expert once over its tokens, summed in routing order
        return _native(x, slots, weights, valid, bank, terms=False, limit=limit)
    bank = as_rows(bank)
    slots = jnp.where(valid, jnp.clip(slots, 0, S - 1), 0)
    if (T * K <= S) if gather is None else gather:
        return moe_combine(moe_terms(x, ids, valid, bank, slot_of, limit), weights, valid)
    if bank.fmt not in FLOAT_FORMATS:
        return moe_combine(_slot_terms(x, slots, valid, bank, limit), weights, valid)
    gu, dn = bank_all(bank, dt)                                             # [S,2I,H], [S,H,I]
    h = jnp.einsum("th,sih->tsi", x, gu)
    a = swiglu(h, limit)
    y = jnp.einsum("tsi,shi->tsh", a, dn).astype(F32)                      # [T,S,H]
    # summed in routing order (k), not slot order: where an expert sits depends on the cache's history, and
    # the output must not (bitwise)
    return moe_combine(jnp.take_along_axis(y, slots[:, :, None], axis=1), weights, valid)

def _native(x, slots, weights, valid, bank: ExpertBank, terms: bool, limit: Optional[float] = None):
    S = bank.num_slots
    slots = jnp.where(valid & (slots >= 0), jnp.clip(slots, 0, S - 1), -1).astype(jnp.int32)
    w = jnp.where(valid, weights, 0.0).astype(F32)
    return kernels.moe(x.astype(F32), slots, w, bank.gate_up, bank.gate_up_scale, bank.down, bank.down_scale,
                       bank.fmt, bank.group("gate_up"), bank.group("down"), bank.dims[1], terms=terms,
                       limit=limit)

def _slot_terms(x, slots, valid, bank: ExpertBank, limit: Optional[float] = None):
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
            h = jnp.einsum("th,ih->ti", x, gu[0])
            a = swiglu(h, limit)
            ys = jnp.einsum("ti,hi->th", a, dn[0]).astype(F32)
            return jnp.where((slots == s)[:, :, None], ys[:, None, :], y)
        return jax.lax.cond(used[s], compute, lambda y: y, y), None

    y, _ = jax.lax.scan(body, jnp.zeros((T, K, H), F32), jnp.arange(bank.num_slots))
    return y


def bank_take(bank: ExpertBank, slots: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Gather ``slots`` (any int shape) and dequantize: returns gate_up [..., 2I, H], down [..., H, I]."""
    bank = as_rows(bank)
    take = lambda a: None if a is None else jnp.take(a, slots, axis=0)  # noqa: E731
    gu = dequant_jax(take(bank.gate_up), take(bank.gate_up_scale), bank.fmt, dtype)
    dn = dequant_jax(take(bank.down), take(bank.down_scale), bank.fmt, dtype)
    return gu, dn

def take_dot(bank: ExpertBank, part: str, slots: jax.Array, x: jax.Array) -> jax.Array:
    """Quantized experts times activations without materializing dequantized weights (the decode hot path).

    ``part`` "gate_up" ([S, 2I, H]) or "down" ([S, H, I]); ``slots`` int [T, K]; ``x`` f32 [T, 1 | K, in].
    Returns f32 [T, K, out]: out[t, k, o] = sum_j W_{slots[t,k]}[o, j] * x[t, k, j].  For int4 the packed bytes
    are split into low (even j) and high (odd j) nibbles and multiplied with x's even / odd elements, summed per
    group, offset-corrected and scaled: a fused multiply-reduce over the packed bytes (XLA:CPU makes the
    dequantize-then-dot form several passes over an interleaved float copy: 3-8x slower at decode, measured).
    int8: converted, then one dot (faster than a multiply-reduce there, measured).  Float banks use bank_take."""
    bank = as_rows(bank)
    q = jnp.take(getattr(bank, part), slots, axis=0)                          # [T, K, O, in'] packed/int8
    sc = getattr(bank, part + "_scale")
    sc = None if sc is None else jnp.take(sc, slots, axis=0)                  # [T, K, O, G]
    kind, g = parse_format(bank.fmt)
    if kind in FLOAT_FORMATS:
        raise ValueError(f"take_dot is for quantized banks (got {bank.fmt}); float banks use bank_take")
    x = x.astype(jnp.float32)
    T, K = slots.shape
    if kind == "int8_row":      # a dot is fastest here (measured; XLA:CPU)
        xb = jnp.broadcast_to(x, (T, K, x.shape[-1]))
        return jnp.einsum("tkoh,tkh->tko", q.astype(jnp.float32), xb) * sc[..., 0]
    # int4: sum_j (q_j - 8) x_j s_g = s_g (sum_j q_j x_j - 8 sum_j x_j), per group g
    G = sc.shape[-1]
    gs2 = _groups(kind, g, 2 * q.shape[-1], G) // 2
    xe, xo = x[..., None, 0::2], x[..., None, 1::2]                             # [T, 1|K, 1, in/2]
    pad = G * gs2 - q.shape[-1]         # a shorter last group: zero bytes against zero activations add nothing
    if pad:
        q = jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, pad)])
        xe, xo = (jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) for a in (xe, xo))
    p = ((q & 0x0F).astype(jnp.float32) * xe + (q >> 4).astype(jnp.float32) * xo)
    p = p.reshape(*p.shape[:-1], G, gs2).sum(-1)                                # [T, K, O, G]
    corr = 8.0 * (xe + xo).reshape(*xe.shape[:-1], G, gs2).sum(-1)              # [T, 1|K, 1, G]
    return ((p - corr) * sc).sum(-1)

def bank_all(bank: ExpertBank, dtype) -> tuple[jax.Array, jax.Array]:
    """Dequantize every slot (used when every slot is computed for every token)."""
    bank = as_rows(bank)
    gu = dequant_jax(bank.gate_up, bank.gate_up_scale, bank.fmt, dtype)
    dn = dequant_jax(bank.down, bank.down_scale, bank.fmt, dtype)
    return gu, dn


# ----------------------------------------------------------------------------- mesh: shard_map over "expert"
def local_bank(bank):
    """The per-device view inside shard_map: the same bank without its mesh (the single-device seam runs on it)."""
    return dataclasses.replace(bank, mesh=None)

def _bank_specs(bank):
    return jax.tree.map(lambda a: P(EXPERT), local_bank(bank))

def _smap(bank, body, args, arg_specs, out_spec):
    lb = local_bank(bank)
    return jax.shard_map(body, mesh=bank.mesh, in_specs=tuple(arg_specs) + (_bank_specs(bank),),
                         out_specs=out_spec, check_vma=False)(*args, lb)

def _mesh_moe(x, ids, weights, valid, bank, slot_map, gather=None, limit=None):
    """The seam on a mesh bank: out [T, H] f32 = sum_k valid * weights * expert_{ids}(x), replicated."""
    if bank.comm == "all_to_all":
        return _moe_all_to_all(x, ids, weights, valid, bank, slot_map, limit)

    def body(x, ids, w, v, smap, lb):
        slots = jnp.take(smap[0], ids, axis=0)                        # -1: the expert lives on another shard
        here = v & (slots >= 0)
        return jax.lax.psum(_moe_f32(x, slots, w, here, lb, None, gather, limit), EXPERT)

    return _smap(bank, body, (x, ids, weights, valid, slot_map), (P(), P(), P(), P(), P(EXPERT)), P())

def _mesh_terms(x, ids, valid, bank, slot_map, limit=None):
    """Per-(t, k) unweighted expert outputs [T, K, H] f32 on a mesh bank (each entry computed by the shard holding its
    expert, zero elsewhere, summed over the shards); invalid entries are 0."""
    def body(x, ids, v, smap, lb):
        slots = jnp.take(smap[0], ids, axis=0)
        here = v & (slots >= 0)
        y = moe_terms(x, slots, here, lb, None, limit)
        return jax.lax.psum(jnp.where(here[..., None], y, 0.0), EXPERT)

    return _smap(bank, body, (x, ids, valid, slot_map), (P(), P(), P(), P(EXPERT)), P())

def _moe_all_to_all(x, ids, weights, valid, bank, slot_map, limit=None):
    n = bank.mesh.shape[EXPERT]
    T, K = ids.shape
    H = x.shape[-1]
    Tp = -(-T // n) * n                      # tokens padded to a multiple of the expert axis
    if Tp != T:
        pad = Tp - T
        x = jnp.pad(x, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        valid = jnp.pad(valid, ((0, pad), (0, 0)))
    Tl = Tp // n
    C = Tl * K                               # capacity per destination: every entry of my tokens could go there

    def body(x, ids, w, v, smap_all, lb):
        d = jax.lax.axis_index(EXPERT)
        mine = lambda a: jax.lax.dynamic_slice_in_dim(a, d * Tl, Tl, axis=0)     # noqa: E731
        xl, il, wl, vl = mine(x), mine(ids), mine(w), mine(v)                    # [Tl, H], [Tl, K] ...
        slots_by_dev = jnp.take(smap_all, il.reshape(C), axis=1)                 # [n, C]: slot on each shard
        owner = jnp.argmax(slots_by_dev >= 0, axis=0)                            # [C]
        slot = jnp.take_along_axis(slots_by_dev, owner[None], axis=0)[0]         # [C]
        ok = vl.reshape(C) & (slot >= 0)
        to = (jnp.arange(n)[:, None] == owner[None, :]) & ok[None, :]            # [n, C]
        rows = jnp.repeat(xl, K, axis=0)                                         # [C, H]: entry (t, k) -> x_t
        send_x = jnp.where(to[..., None], rows[None], 0.0).astype(x.dtype)       # [n, C, H]
        send_s = jnp.where(to, slot[None], -1).astype(jnp.int32)                 # [n, C]
        recv_x = jax.lax.all_to_all(send_x, EXPERT, 0, 0, tiled=False)           # [n, C, H] from each source
        recv_s = jax.lax.all_to_all(send_s, EXPERT, 0, 0, tiled=False)
        got = recv_s.reshape(n * C, 1)
        # each received row is one (t, k) entry: the seam with K = 1 and weight 1 is its expert's output (the
        # gather path for few rows, each used slot once for many: a prefill)
        y = _moe_f32(recv_x.reshape(n * C, H), got, jnp.ones(got.shape, F32), got >= 0, lb, None, None, limit)
        y = y.reshape(n, C, H)
        back = jax.lax.all_to_all(y, EXPERT, 0, 0, tiled=False)                  # [n, C, H]: my entries' results
        terms = back.sum(0).reshape(Tl, K, H)                                    # one non-zero source per entry
        out = moe_combine(terms, wl, vl & ok.reshape(Tl, K))                   # [Tl, H] f32, routing order
        return jax.lax.all_gather(out, EXPERT, axis=0, tiled=True)               # [Tp, H]

    out = _smap(bank, body, (x, ids, weights, valid, slot_map), (P(), P(), P(), P(), P()), P())
    return out[:T]

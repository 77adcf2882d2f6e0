"""The MoE seam on a device mesh: routed experts sharded over the mesh's ``expert`` axis (model layer; jax only).

A mesh bank (``ExpertBank.mesh`` set) holds every expert shard's slots stacked on its slot axis, sharded
``P("expert")``: device row d of the expert axis holds slots ``[d*S, (d+1)*S)`` (replicated over ``model``).  Its slot
map ``slot_map [n, E] int32`` is sharded the same way: row d maps an expert id to its slot in shard d, or -1 where
shard d does not hold it (an expert lives in exactly one shard).  Inside ``jax.shard_map`` each device runs the
ordinary single-device seam (``model._moe_f32``: the native kernels or the XLA paths) on its local slots only.

Two ways to bring tokens to their experts and back (``ExpertBank.comm``):

* ``psum`` (all-gather + psum): the activations are already replicated over ``expert`` (attention and the dense
  MLPs are replicated or tensor-parallel over ``model``), so every device computes the (t, k) entries routed to its
  own experts for every token, and one all-reduce of the [T, H] partial sums gives each device the whole output.
* ``all_to_all``: each device takes T/n of the tokens, sends each (t, k) entry's activation to the device holding
  its expert (``lax.all_to_all`` with a fixed capacity of T/n x K rows per destination, so no routing-dependent
  shapes), the expert outputs come back by a second all_to_all, each device combines its tokens' K terms in routing
  order, and an all-gather rebuilds the replicated [T, H].

Both sum a token's terms in f32; the psum path adds the shards' partial sums in device order, so the result equals
one device's to float rounding (~1e-7 relative), not bitwise.  tools/bench_mesh.py --mode=comm measures both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

F32 = jnp.float32
EXPERT = "expert"      # the mesh axis the routed experts are sharded over
MODEL = "model"        # the mesh axis attention heads and dense MLPs are split over
COMMS = ("psum", "all_to_all")


def local_bank(bank):
    """The per-device view inside shard_map: the same bank without its mesh (the single-device seam runs on it)."""
    return dataclasses.replace(bank, mesh=None)


def _bank_specs(bank):
    return jax.tree.map(lambda a: P(EXPERT), local_bank(bank))


def _smap(bank, body, args, arg_specs, out_spec):
    lb = local_bank(bank)
    return jax.shard_map(body, mesh=bank.mesh, in_specs=tuple(arg_specs) + (_bank_specs(bank),),
                         out_specs=out_spec, check_vma=False)(*args, lb)


def moe_f32(x, ids, weights, valid, bank, slot_map, gather=None):
    """The seam on a mesh bank: out [T, H] f32 = sum_k valid * weights * expert_{ids}(x), replicated."""
    from . import model as M

    if bank.comm == "all_to_all":
        return _moe_all_to_all(x, ids, weights, valid, bank, slot_map)

    def body(x, ids, w, v, smap, lb):
        slots = jnp.take(smap[0], ids, axis=0)                        # -1: the expert lives on another shard
        here = v & (slots >= 0)
        return jax.lax.psum(M._moe_f32(x, slots, w, here, lb, None, gather), EXPERT)

    return _smap(bank, body, (x, ids, weights, valid, slot_map), (P(), P(), P(), P(), P(EXPERT)), P())


def moe_terms(x, ids, valid, bank, slot_map):
    """Per-(t, k) unweighted expert outputs [T, K, H] f32 on a mesh bank (each entry computed by the shard holding its
    expert, zero elsewhere, summed over the shards); invalid entries are 0."""
    from . import model as M

    def body(x, ids, v, smap, lb):
        slots = jnp.take(smap[0], ids, axis=0)
        here = v & (slots >= 0)
        y = M.moe_terms(x, slots, here, lb, None)
        return jax.lax.psum(jnp.where(here[..., None], y, 0.0), EXPERT)

    return _smap(bank, body, (x, ids, valid, slot_map), (P(), P(), P(), P(EXPERT)), P())


def _moe_all_to_all(x, ids, weights, valid, bank, slot_map):
    from . import model as M

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
        y = M._moe_f32(recv_x.reshape(n * C, H), got, jnp.ones(got.shape, F32), got >= 0, lb, None, None)
        y = y.reshape(n, C, H)
        back = jax.lax.all_to_all(y, EXPERT, 0, 0, tiled=False)                  # [n, C, H]: my entries' results
        terms = back.sum(0).reshape(Tl, K, H)                                    # one non-zero source per entry
        out = M.moe_combine(terms, wl, vl & ok.reshape(Tl, K))                   # [Tl, H] f32, routing order
        return jax.lax.all_gather(out, EXPERT, axis=0, tiled=True)               # [Tp, H]

    out = _smap(bank, body, (x, ids, weights, valid, slot_map), (P(), P(), P(), P(), P()), P())
    return out[:T]

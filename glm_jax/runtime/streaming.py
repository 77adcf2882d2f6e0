"""Forward passes whose routed experts come from an ExpertStore (glm_jax/experts/store.py).

Three fetch modes, same math (tested to give identical outputs; loop and fused bitwise):

* ``loop``: a Python layer loop.  Per MoE layer: jit(attention + router + plugins) -> the routing decision is read
  back to the host -> ``store.fetch(layer, union)`` reads the misses straight into the layer's slot arena (aliased by
  the jax arrays on CPU, so hits cost nothing) -> jit(MoE seam + shared expert).  Dense layers are one jit each.
  All jits are shared by every layer of the same kind (one compile).
* ``callback``: the whole step is one jit; each MoE layer calls the store through an ordered ``io_callback``, which
  gathers the union's slots into a compact [W, ...] buffer (W = min(E, K x T)); XLA copies that buffer once more.
* ``fused``: a decode / verify forward as one program over the store's slot arenas (jit arguments, aliased on CPU),
  the store called only for a layer with a miss (see "fused mode" below); prefills run the loop's way.

Every byte moved is counted by the store; this module only adds routing-side numbers (union sizes, prefetch recall).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from .. import fileio
from .. import model
from ..kernels.formats import ExpertBank
from .stats import routing_summary as _routing_summary

OVERLAP_MAX_PAIRS = 512    # --overlap, native kernel: the most (position, k) pairs a forward splits (16 rows' decode)


def _layer_key(cfg, i):
    # GQA layers are interchangeable (one compile); DSA layers differ by indexer type only (one compile per type)
    return model.variant_layer(cfg, i) if cfg.is_mla else 0


def row_attention(row):
    """The attention a streamed layer runs: attn_block on the cache, or with ``row`` (traced int32) on that row of
    it alone, written back in place (the cache is donated): one layer's row is the transient, where a copy of the
    row's every layer (Runner.row_view) took a 2600-token prefill of 2 rows in the GLM-4.5-Air slice's 0.3x box
    50 MB past its budget."""
    if row is None:
        return model.attn_block

    def attend(cfg, lp, x, cache, start, layer, prev_sel, valid_bt):
        part = {k: jax.lax.dynamic_slice_in_dim(v, row, 1, axis=0) for k, v in cache.items()}
        h, part, sel = model.attn_block(cfg, lp, x, part, start, layer, prev_sel, valid_bt)
        return h, {k: jax.lax.dynamic_update_slice_in_dim(v, part[k].astype(v.dtype), row, axis=0)
                   for k, v in cache.items()}, sel
    return attend


class StreamPrograms:
    """fetch=loop's programs, each shared by every layer of its kind (one compile): a layer's two halves around the
    host's fetch (``attn_route``: model.moe_route, ``moe_part``: model.moe_output), dense layers, the head, and
    the splits of the experts' half that --overlap and a union beyond one fetch use (per-(t, k) terms merged, then
    combined in routing order: bitwise ``moe_part``'s output)."""

    def __init__(self, cfg, plugin=None):
        self.cfg = cfg
        self.plugin = plugin or model.identity_plugin
        self.want_stats = plugin is not None
        self.embed = jax.jit(model.embed)
        self.dense = jax.jit(self._dense, static_argnums=(0,), donate_argnums=(3,))
        self.attn_route = jax.jit(self._attn_route, static_argnums=(0,), donate_argnums=(3,))
        self.moe_part = jax.jit(self._moe_part, static_argnums=(0,))
        self.moe_early = jax.jit(self._moe_early, static_argnums=(0,))
        self.moe_late = jax.jit(self._moe_late, static_argnums=(0,))
        self.terms_merge = jax.jit(self._terms_merge, static_argnums=(0,))
        self.combine_finish = jax.jit(self._combine_finish)
        self.head = jax.jit(self._head)

    def jitted(self) -> list:
        """Every program above (their compiled variants: ``_cache_size``)."""
        return [self.embed, self.dense, self.attn_route, self.moe_part, self.moe_early, self.moe_late,
                self.terms_merge, self.combine_finish, self.head]

    def _dense(self, layer, lp, x, cache, start, prev_sel, valid_bt, row=None):
        return model.dense_layer(self.cfg, lp, x, cache, start, layer, prev_sel, valid_bt, row_attention(row))

    def _attn_route(self, layer, lp, x, cache, start, prev_sel, valid_bt, resident, next_router, layer_id,
                    row=None):
        """``layer`` (static) picks the compiled variant (_layer_key); ``layer_id`` (traced) is the true index the
        plugins see; ``next_router``: the next MoE layer's router, run on this layer's post-attention state (its
        experts predicted for --prefetch)."""
        cfg = self.cfg
        B, T, H = x.shape
        h, hn, cache, sel, before, after = model.moe_route(cfg, lp, x, cache, start, layer, prev_sel, valid_bt,
                                                       resident, self.plugin, layer_id, row_attention(row))
        predicted = None
        if next_router is not None:
            predicted = model.route(cfg, next_router, hn.reshape(B * T, H), valid_bt.reshape(B * T), resident).ids
        summary = _routing_summary([(before, after)], self.want_stats)
        return h, hn, cache, sel, after.ids, after.weights, after.valid, predicted, summary

    @staticmethod
    def _moe_part(rows, mp, h, hn, ids, w, valid, bank, slot_of):
        """The seam + shared expert: the layer's output."""
        return model.moe_output(mp, h, hn, ids, w, valid, bank, slot_of, rows)

    @staticmethod
    def _moe_early(rows, mp, hn, ids, hit, bank, slot_of):
        """--overlap, dispatched once the misses' reads are issued (store.fetch's ``during``): the resident (hit)
        experts' per-(t, k) terms and the shared expert.  Its work is native kernels, so XLA:CPU deems it cheap
        (< 1000 flops) and runs it inline on the calling thread: dispatched before the reads, it ran before them."""
        B, T, H = hn.shape
        r = B * T if rows is None else rows
        flat = hn.reshape(B * T, H)[:r]
        return model.moe_terms(flat, ids[:r], hit[:r], bank, slot_of), model.mlp(mp["shared"], hn)

    @staticmethod
    def _moe_late(rows, h, hn, ids, w, valid, hit, y_hit, shared, bank, slot_of):
        """--overlap, after the misses are read: the terms of those not computed yet (``hit``: the entries computed
        already, the early ones and terms_merge's), merged per (t, k) and combined in the same order as moe_part --
        bitwise the same output whatever the split was."""
        B, T, H = h.shape
        r = B * T if rows is None else rows
        flat = hn.reshape(B * T, H)
        y = jnp.where(hit[:r, :, None], y_hit, model.moe_terms(flat[:r], ids[:r], valid[:r] & ~hit[:r], bank, slot_of))
        part = model.moe_combine(y, w[:r], valid[:r]).astype(flat.dtype)
        return h + model.real_rows(part, flat, rows).reshape(B, T, H) + shared

    @staticmethod
    def _terms_merge(rows, y, hn, ids, m, bank, slot_of):
        """The per-(t, k) terms of the entries ``m`` merged into ``y`` (the first ``rows`` positions, as moe_early's):
        a chunk of a large union (prefill), or --overlap's group of the misses whose reads have landed while later
        ones are still being read (store.fetch's ``landed``)."""
        B, T, H = hn.shape
        r = B * T if rows is None else rows
        terms = model.moe_terms(hn.reshape(B * T, H)[:r], ids[:r], m[:r], bank, slot_of)
        return jnp.where(m[:r, :, None], terms, y)

    @staticmethod
    def _combine_finish(mp, h, hn, y, w, valid):
        """After the last chunk: the terms summed in routing order + the shared expert."""
        routed = model.moe_combine(y, w, valid).astype(h.dtype).reshape(h.shape)
        return model.moe_finish(mp, h, hn, routed, valid.any(-1).reshape(h.shape[:2]))

    def _head(self, norm, lm_head, x, rows):
        hidden = model.rms_norm(x, norm, self.cfg.rms_norm_eps)
        return model.head_logits(hidden, lm_head, rows), hidden


def _acc(engine, key, v):
    engine._route_acc[key] = engine._route_acc.get(key, 0.0) + float(v)


def _chunked_moe(engine, programs, layer, mp, h, hn, ids, ids_np, w, valid, union):
    """A union larger than one fetch can hold (a prefill within a small RAM budget): fetch it in chunks of
    ``store.call_limit`` experts; each chunk's per-(t, k) terms are computed and merged before the next fetch (which
    may reuse its slots, so each chunk is waited for), then summed in routing order with the shared expert.  Peak
    memory stays at one chunk; every entry's term is the one the unchunked seam computes."""
    store = engine.store
    lim = store.call_limit(layer)
    y = jnp.zeros(ids.shape + (h.shape[-1],), jnp.float32)
    for c0 in range(0, len(union), lim):
        part = union[c0:c0 + lim]
        bank, slot_of = store.fetch(layer, part)
        m = valid & jnp.asarray(np.isin(ids_np, part))
        y = programs.terms_merge(None, y, hn, ids, m, bank, jnp.asarray(slot_of))
        y.block_until_ready()
    _acc(engine, "chunked_unions", 1)
    return programs.combine_finish(mp, h, hn, y, w, valid)


class _OverlapSplit:
    """--overlap: a MoE layer's hits (+ the shared expert) dispatched once the misses' reads are issued (store.fetch's
    ``during``: they run beside the reads), then each group of the misses that has landed while later ones are still
    being read (``landed``); ``moe_late`` computes the rest and combines every term in routing order."""

    def __init__(self, programs, rows, moe_params, hn, ids, ids_np, valid_np, hit, bank, slot_of):
        self.programs, self.rows, self.moe_params, self.hn, self.ids = programs, rows, moe_params, hn, ids
        self.ids_np, self.valid_np, self.hit, self.bank, self.slot_of = ids_np, valid_np, hit, bank, slot_of
        self.started = False
        self.done = self.terms = self.shared = None

    def during(self):
        self.started = True
        self.done = self.hit
        self.terms, self.shared = self.programs.moe_early(self.rows, self.moe_params, self.hn, self.ids, self.hit,
                                                          self.bank, self.slot_of)

    def landed(self, experts, bank, slot_of):
        m = self.valid_np & np.isin(self.ids_np, experts)
        self.done = self.done | m
        self.terms = self.programs.terms_merge(self.rows, self.terms, self.hn, self.ids, m, bank, slot_of)


class _LoopForward:
    """One fetch=loop forward's host side across its MoE layers: the routing read back, the store's fetch, the
    route trace, the next layer's predicted experts (--prefetch), the hit/miss split (--overlap)."""

    def __init__(self, engine, programs, B: int, T: int, lengths, positions_valid):
        self.engine, self.programs, self.store = engine, programs, engine.store
        self.n_real = int(np.max(np.asarray(lengths)))
        self.short = B == 1 and T <= 16 and self.n_real < T    # a padded decode / verify: the real rows' experts
        self.positions = B * T
        self.positions_valid = positions_valid
        self.trace = [] if engine.backend.route_trace else None
        self.predicted = None
        # the hit/miss split in one process only: with several, each one's store holds and reads its own shard, so
        # the split would be each process's own, and every process must run the same programs for their
        # collectives to pair up
        self.overlap = engine.backend.overlap and jax.process_count() == 1

    def moe_layer(self, i, lp, h, hn, ids, w, valid, predicted, summary, next_layer):
        """MoE layer ``i`` after its first program: its union fetched, then its second program.  Returns its output."""
        engine, store, programs = self.engine, self.store, self.programs
        ids_np, valid_np = np.asarray(ids), np.asarray(valid)       # the one host sync per MoE layer
        union = np.unique(ids_np[valid_np])
        if self.predicted is not None:
            _acc(engine, "prefetch_recall_hits", len(np.intersect1d(self.predicted, union)))
            _acc(engine, "prefetch_recall_total", len(union))
            self.predicted = None
        if len(union) > store.call_limit(i):
            self._count(i, union, summary)
            return _chunked_moe(engine, programs, i, lp["moe"], h, hn, ids, ids_np, w, valid, union)
        entries = (self.n_real if self.short else self.positions) * ids_np.shape[-1]   # the (t, k) pairs computed
        rows = self.n_real if self.short and entries <= store._layer(i).S else None
        split = self._split(i, lp, hn, ids, ids_np, valid_np, union, rows, entries)
        bank, slot_of = store.fetch(i, union, during=split and split.during, landed=split and split.landed)
        if self.trace is not None:
            self.trace.append([i, union.tolist()])
        if predicted is not None:
            self.predicted = np.unique(np.asarray(predicted)[self.positions_valid.reshape(-1)])
            store.prefetch(next_layer, self.predicted)      # background loads while this layer computes
        self._count(None, union, summary)
        if split is None or not split.started:
            return programs.moe_part(rows, lp["moe"], h, hn, ids, w, valid, bank, slot_of)
        return programs.moe_late(rows, h, hn, ids, w, valid, split.done, split.terms, split.shared, bank, slot_of)

    def _count(self, traced_layer, union, summary):
        if traced_layer is not None and self.trace is not None:
            self.trace.append([traced_layer, union.tolist()])
        _acc(self.engine, "union_experts", len(union))
        _acc(self.engine, "moe_layer_forwards", 1)
        self.engine._accumulate(summary)

    def _split(self, i, lp, hn, ids, ids_np, valid_np, union, rows, entries):
        """--overlap's split of layer ``i``, where it applies: the XLA gather path reads only its slots; the native
        kernel computes any pairs, its per-(t, k) terms kept to decode-sized forwards (a 512-token chunk's would be
        64 MB at H 4096); a layer with a miss and a hit (or several misses)."""
        store = self.store
        if not self.overlap or not (entries <= store._layer(i).S or (
                store._layer(i).bank.kernel == "native" and entries <= OVERLAP_MAX_PAIRS)):
            return None
        resident_now = store.resident_mask(i)
        resident = resident_now[union]
        if resident.all() or not (resident.any() or len(union) > 1):
            return None
        bank, slot_of = store.peek(i)
        return _OverlapSplit(self.programs, rows, lp["moe"], hn, ids, ids_np, valid_np,
                             valid_np & resident_now[ids_np], bank, slot_of)


def loop_step(engine, tokens, start, lengths, logit_rows=None, row=None):
    """fetch=loop's forward: per MoE layer, the first program (attention -> router -> plugins), the routing read
    back, ``store.fetch`` of its union, the second program (experts -> shared expert); dense layers one program each.
    Returns (logits, hidden, cache).  ``row``: tokens [1, T] on that row of the batch cache, each layer's read and
    written in place."""
    # the host's arrays go to the programs as numpy arrays (the call transfers them): a jnp.asarray / jnp op here
    # is an eager dispatch of its own: ~9% of a 0.3x-box token (py-spy)
    row_index = None if row is None else np.int32(row)
    cfg, params = engine.cfg, engine.params
    programs = engine.backend.programs
    B, T = tokens.shape
    valid_bt = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    x = programs.embed({"embed": params["embed"], "norm": params["norm"]}, tokens)
    cache = engine._cache
    forward = _LoopForward(engine, programs, B, T, lengths, valid_bt)
    sel = None
    layers = params["layers"]
    moe_idx = [i for i, lp in enumerate(layers) if "moe" in lp]
    for i, lp in enumerate(layers):
        k = _layer_key(cfg, i)
        if "moe" not in lp:
            x, cache[i], sel = programs.dense(k, lp, x, cache[i], start, sel, valid_bt, row_index)
            continue
        later = [j for j in moe_idx if j > i]
        next_layer = later[0] if engine.backend.prefetch and later else None
        next_router = None if next_layer is None else layers[next_layer]["moe"]
        h, hn, cache[i], sel, ids, w, valid, predicted, summary = programs.attn_route(
            k, lp, x, cache[i], start, sel, valid_bt, engine.resident_for(i), next_router, np.int32(i), row_index)
        x = forward.moe_layer(i, lp, h, hn, ids, w, valid, predicted, summary, next_layer)
    logits, hidden = programs.head(params["norm"], params["lm_head"], x,
                                   valid_bt if logit_rows is None else logit_rows)
    if forward.trace:
        write_route_trace(engine, forward.trace)
    return logits, hidden, cache


def write_route_trace(engine, trace: list):
    """Append one forward's routing to --route_trace (fileio.append_output).  A failed write (a full disk, a FIFO
    nobody reads) is one warning line, the trace is then off for this engine, and the generation goes on."""
    path = engine.backend.route_trace
    if engine.backend.trace_off:
        return
    try:
        fileio.append_output(path, json.dumps(trace) + "\n")
    except OSError as e:
        engine.backend.trace_off = True
        print(f"glm-jax: warning: --route_trace={path}: cannot write ({e.strerror or e}); the routing trace is "
              "off for the rest of this run", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the MTP layer, streamed
def mtp_stream(engine, tokens, hidden, start, lengths, own_head: bool = False):
    """model.mtp_forward with the MTP layer's routed experts from the store (layer index num_hidden_layers), in the
    loop style: jit(input + attention + router + plugins) -> host union -> store.fetch -> jit(seam + shared) ->
    jit(shared_head).  Uses and updates the engine's MTP cache entry.  Returns (logits [B,T,V], hn [B,T,H])."""
    cfg, params, store = engine.cfg, engine.params, engine.store
    programs = engine.backend.programs
    L = cfg.num_hidden_layers
    key = ("mtp_io", own_head)
    io = engine._jits.get(key)
    if io is None:
        io = engine._jits[key] = (jax.jit(functools.partial(model.mtp_input, cfg, own_embed=own_head)),
                                  jax.jit(functools.partial(model.mtp_output, cfg, own_head=own_head)))
    B, T = tokens.shape
    valid_bt = jnp.arange(T)[None, :] < lengths[:, None]
    u = io[0](params, tokens, hidden)
    lp = params["mtp"]["layer"]
    cache = engine._cache
    h, hn, cache[L], _, ids, w, valid, _, summ = programs.attn_route(
        _layer_key(cfg, L), lp, u, cache[L], start, None, valid_bt, jnp.asarray(engine.resident_for(L)), None,
        np.int32(L))
    engine._check_routing(summ)
    ids_np = np.asarray(ids)
    union = np.unique(ids_np[np.asarray(valid)])
    _acc(engine, "mtp_union_experts", len(union))
    if len(union) > store.call_limit(L):
        g = _chunked_moe(engine, programs, L, lp["moe"], h, hn, ids, ids_np, w, valid, union)
    else:
        bank, slot_of = store.fetch(L, union)
        g = programs.moe_part(None, lp["moe"], h, hn, ids, w, valid, bank, jnp.asarray(slot_of))
    return io[1](params, g)


# ----------------------------------------------------------------------------- callback mode
def callback_step(engine, tokens, start, lengths, logit_rows=None):
    cfg = engine.cfg
    B, T = tokens.shape
    n_real = int(np.max(np.asarray(lengths)))
    # a padded decode / verify: routed experts (and the fetched buffer) for the real rows only, as fetch=loop does
    rows = n_real if (B == 1 and T <= 16 and n_real < T) else None
    key = ("cb_step", B, T, engine._cache_len, rows)
    fn = engine._jits.get(key)
    if fn is None:
        fn = engine._jits[key] = _build_callback_step(engine, B * T, rows)
    resident = jnp.asarray(np.stack([engine.resident_for(i) for i in cfg.moe_layers]))
    logits, hidden, engine._cache, summ, unions = fn(engine.params, engine._cache, tokens, start, lengths, resident)
    engine._accumulate(summ)
    _acc(engine, "union_experts", float(np.asarray(unions).sum()))
    _acc(engine, "moe_layer_forwards", len(cfg.moe_layers))
    return logits, hidden, engine._cache


def _build_callback_step(engine, n_pos, rows=None):
    cfg, store = engine.cfg, engine.store
    plugin = engine.plugin or model.identity_plugin
    want_stats = engine.plugin is not None
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    W = min(E, K * (rows if rows is not None else n_pos))
    specs = {}
    for i in cfg.moe_layers:
        arrs = store._layer(i).arrays
        specs[i] = {n: jax.ShapeDtypeStruct((W,) + a.shape[1:], a.dtype) for n, a in arrs.items()}

    def host_fetch(layer, ids, valid):
        ids, valid = np.asarray(ids), np.asarray(valid)
        union = np.unique(ids[valid])
        arrs = store._layer(layer).arrays
        out = {n: np.zeros((W,) + a.shape[1:], a.dtype) for n, a in arrs.items()}
        lim = store.call_limit(layer)      # a union beyond the store's slots (a prefill): fetched chunk by chunk,
        for c0 in range(0, len(union), lim):   # each copied into the compact buffer before the next fetch
            part = union[c0:c0 + lim]
            _, slot_of = store.fetch(layer, part)
            for n, a in arrs.items():
                out[n][c0:c0 + len(part)] = a[slot_of[part]]
        compact = np.full(E, -1, np.int32)
        compact[union] = np.arange(len(union), dtype=np.int32)
        return out, compact, np.int32(len(union))

    class HostExperts(model.ExpertSource):
        """Each MoE layer's experts from the store through an ordered io_callback (host_fetch): a compact bank of
        the union's experts, gathered on the host."""

        def __init__(self, resident):
            self.masks, self.unions = resident, []

        def resident(self, mi):
            return self.masks[mi]

        def experts(self, mi, lp, hn, after, valid_bt):
            layer = cfg.moe_layers[mi]
            r = hn.shape[0] * hn.shape[1] if rows is None else rows
            shapes = (specs[layer], jax.ShapeDtypeStruct((E,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
            arrs, slot_of, n_union = io_callback(functools.partial(host_fetch, layer), shapes, after.ids[:r],
                                                 after.valid[:r], ordered=True)
            self.unions.append(n_union)
            b0 = store._layer(layer).bank
            bank = ExpertBank(arrs["gate_up"], arrs["down"], arrs.get("gate_up_scale"), arrs.get("down_scale"),
                              fmt=store._layer(layer).layout.fmt, kernel=b0.kernel, layout=b0.layout,
                              hidden=b0.hidden, inter=b0.inter)
            return bank, slot_of, rows      # the real rows: the same gather-path products as fetch=loop's

    def f(params, cache, tokens, start, lengths, resident):
        T = tokens.shape[1]
        valid_bt = jnp.arange(T)[None, :] < lengths[:, None]
        x = model.embed(params, tokens)
        experts = HostExperts(resident)
        sel = None
        new_cache = list(cache)
        summs = []
        for i, lp in enumerate(params["layers"]):
            x, new_cache[i], sel, r = model.layer_forward(cfg, lp, x, cache[i], start, i, sel, valid_bt, experts,
                                                          plugin, len(summs))
            if r is not None:
                summs.append(r)
        hidden = model.rms_norm(x, params["norm"], cfg.rms_norm_eps)
        return (model.head(params, hidden), hidden, new_cache, _routing_summary(summs, want_stats),
                jnp.stack(experts.unions))

    return jax.jit(f, donate_argnums=(1,))


# ----------------------------------------------------------------------------- fused mode
# One compiled program per forward (and, in the scheduler, per up-to-32-step decode dispatch), with the store's
# slot arenas as jit ARGUMENTS.  On XLA:CPU those arrays alias the arenas (store.aliased), so nothing is copied:
# the seam reads the arena where it is.
#
# Per MoE layer the program checks on the device whether every expert the layer routes to is in the store (its
# current slot map, carried in the program).  If so the layer runs with no host call at all; otherwise an ordered
# io_callback runs ``store.fetch`` (the misses are read straight into the arena) and returns the call's slot map,
# the store's slot map after it (evictions) and what the plugins see as resident in that layer.  The store's
# bookkeeping of the layers that skipped the call (LRU order, hit counters, usage, route trace) is replayed, in
# order, as the same ``store.fetch`` calls (all hits: no reads) before the next real fetch and at the end of the
# program: every fetch sees the store as fetch=loop would, so the bytes read, evictions and counters are the
# loop's.  Membership changes only inside fetch (prefetch: every layer calls the host), so a carried mask is the
# one the loop would read.  ``optimization_barrier`` ties each bank to its layer's slot map, so nothing that reads
# the bank (a kernel, a layout change, a loop-invariant computation hoisted out of the decode loop) can run before
# that layer's fetch.  The ops are the loop's, one for one (attn_route + moe_part): the outputs are bitwise
# fetch=loop's.

FUSED_MAX_T = 16     # forwards of fewer positions per row run fused: decode and verify (a prefill is padded to >= 16)


def fused_applies(engine, B: int, T: int, lengths) -> bool:
    """Whether a forward of tokens [B, T] runs as one fused program (else the loop's path): a decode or verify
    (T < FUSED_MAX_T) and the union of every MoE layer fits one fetch (--overlap is the loop's alone).  A prefill
    runs the loop's way: its round trip per layer is shared by all its tokens, a union beyond one fetch is fetched
    in chunks there, and its logits stay bitwise the loop's (a 16-token prefill compiled as one program differed
    from the loop's in the last bits on the 333 M model: XLA fuses the larger program's dense ops differently).  (A
    store whose banks do not alias its arenas runs --fetch=fused as the callback program.)"""
    store, cfg = engine.store, engine.cfg
    if T >= FUSED_MAX_T:
        return False
    n_pos = B * T if engine.plugin is not None else int(np.minimum(np.asarray(lengths), T).sum())
    need = min(cfg.n_routed_experts, cfg.num_experts_per_tok * n_pos)
    return all(need <= store.call_limit(i) for i in _moe_idx(cfg))


class ReplayLog:
    """fetch=fused's host side of a program's store calls: the next MoE layer's predicted experts (--prefetch's
    recall, by layer), the route trace lines of the layers so far, and how many of the program's store calls are
    done (``fused_replay`` replays the skipped ones up to the next real one)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.predicted, self.trace, self.next = {}, [], 0


def _moe_idx(cfg) -> list:
    return [i for i in cfg.moe_layers if i < cfg.num_hidden_layers]


def fused_banks(engine) -> list:
    """The MoE layers' banks (aliasing the store's slot arenas), in layer order: the fused program's arguments."""
    return [engine.store._layer(i).bank for i in _moe_idx(engine.cfg)]


def fused_state(engine, steps: int, B: int, T: int) -> dict:
    """The store's state a fused program starts from (its current slot maps, what the plugins see as resident) and
    the routing log of its MoE layers ([steps, n_moe, B*T, K]); resets the host side of the replay."""
    cfg, store = engine.cfg, engine.store
    idx = _moe_idx(cfg)
    K = cfg.num_experts_per_tok
    engine.backend.replay.reset()
    # numpy, handed to the program as its arguments (jnp ops here were ~1.2 ms of small programs per dispatch)
    return dict(cur=np.stack([store._layer(i).slot_of for i in idx]).astype(np.int32),
                res=np.stack([engine.resident_for(i) for i in idx]).reshape(len(idx), cfg.n_routed_experts),
                step=np.int32(0), miss=np.bool_(False),
                log_ids=np.zeros((steps, len(idx), B * T, K), np.int32),
                log_valid=np.zeros((steps, len(idx), B * T, K), np.bool_))


def _fused_access(engine, layer: int, last: bool, ids, valid):
    """One MoE layer's store call, as fetch=loop makes it: the union, the fetch, the trace, the counters."""
    union = np.unique(ids[valid])
    replay = engine.backend.replay
    pend = replay.predicted.pop(layer, None)
    if pend is not None:
        _acc(engine, "prefetch_recall_hits", len(np.intersect1d(pend, union)))
        _acc(engine, "prefetch_recall_total", len(union))
    _, slot_of = engine.store.fetch(layer, union)
    if engine.backend.route_trace:
        replay.trace.append([layer, union.tolist()])
        if last:
            tr, replay.trace = replay.trace, []
            write_route_trace(engine, tr)
    _acc(engine, "union_experts", len(union))
    _acc(engine, "moe_layer_forwards", 1)
    return slot_of


def fused_replay(engine, log_ids, log_valid, upto: int):
    """The store calls of the layers that skipped the host (every expert resident), in order, up to linear index
    ``upto`` (step * n_moe + layer) exclusive: all hits (no reads), so the LRU order, counters and usage are the
    loop's when the next real fetch runs.  One ``store.replay_hits`` per layer where it applies (no route trace, no
    prefetch recall pending), else one ``store.fetch`` per call."""
    idx = _moe_idx(engine.cfg)
    n = len(idx)
    q = engine.backend.replay.next
    if q >= upto:
        return
    log_ids, log_valid = np.asarray(log_ids), np.asarray(log_valid)
    store = engine.store
    if engine.backend.route_trace or engine.backend.replay.predicted or not hasattr(store, "replay_hits"):
        for j in range(q, upto):
            s, mi = divmod(j, n)
            _fused_access(engine, idx[mi], mi == n - 1, log_ids[s, mi], log_valid[s, mi])
        engine.backend.replay.next = upto
        return
    # one bulk call per layer (each layer's bookkeeping is its own, the counters are sums): a dispatch of 32 steps
    # of a 3-MoE-layer model made 96 fetch calls here, ~2.4 ms between two dispatches on b
    E = engine.cfg.n_routed_experts
    js = np.arange(q, upto)
    a = np.where(log_valid, log_ids, E).reshape(log_ids.shape[0] * n, -1)[js]     # each call's ids, E = invalid
    a.sort(axis=1)
    first = (a < E) & np.concatenate([np.ones((len(js), 1), bool), a[:, 1:] != a[:, :-1]], axis=1)
    per: dict = {}
    for j, row, keep in zip(js.tolist(), a, first):
        per.setdefault(j % n, []).append(row[keep])                  # np.unique(ids[valid]), sorted
    for mi, unions in per.items():
        if store.replay_hits(idx[mi], unions):
            _acc(engine, "union_experts", sum(len(u) for u in unions))
            _acc(engine, "moe_layer_forwards", len(unions))
        else:
            for u in unions:
                _fused_access(engine, idx[mi], mi == n - 1, u, np.ones(len(u), bool))
    engine.backend.replay.next = upto


def _fused_host(engine, mi: int, nxt, step, ids, valid, log_ids, log_valid, pred=None, valid_pos=None):
    """The ordered callback of MoE layer ``mi`` (index among the MoE layers) at ``step``: first the skipped layers'
    calls before it (fused_replay), then the loop's work between its two jits (fetch, trace, prefetch of the next
    layer, counters).  Returns (the call's slot map [E], the store's slot map after it [E], this layer's resident
    mask after it [E], the next layer's resident mask [E] (after its prefetch))."""
    idx = _moe_idx(engine.cfg)
    layer = idx[mi]
    q = int(step) * len(idx) + mi
    fused_replay(engine, log_ids, log_valid, q)
    slot_of = _fused_access(engine, layer, mi == len(idx) - 1, np.asarray(ids), np.asarray(valid))
    engine.backend.replay.next = q + 1
    res = np.asarray(engine.resident_for(layer), bool)
    nres = res
    if pred is not None:
        pn = np.unique(np.asarray(pred)[np.asarray(valid_pos)])
        engine.backend.replay.predicted[nxt] = pn
        engine.store.prefetch(nxt, pn)                     # background loads while this layer computes
        nres = np.asarray(engine.resident_for(nxt), bool)
    return np.asarray(slot_of, np.int32), np.asarray(engine.store._layer(layer).slot_of, np.int32), res, nres


def fused_forward(engine, B: int, T: int, short_rows=None, optimistic: bool = False):
    """The traceable streamed forward of tokens [B, T] (fetch=loop's ops, one program):
    ``f(params, banks, cache, tokens, start, lengths, state, logit_rows=None)`` -> (logits, hidden, cache, routing
    summary, state) with ``state`` from ``fused_state`` (carried from step to step by a decode loop).
    ``short_rows``: the real rows of a padded decode / verify (fetch=loop's ``rows``).
    ``optimistic`` (no --prefetch): no host call at all -- a layer with an expert not in the cache sets
    ``state["miss"]`` instead, and the forward's results are then garbage the caller must discard (the decode loop
    rolls the step back and stops; its K/V writes at the step's positions are rewritten when the step runs again).
    Holding no host callback, the program is dispatched through JAX's C++ path (a program with one paid ~4-7 ms
    per dispatch on b) and can be kept in the persistent compile cache."""
    cfg, store = engine.cfg, engine.store
    plugin = engine.plugin or model.identity_plugin
    want_stats = engine.plugin is not None
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    moe_idx = _moe_idx(cfg)
    prefetch = engine.backend.prefetch
    shapes = (jax.ShapeDtypeStruct((E,), jnp.int32), jax.ShapeDtypeStruct((E,), jnp.int32),
              jax.ShapeDtypeStruct((E,), jnp.bool_), jax.ShapeDtypeStruct((E,), jnp.bool_))
    slots = {i: store._layer(i).S for i in moe_idx}

    class StoreExperts(model.ExpertSource):
        """Each MoE layer's experts from the store's arenas (the program's ``banks``), the store called from inside
        the program only for a layer with a miss (or every layer with --prefetch); carries the store's state
        (slot maps, resident masks, the routing log) through the program."""

        def __init__(self, banks, layers, st):
            self.banks, self.layers = banks, layers
            self.st = dict(st)

        def resident(self, mi):
            return self.st["res"][mi]

        def experts(self, mi, lp, hn, after, valid_bt):
            st = self.st
            cur, resm, step = st["cur"], st["res"], st["step"]
            ids, valid = after.ids, after.valid
            st["log_ids"] = st["log_ids"].at[step, mi].set(ids)
            st["log_valid"] = st["log_valid"].at[step, mi].set(valid)
            nxt = moe_idx[mi + 1] if mi + 1 < len(moe_idx) else None
            args = (step, ids, valid, st["log_ids"], st["log_valid"])
            if prefetch and nxt is not None:
                pred = model.route(cfg, self.layers[nxt]["moe"], hn.reshape(B * T, -1), valid_bt.reshape(B * T),
                               resm[mi]).ids
                args += (pred, valid_bt.reshape(-1))
            host = functools.partial(_fused_host, engine, mi, nxt)
            call = lambda: io_callback(host, shapes, *args, ordered=True)     # noqa: E731
            hit = lambda: (cur[mi], cur[mi], resm[mi], resm[mi])               # noqa: E731
            if prefetch:        # the host computes recall and starts the next layer's loads at every layer
                got = call()
            else:               # every routed expert resident: no host call (its bookkeeping is replayed)
                have = jnp.all(jnp.where(valid, cur[mi][jnp.clip(ids, 0, E - 1)] >= 0, True))
                if optimistic:  # a missing expert's slot is -1: the kernels skip it, the step is discarded
                    st["miss"], got = st["miss"] | ~have, hit()
                else:
                    got = jax.lax.cond(have, hit, call)
            slot_of, now, mres, nres = got
            st["cur"] = cur.at[mi].set(now)
            st["res"] = resm = resm.at[mi].set(mres)
            if prefetch and nxt is not None:           # the next layer's mask after this layer's prefetch
                st["res"] = resm.at[mi + 1].set(nres)
            # the bank is read only after this layer's fetch: every use of it depends on slot_of
            slot_of, bank = jax.lax.optimization_barrier((slot_of, self.banks[mi]))
            rows = short_rows if short_rows is not None and B * T * K <= slots[moe_idx[mi]] else None
            return bank, slot_of, rows

    def f(params, banks, cache, tokens, start, lengths, st, logit_rows=None):
        valid_bt = jnp.arange(T)[None, :] < lengths[:, None]
        x = model.embed({"embed": params["embed"], "norm": params["norm"]}, tokens)
        cache = list(cache)
        experts = StoreExperts(banks, params["layers"], st)
        sel, summs = None, []
        for i, lp in enumerate(params["layers"]):
            x, cache[i], sel, r = model.layer_forward(cfg, lp, x, cache[i], start, _layer_key(cfg, i), sel,
                                                      valid_bt, experts, plugin, len(summs), jnp.int32(i))
            if r is not None:
                summs.append(r)
        hidden = model.rms_norm(x, params["norm"], cfg.rms_norm_eps)
        logits = model.head_logits(hidden, params["lm_head"], valid_bt if logit_rows is None else logit_rows)
        st = dict(experts.st, step=experts.st["step"] + 1)
        return logits, hidden, cache, _routing_summary(summs, want_stats), st

    return f


def fused_finish(engine, st, steps: int):
    """After a fused program: the skipped layers' store calls of its ``steps`` steps not replayed yet."""
    fused_replay(engine, st["log_ids"], st["log_valid"], steps * len(_moe_idx(engine.cfg)))


def fused_step(engine, tokens, start, lengths, logit_rows=None):
    B, T = tokens.shape
    n_real = int(np.max(np.asarray(lengths)))
    short = n_real if (B == 1 and T <= 16 and n_real < T) else None
    key = ("fused_step", B, T, engine._cache_len, short, logit_rows is None, engine.backend.prefetch)
    fn = engine._jits.get(key)
    if fn is None:
        fn = engine._jits[key] = jax.jit(fused_forward(engine, B, T, short), donate_argnums=(2,))
    logits, hidden, engine._cache, summ, st = fn(engine.params, fused_banks(engine), engine._cache, tokens, start,
                                                 lengths, fused_state(engine, 1, B, T), logit_rows)
    fused_finish(engine, st, 1)
    engine._accumulate(summ)
    return logits, hidden, engine._cache


# ----------------------------------------------------------------------------- a long prompt, layer by layer
SEGMENT_MOE_TOKENS = 512     # a segment's routed experts run over at most this many positions a call (llama.cpp's -ub)
SEGMENT_PAIR_CAP = 2         # ... at most this many (t, k) pairs a position a call: the kernel's scratch (rows split)


def segment_bytes(cfg, tokens: int, width: int, dtype_bytes: int = 4) -> int:
    """What ``segment_steps`` holds through a segment of ``tokens`` positions: the layer's input / output and its
    normed copy (two [S, H] buffers, S padded to the MoE calls' ``width``) and the routing of every position."""
    S = -(-int(tokens) // int(width)) * int(width)
    return 2 * S * cfg.hidden_size * dtype_bytes + S * cfg.num_experts_per_tok * 9


def moe_call_bytes(cfg, width: int) -> int:
    """One of a segment's MoE calls beside that: glmjax_moe's scratch ([pairs, 2I + I + H] f32 at SEGMENT_PAIR_CAP
    pairs a position) and XLA's [width, H] f32 output and sum."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    return int(width) * (SEGMENT_PAIR_CAP * (3 * I + H) * 4 + 3 * H * 4)


def segment_width(cfg, chunk: int, room: Optional[int] = None) -> int:
    """Positions a segment's MoE call covers: ``chunk`` x a power of two, up to SEGMENT_MOE_TOKENS, and where
    ``room`` is given no more than its moe_call_bytes fit (at least one chunk).  Each call streams its experts'
    weights from RAM once, so wider is faster where memory allows."""
    c = max(1, int(chunk))
    w = c
    while 2 * w <= SEGMENT_MOE_TOKENS and (room is None or moe_call_bytes(cfg, 2 * w) <= room):
        w *= 2
    return w


def _seg_fns(engine, c: int, G: int):
    key = ("segment", c, G)
    fns = engine._jits.get(key)
    if fns is not None:
        return fns

    @jax.jit
    def take(buf, off):
        return jax.lax.dynamic_slice_in_dim(buf, off, c, axis=0)[None]

    @functools.partial(jax.jit, donate_argnums=(0,))
    def put(buf, x, off):
        return jax.lax.dynamic_update_slice_in_dim(buf, x[0].astype(buf.dtype), off, axis=0)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def shared(acc, hn, real, mp):
        """acc (the attention's output h) + the shared expert of hn, at the real positions."""
        return acc + model.mlp(mp["shared"], hn[None], real)[0].astype(acc.dtype)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def routed(acc, hn, ids, w, m, bank, slot_of):
        """acc + the routed experts ``m`` marks (one round's fetch), every position of the buffer in one call."""
        return acc + model.moe_routed(hn, ids, w, m, bank, slot_of).astype(acc.dtype)

    fns = engine._jits[key] = dict(take=take, put=put, shared=shared, routed=routed)
    return fns


def _pair_splits(m: np.ndarray, cap: int):
    """Row ranges of the mask ``m`` [N, K] whose (t, k) pairs stay <= cap each (a range is at least one row)."""
    per = m.sum(-1)
    total = int(per.sum())
    if total <= cap:                 # (the common case: no walk over the rows)
        return [(0, len(per))] if total else []
    out, r0, acc = [], 0, 0
    for r, p in enumerate(per):
        if acc + p > cap and r > r0:
            out.append((r0, r))
            r0, acc = r, 0
        acc += int(p)
    if acc:
        out.append((r0, len(per)))
    return out


def _round_order(union, ids, m, resident, lim):
    """The order a segment fetches a layer's union in: the experts the last positions route to last (the last round
    stays in the cache for the decode that follows, as a chunk's last experts do), before them the cached ones
    first (none evicted before its round)."""
    if union.size <= lim:
        return union
    flat, mf = ids.reshape(-1, ids.shape[-1]), m.reshape(-1, m.shape[-1])
    last = np.full(int(union.max()) + 1, -1)
    t, k = np.nonzero(mf)
    np.maximum.at(last, flat[t, k], t)
    order = union[np.argsort(last[union], kind="stable")]
    head, tail = order[:-lim], order[-lim:]
    return np.concatenate([head[resident[head]], head[~resident[head]], tail])


class _Segment:
    """One ``segment_steps`` run's state: the segment's positions in blocks of ``chunk`` (attention) and in groups of
    ``width`` (the MoE calls: G blocks a group), the layer's input / output buffers and their normed copies (one per
    group), and the programs (taken afresh after each pause: the caller's step may have dropped them)."""

    def __init__(self, engine, tokens, start: int, chunk: int, width: int, row, slice_s):
        self.engine, self.slice_s = engine, slice_s
        self.chunk = c = int(chunk)
        self.per_group = max(1, int(width) // c)               # blocks a MoE call covers
        n = int(len(tokens))
        self.blocks = -(-n // c)
        self.groups = -(-self.blocks // self.per_group)
        self.width = self.per_group * c
        self.row_index = None if row is None else jnp.int32(row)
        self.starts = [jnp.asarray([start + j * c], jnp.int32) for j in range(self.blocks)]
        self.lens = [min(c, n - j * c) for j in range(self.blocks)]
        self.valid = [jnp.asarray(np.arange(c)[None, :] < self.lens[j]) for j in range(self.blocks)]
        self.sels = [None] * self.blocks
        self.trace = [] if engine.backend.route_trace else None
        self.programs, self.buffers = engine.backend.programs, _seg_fns(engine, c, self.per_group)
        self._embed(tokens)
        self.t_last = time.perf_counter()

    def place(self, j: int):
        """Block j's group and its offset in the group's buffer."""
        return j // self.per_group, np.int32((j % self.per_group) * self.chunk)

    def _embed(self, tokens):
        params, c = self.engine.params, self.chunk
        emb = {"embed": params["embed"], "norm": params["norm"]}
        self.bufs = None
        for j in range(self.blocks):
            toks = np.zeros((1, c), np.int32)
            toks[0, :self.lens[j]] = tokens[j * c:j * c + self.lens[j]]
            x = self.programs.embed(emb, jnp.asarray(toks))
            if self.bufs is None:       # (host zeros: no op-by-op program compiled and kept for these shapes)
                self.bufs = [jnp.asarray(np.zeros((self.width, x.shape[-1]), x.dtype)) for _ in range(self.groups)]
                self.hns = [jnp.asarray(np.zeros((self.width, x.shape[-1]), x.dtype)) for _ in range(self.groups)]
            gi, off = self.place(j)
            self.bufs[gi] = self.buffers["put"](self.bufs[gi], x, off)
        real = [np.zeros((self.width,), bool) for _ in range(self.groups)]
        for j in range(self.blocks):
            gi, off = self.place(j)
            real[gi][off:off + self.lens[j]] = True
        self.real = [jnp.asarray(r.reshape(1, self.width)) for r in real]

    def due(self) -> bool:
        return self.slice_s is not None and time.perf_counter() - self.t_last >= self.slice_s

    def paused(self):
        """After the yield: the caller's step may have dropped / recompiled the programs."""
        self.t_last = time.perf_counter()
        self.programs = self.engine.backend.programs
        self.buffers = _seg_fns(self.engine, self.chunk, self.per_group)

    def dense_layer(self, i: int, lp):
        engine = self.engine
        for j in range(self.blocks):
            gi, off = self.place(j)
            x, engine._cache[i], self.sels[j] = self.programs.dense(
                _layer_key(engine.cfg, i), lp, self.buffers["take"](self.bufs[gi], off), engine._cache[i],
                self.starts[j], self.sels[j], self.valid[j], self.row_index)
            self.bufs[gi] = self.buffers["put"](self.bufs[gi], x, off)
            if self.due():
                jax.block_until_ready(self.bufs)
                yield
                self.paused()

    def route(self, i: int, lp):
        """Layer i's attention and routing, block by block; returns (ids, weights, mask) [groups, width, K]."""
        engine = self.engine
        K = engine.cfg.num_experts_per_tok
        shape = (self.groups, self.width, K)
        ids_np, w_np, m_np = np.zeros(shape, np.int32), np.zeros(shape, np.float32), np.zeros(shape, bool)
        resident = jnp.asarray(engine.resident_for(i))
        for j in range(self.blocks):
            gi, off = self.place(j)
            h, hn, engine._cache[i], self.sels[j], ids, w, valid, _, summary = self.programs.attn_route(
                _layer_key(engine.cfg, i), lp, self.buffers["take"](self.bufs[gi], off), engine._cache[i],
                self.starts[j], self.sels[j], self.valid[j], resident, None, np.int32(i), self.row_index)
            engine._accumulate(summary)
            self.bufs[gi] = self.buffers["put"](self.bufs[gi], h, off)
            self.hns[gi] = self.buffers["put"](self.hns[gi], hn, off)
            ids_np[gi, off:off + self.chunk] = np.asarray(ids)
            m_np[gi, off:off + self.chunk] = np.asarray(valid)
            w_np[gi, off:off + self.chunk] = np.asarray(w, np.float32)
            if self.due():
                jax.block_until_ready((self.bufs, self.hns))
                yield
                self.paused()
                resident = jnp.asarray(engine.resident_for(i))      # (the step may have changed the layer's cache)
        return ids_np, w_np, m_np

    def moe_layer(self, i: int, lp):
        engine, store = self.engine, self.engine.store
        ids_np, w_np, m_np = yield from self.route(i, lp)
        for gi in range(self.groups):
            self.bufs[gi] = self.buffers["shared"](self.bufs[gi], self.hns[gi], self.real[gi], lp["moe"])
        union = np.unique(ids_np[m_np])
        if self.trace is not None:
            self.trace.append([i, union.tolist()])
        _acc(engine, "union_experts", len(union))
        _acc(engine, "moe_layer_forwards", 1)
        _acc(engine, "segment_layers", 1)
        union = _round_order(union, ids_np, m_np, store.resident_mask(i), store.call_limit(i))
        ids_d, w_all = [jnp.asarray(a) for a in ids_np], [jnp.asarray(a) for a in w_np]
        cap = self.width * SEGMENT_PAIR_CAP
        r0 = 0
        while r0 < len(union):
            limit = store.call_limit(i)          # (a step between rounds may have lowered the working set)
            part = union[r0:r0 + limit]
            r0 += len(part)
            bank, slot_of = store.fetch(i, part)
            slot_of = jnp.asarray(slot_of)
            for gi in range(self.groups):
                mg = m_np[gi] & np.isin(ids_np[gi], part)
                for a, b in _pair_splits(mg, cap):
                    mm = np.zeros_like(mg)
                    mm[a:b] = mg[a:b]
                    self.bufs[gi] = self.buffers["routed"](self.bufs[gi], self.hns[gi], ids_d[gi], w_all[gi],
                                                           jnp.asarray(mm), bank, slot_of)
            jax.block_until_ready(self.bufs)           # the next round's fetch may take these slots
            if self.due() and r0 < len(union):
                yield
                self.paused()

    def finish(self):
        """(logits [1, chunk, V] of the last block, the last token's index in it)."""
        params = self.engine.params
        last = self.blocks - 1
        gi, off = self.place(last)
        x = self.buffers["take"](self.bufs[gi], off)
        logit_rows = np.zeros((1, self.chunk), bool)
        logit_rows[0, self.lens[last] - 1] = True
        logits, _ = self.programs.head(params["norm"], params["lm_head"], x, jnp.asarray(logit_rows))
        if self.trace:
            write_route_trace(self.engine, self.trace)
        return logits, self.lens[last] - 1


def segment_steps(engine, tokens: np.ndarray, start: int, chunk: int, width: int, row=None,
                  slice_s: Optional[float] = None):
    """A prompt's ``n`` tokens (positions start..start+n-1) prefilled layer by layer: each layer runs its attention
    over the segment in blocks of ``chunk`` positions (the cache written in order, so a block attends to the ones
    before it), then its routed experts over every position, ``width`` positions a call (segment_width): each expert
    the segment routes to is fetched once a layer (in rounds of ``store.call_limit``), where chunk-by-chunk prefill
    fetches a chunk's misses again for every chunk (a ~1900-token prompt in the GLM-4.5-Air slice's 0.3x box read
    9x its experts).  A round's call is split by rows where its (t, k) pairs pass SEGMENT_PAIR_CAP a
    position (the kernel's scratch).  The routed sum is taken round by round, not in routing order: the chunked
    forward's within rounding.

    A generator: with ``slice_s``, it yields (None) once that many seconds have passed since it last yielded, at a
    point where nothing it dispatched is in flight, so the caller (the scheduler) can run a decode step of its other
    rows meanwhile.  Such a step may fetch into any layer's slots and replace the K/V cache's arrays: every block
    and round therefore takes ``engine._cache`` and the store's slots afresh after a yield (a round fetches its
    experts when it starts).  Its return value (StopIteration's) is (logits [1, chunk, V] of the last block, the
    last token's index in it)."""
    segment = _Segment(engine, tokens, start, chunk, width, row, slice_s)
    layers = engine.params["layers"]
    for i, lp in enumerate(layers):
        if "moe" not in lp:
            yield from segment.dense_layer(i, lp)
            continue
        yield from segment.moe_layer(i, lp)
        if segment.due() and i + 1 < len(layers):
            yield
            segment.paused()
    return segment.finish()

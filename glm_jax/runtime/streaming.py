"""Forward passes whose routed experts come from an ExpertStore (glm_jax/store.py).

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
from .. import model as M
from ..kernels.formats import ExpertBank
from .stats import routing_summary as _routing_summary

OVERLAP_MAX_PAIRS = 512    # --overlap, native kernel: the most (position, k) pairs a forward splits (16 rows' decode)


def _layer_key(cfg, i):
    # GQA layers are interchangeable (one compile); DSA layers differ by indexer type only (one compile per type)
    return M.variant_layer(cfg, i) if cfg.model_type == "glm_moe_dsa" else 0


def row_attention(row):
    """The attention a streamed layer runs: attn_block on the cache, or with ``row`` (traced int32) on that row of
    it alone, written back in place (the cache is donated): one layer's row is the transient, where a copy of the
    row's every layer (Runner.row_view) took a 2600-token prefill of 2 rows in the GLM-4.5-Air slice's 0.3x box
    50 MB past its budget."""
    if row is None:
        return M.attn_block

    def attend(cfg, lp, x, cache, start, layer, prev_sel, valid_bt):
        part = {k: jax.lax.dynamic_slice_in_dim(v, row, 1, axis=0) for k, v in cache.items()}
        h, part, sel = M.attn_block(cfg, lp, x, part, start, layer, prev_sel, valid_bt)
        return h, {k: jax.lax.dynamic_update_slice_in_dim(v, part[k].astype(v.dtype), row, axis=0)
                   for k, v in cache.items()}, sel
    return attend


def _fns(engine):
    fns = getattr(engine, "_stream_fns", None)
    if fns is not None:
        return fns
    cfg = engine.cfg
    plugin = engine.plugin or M.identity_plugin
    want_stats = engine.plugin is not None
    @jax.jit
    def embed(params, tokens):
        return M.embed(params, tokens)

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
    def dense(layer, lp, x, cache, start, prev_sel, valid_bt, row=None):
        return M.dense_layer(cfg, lp, x, cache, start, layer, prev_sel, valid_bt, row_attention(row))

    @functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
    def attn_route(layer, lp, x, cache, start, prev_sel, valid_bt, resident, next_router, layer_id, row=None):
        """``layer`` (static) picks the compiled variant (_layer_key); ``layer_id`` (traced) is the true index the
        plugins see."""
        B, T, H = x.shape
        h, hn, cache, sel, before, after = M.moe_route(cfg, lp, x, cache, start, layer, prev_sel, valid_bt,
                                                       resident, plugin, layer_id, row_attention(row))
        pred = None
        if next_router is not None:   # router lookahead: layer L+1's router on layer L's post-attention state
            pred = M.route(cfg, next_router, hn.reshape(B * T, H), valid_bt.reshape(B * T), resident).ids
        summ = _routing_summary([(before, after)], want_stats)
        return h, hn, cache, sel, after.ids, after.weights, after.valid, pred, summ

    @functools.partial(jax.jit, static_argnums=(0,))
    def moe_part(rows, mp, h, hn, ids, w, valid, bank, slot_of):
        """The seam + shared expert: the layer's output."""
        return M.moe_output(mp, h, hn, ids, w, valid, bank, slot_of, rows)

    @functools.partial(jax.jit, static_argnums=(0,))
    def moe_early(rows, mp, hn, ids, hit, bank, slot_of):
        """--overlap, dispatched once the misses' reads are issued (store.fetch's ``during``): the resident (hit)
        experts' per-(t, k) terms and the shared expert.  Its work is native kernels, so XLA:CPU deems it cheap
        (< 1000 flops) and runs it inline on the calling thread: dispatched before the reads, it ran before them."""
        B, T, H = hn.shape
        r = B * T if rows is None else rows
        flat = hn.reshape(B * T, H)[:r]
        return M.moe_terms(flat, ids[:r], hit[:r], bank, slot_of), M.mlp(mp["shared"], hn)

    @functools.partial(jax.jit, static_argnums=(0,))
    def moe_late(rows, h, hn, ids, w, valid, hit, y_hit, shared, bank, slot_of):
        """--overlap, after the misses are read: the terms of those not computed yet (``hit``: the entries computed
        already, the early ones and terms_merge's), merged per (t, k) and combined in the same order as moe_part --
        bitwise the same output whatever the split was."""
        B, T, H = h.shape
        r = B * T if rows is None else rows
        flat = hn.reshape(B * T, H)
        y = jnp.where(hit[:r, :, None], y_hit, M.moe_terms(flat[:r], ids[:r], valid[:r] & ~hit[:r], bank, slot_of))
        part = M.moe_combine(y, w[:r], valid[:r]).astype(flat.dtype)
        return h + M.real_rows(part, flat, rows).reshape(B, T, H) + shared

    @functools.partial(jax.jit, static_argnums=(0,))
    def terms_merge(rows, y, hn, ids, m, bank, slot_of):
        """The per-(t, k) terms of the entries ``m`` merged into ``y`` (the first ``rows`` positions, as moe_early's):
        a chunk of a large union (prefill), or --overlap's group of the misses whose reads have landed while later
        ones are still being read (store.fetch's ``landed``)."""
        B, T, H = hn.shape
        r = B * T if rows is None else rows
        yc = M.moe_terms(hn.reshape(B * T, H)[:r], ids[:r], m[:r], bank, slot_of)
        return jnp.where(m[:r, :, None], yc, y)

    @jax.jit
    def combine_finish(mp, h, hn, y, w, valid):
        """After the last chunk: the terms summed in routing order + the shared expert."""
        routed = M.moe_combine(y, w, valid).astype(h.dtype).reshape(h.shape)
        return M.moe_finish(mp, h, hn, routed, valid.any(-1).reshape(h.shape[:2]))

    @jax.jit
    def head(norm, lm_head, x, rows):
        hidden = M.rms_norm(x, norm, cfg.rms_norm_eps)
        return M.head_logits(hidden, lm_head, rows), hidden

    engine._stream_fns = fns = dict(embed=embed, dense=dense, attn_route=attn_route, moe_part=moe_part,
                                    moe_early=moe_early, moe_late=moe_late, head=head, terms_merge=terms_merge,
                                    combine_finish=combine_finish)
    return fns


def _acc(engine, key, v):
    engine._route_acc[key] = engine._route_acc.get(key, 0.0) + float(v)


def _chunked_moe(engine, f, layer, mp, h, hn, ids, ids_np, w, valid, union):
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
        y = f["terms_merge"](None, y, hn, ids, m, bank, jnp.asarray(slot_of))
        y.block_until_ready()
    _acc(engine, "chunked_unions", 1)
    return f["combine_finish"](mp, h, hn, y, w, valid)


def stream_step(engine, tokens, start, lengths, logit_rows=None, row=None):
    """engine.forward for fetch=loop|callback|fused.  Returns (logits, hidden, cache).  ``row``: tokens [1, T] run
    on that row of the batch cache alone (the loop's layers read and write it in place; the whole-model programs
    run on the row's copy, Runner.row_view)."""
    callback = engine.opts["fetch"] == "callback" or (engine.opts["fetch"] == "fused" and not engine.store.aliased)
    fused = not callback and engine.opts["fetch"] == "fused" and fused_applies(engine, *tokens.shape, lengths)
    if row is not None and (callback or fused):
        with engine.row_view(row):
            logits, hidden, engine._cache = stream_step(engine, tokens, start, lengths, logit_rows)
        return logits, hidden, engine._cache
    if callback:
        return _callback_step(engine, tokens, start, lengths, logit_rows)
    if fused:
        return _fused_step(engine, tokens, start, lengths, logit_rows)
    # the host's arrays go to the programs as numpy arrays (the call transfers them): a jnp.asarray / jnp op here
    # is an eager dispatch of its own: ~9% of a 0.3x-box token (py-spy, stop 53)
    rw = None if row is None else np.int32(row)
    cfg, params, store = engine.cfg, engine.params, engine.store
    f = _fns(engine)
    B, T = tokens.shape
    valid_bt = valid_np = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    x = f["embed"]({"embed": params["embed"], "norm": params["norm"]}, tokens)
    cache = engine._cache
    n_real = int(np.max(np.asarray(lengths)))
    short = B == 1 and T <= 16 and n_real < T       # a padded decode / verify: experts for the real rows only
    sel = None
    layers = params["layers"]
    moe_idx = [i for i, lp in enumerate(layers) if "moe" in lp]
    pending_pred = None
    trace = [] if engine.opts["route_trace"] else None
    # the hit/miss split in one process only: with several, each one's store holds and reads its own shard, so the
    # split would be each process's own, and every process must run the same programs for their collectives to pair up
    overlap = engine.opts["overlap"] and jax.process_count() == 1
    for i, lp in enumerate(layers):
        k = _layer_key(cfg, i)
        if "moe" not in lp:
            x, cache[i], sel = f["dense"](k, lp, x, cache[i], start, sel, valid_bt, rw)
            continue
        nxt = None
        if engine.opts["prefetch"]:
            later = [j for j in moe_idx if j > i]
            nxt = layers[later[0]]["moe"] if later else None
        h, hn, cache[i], sel, ids, w, valid, pred, summ = f["attn_route"](
            k, lp, x, cache[i], start, sel, valid_bt, engine.resident_for(i), nxt, np.int32(i), rw)
        ids_np, valid_np_k = np.asarray(ids), np.asarray(valid)       # the one host sync per MoE layer
        union = np.unique(ids_np[valid_np_k])
        if pending_pred is not None:
            _acc(engine, "prefetch_recall_hits", len(np.intersect1d(pending_pred, union)))
            _acc(engine, "prefetch_recall_total", len(union))
            pending_pred = None
        if len(union) > store.call_limit(i):
            if trace is not None:
                trace.append([i, union.tolist()])
            _acc(engine, "union_experts", len(union))
            _acc(engine, "moe_layer_forwards", 1)
            engine._accumulate(summ)
            x = _chunked_moe(engine, f, i, lp["moe"], h, hn, ids, ids_np, w, valid, union)
            continue
        entries = (n_real if short else B * T) * ids_np.shape[-1]     # the (position, k) pairs the seam computes
        rows = n_real if short and entries <= store._layer(i).S else None
        early, during, landed = [], None, None
        # the XLA gather path reads only its slots; the native kernel computes any pairs, its per-(t, k) terms kept
        # to decode-sized forwards (a 512-token chunk's would be 64 MB at H 4096)
        if overlap and (entries <= store._layer(i).S or (
                store._layer(i).bank.kernel == "native" and entries <= OVERLAP_MAX_PAIRS)):
            res_now = store.resident_mask(i)
            resident = res_now[union]
            if not resident.all() and (resident.any() or len(union) > 1):
                # the hits (+ shared expert), dispatched once the misses' reads are issued: they run beside them;
                # then each group of the misses that has landed while later ones are still being read
                b0, s0 = store.peek(i)
                hit = valid_np_k & res_now[ids_np]

                def during():
                    early[:] = (hit,) + tuple(f["moe_early"](rows, lp["moe"], hn, ids, hit, b0, s0))

                def landed(es, b1, s1):
                    m = valid_np_k & np.isin(ids_np, es)
                    early[:2] = early[0] | m, f["terms_merge"](rows, early[1], hn, ids, m, b1, s1)
        bank, slot_of = store.fetch(i, union, during=during, landed=landed)
        early = early or None
        if trace is not None:
            trace.append([i, union.tolist()])
        if pred is not None:
            pn = np.asarray(pred)[valid_np.reshape(-1)]
            pending_pred = np.unique(pn)
            store.prefetch(later[0], pending_pred)      # background loads while this layer computes
        _acc(engine, "union_experts", len(union))
        _acc(engine, "moe_layer_forwards", 1)
        engine._accumulate(summ)
        if early is None:
            x = f["moe_part"](rows, lp["moe"], h, hn, ids, w, valid, bank, slot_of)
        else:
            x = f["moe_late"](rows, h, hn, ids, w, valid, early[0], early[1], early[2], bank, slot_of)
    logits, hidden = f["head"](params["norm"], params["lm_head"], x, valid_bt if logit_rows is None else logit_rows)
    if trace:
        write_route_trace(engine, trace)
    return logits, hidden, cache


def write_route_trace(engine, trace: list):
    """Append one forward's routing to --route_trace (fileio.append_output).  A failed write (a full disk, a FIFO
    nobody reads) is one warning line, the trace is then off for this engine, and the generation goes on."""
    path = engine.opts["route_trace"]
    if getattr(engine, "_route_trace_off", False):
        return
    try:
        fileio.append_output(path, json.dumps(trace) + "\n")
    except OSError as e:
        engine._route_trace_off = True
        print(f"glm-jax: warning: --route_trace={path}: cannot write ({e.strerror or e}); the routing trace is "
              "off for the rest of this run", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the MTP layer, streamed
def mtp_stream(engine, tokens, hidden, start, lengths, own_head: bool = False):
    """model.mtp_forward with the MTP layer's routed experts from the store (layer index num_hidden_layers), in the
    loop style: jit(input + attention + router + plugins) -> host union -> store.fetch -> jit(seam + shared) ->
    jit(shared_head).  Uses and updates the engine's MTP cache entry.  Returns (logits [B,T,V], hn [B,T,H])."""
    cfg, params, store = engine.cfg, engine.params, engine.store
    f = _fns(engine)
    L = cfg.num_hidden_layers
    key = ("mtp_io", own_head)
    io = engine._jits.get(key)
    if io is None:
        io = engine._jits[key] = (jax.jit(functools.partial(M.mtp_input, cfg, own_embed=own_head)),
                                  jax.jit(functools.partial(M.mtp_output, cfg, own_head=own_head)))
    B, T = tokens.shape
    valid_bt = jnp.arange(T)[None, :] < lengths[:, None]
    u = io[0](params, tokens, hidden)
    lp = params["mtp"]["layer"]
    cache = engine._cache
    h, hn, cache[L], _, ids, w, valid, _, summ = f["attn_route"](
        _layer_key(cfg, L), lp, u, cache[L], start, None, valid_bt, jnp.asarray(engine.resident_for(L)), None,
        np.int32(L))
    engine._check_routing(summ)
    ids_np = np.asarray(ids)
    union = np.unique(ids_np[np.asarray(valid)])
    _acc(engine, "mtp_union_experts", len(union))
    if len(union) > store.call_limit(L):
        g = _chunked_moe(engine, f, L, lp["moe"], h, hn, ids, ids_np, w, valid, union)
    else:
        bank, slot_of = store.fetch(L, union)
        g = f["moe_part"](None, lp["moe"], h, hn, ids, w, valid, bank, jnp.asarray(slot_of))
    return io[1](params, g)


# ----------------------------------------------------------------------------- callback mode
def _callback_step(engine, tokens, start, lengths, logit_rows=None):
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
    plugin = engine.plugin or M.identity_plugin
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

    class HostExperts(M.ExpertSource):
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
        x = M.embed(params, tokens)
        experts = HostExperts(resident)
        sel = None
        new_cache = list(cache)
        summs = []
        for i, lp in enumerate(params["layers"]):
            x, new_cache[i], sel, r = M.layer_forward(cfg, lp, x, cache[i], start, i, sel, valid_bt, experts, plugin,
                                                      len(summs))
            if r is not None:
                summs.append(r)
        hidden = M.rms_norm(x, params["norm"], cfg.rms_norm_eps)
        return (M.head(params, hidden), hidden, new_cache, _routing_summary(summs, want_stats),
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
    engine._fused_pred, engine._fused_trace, engine._fused_next = {}, [], 0
    # numpy, handed to the program as its arguments (jnp ops here were ~1.2 ms of small programs per dispatch)
    return dict(cur=np.stack([store._layer(i).slot_of for i in idx]).astype(np.int32),
                res=np.stack([engine.resident_for(i) for i in idx]).reshape(len(idx), cfg.n_routed_experts),
                step=np.int32(0), miss=np.bool_(False),
                log_ids=np.zeros((steps, len(idx), B * T, K), np.int32),
                log_valid=np.zeros((steps, len(idx), B * T, K), np.bool_))


def _fused_access(engine, layer: int, last: bool, ids, valid):
    """One MoE layer's store call, as fetch=loop makes it: the union, the fetch, the trace, the counters."""
    union = np.unique(ids[valid])
    pend = engine._fused_pred.pop(layer, None)
    if pend is not None:
        _acc(engine, "prefetch_recall_hits", len(np.intersect1d(pend, union)))
        _acc(engine, "prefetch_recall_total", len(union))
    _, slot_of = engine.store.fetch(layer, union)
    if engine.opts["route_trace"]:
        engine._fused_trace.append([layer, union.tolist()])
        if last:
            tr, engine._fused_trace = engine._fused_trace, []
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
    q = engine._fused_next
    if q >= upto:
        return
    log_ids, log_valid = np.asarray(log_ids), np.asarray(log_valid)
    store = engine.store
    if engine.opts["route_trace"] or engine._fused_pred or not hasattr(store, "replay_hits"):
        for j in range(q, upto):
            s, mi = divmod(j, n)
            _fused_access(engine, idx[mi], mi == n - 1, log_ids[s, mi], log_valid[s, mi])
        engine._fused_next = upto
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
    engine._fused_next = upto


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
    engine._fused_next = q + 1
    res = np.asarray(engine.resident_for(layer), bool)
    nres = res
    if pred is not None:
        pn = np.unique(np.asarray(pred)[np.asarray(valid_pos)])
        engine._fused_pred[nxt] = pn
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
    plugin = engine.plugin or M.identity_plugin
    want_stats = engine.plugin is not None
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    moe_idx = _moe_idx(cfg)
    prefetch = bool(engine.opts["prefetch"])
    shapes = (jax.ShapeDtypeStruct((E,), jnp.int32), jax.ShapeDtypeStruct((E,), jnp.int32),
              jax.ShapeDtypeStruct((E,), jnp.bool_), jax.ShapeDtypeStruct((E,), jnp.bool_))
    slots = {i: store._layer(i).S for i in moe_idx}

    class StoreExperts(M.ExpertSource):
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
                pred = M.route(cfg, self.layers[nxt]["moe"], hn.reshape(B * T, -1), valid_bt.reshape(B * T),
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
        x = M.embed({"embed": params["embed"], "norm": params["norm"]}, tokens)
        cache = list(cache)
        experts = StoreExperts(banks, params["layers"], st)
        sel, summs = None, []
        for i, lp in enumerate(params["layers"]):
            x, cache[i], sel, r = M.layer_forward(cfg, lp, x, cache[i], start, _layer_key(cfg, i), sel, valid_bt,
                                                  experts, plugin, len(summs), jnp.int32(i))
            if r is not None:
                summs.append(r)
        hidden = M.rms_norm(x, params["norm"], cfg.rms_norm_eps)
        logits = M.head_logits(hidden, params["lm_head"], valid_bt if logit_rows is None else logit_rows)
        st = dict(experts.st, step=experts.st["step"] + 1)
        return logits, hidden, cache, _routing_summary(summs, want_stats), st

    return f


def fused_finish(engine, st, steps: int):
    """After a fused program: the skipped layers' store calls of its ``steps`` steps not replayed yet."""
    fused_replay(engine, st["log_ids"], st["log_valid"], steps * len(_moe_idx(engine.cfg)))


def _fused_step(engine, tokens, start, lengths, logit_rows=None):
    B, T = tokens.shape
    n_real = int(np.max(np.asarray(lengths)))
    short = n_real if (B == 1 and T <= 16 and n_real < T) else None
    key = ("fused_step", B, T, engine._cache_len, short, logit_rows is None, bool(engine.opts["prefetch"]))
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
        return acc + M.mlp(mp["shared"], hn[None], real)[0].astype(acc.dtype)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def routed(acc, hn, ids, w, m, bank, slot_of):
        """acc + the routed experts ``m`` marks (one round's fetch), every position of the buffer in one call."""
        return acc + M.moe_routed(hn, ids, w, m, bank, slot_of).astype(acc.dtype)

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


def segment_steps(engine, tokens: np.ndarray, start: int, chunk: int, width: int, row=None,
                  slice_s: Optional[float] = None):
    """A prompt's ``n`` tokens (positions start..start+n-1) prefilled layer by layer: each layer runs its attention
    over the segment in blocks of ``chunk`` positions (the cache written in order, so a block attends to the ones
    before it), then its routed experts over every position, ``width`` positions a call (segment_width): each expert
    the segment routes to is fetched once a layer (in rounds of ``store.call_limit``), where chunk-by-chunk prefill
    fetches a chunk's misses again for every chunk (a ~1900-token prompt in the GLM-4.5-Air slice's 0.3x box read
    9x its experts, stop 49).  A round's call is split by rows where its (t, k) pairs pass SEGMENT_PAIR_CAP a
    position (the kernel's scratch).  The routed sum is taken round by round, not in routing order: the chunked
    forward's within rounding.

    A generator: with ``slice_s``, it yields (None) once that many seconds have passed since it last yielded, at a
    point where nothing it dispatched is in flight, so the caller (the scheduler) can run a decode step of its other
    rows meanwhile.  Such a step may fetch into any layer's slots and replace the K/V cache's arrays: every block
    and round therefore takes ``engine._cache`` and the store's slots afresh after a yield (a round fetches its
    experts when it starts).  Its return value (StopIteration's) is (logits [1, chunk, V] of the last block, the
    last token's index in it)."""
    cfg, params, store = engine.cfg, engine.params, engine.store
    c = int(chunk)
    G = max(1, int(width) // c)
    n = int(len(tokens))
    nb = -(-n // c)
    ng = -(-nb // G)
    W = G * c
    rw = None if row is None else jnp.int32(row)
    starts = [jnp.asarray([start + j * c], jnp.int32) for j in range(nb)]
    lens = [min(c, n - j * c) for j in range(nb)]
    valid = [jnp.asarray(np.arange(c)[None, :] < lens[j]) for j in range(nb)]
    emb = {"embed": params["embed"], "norm": params["norm"]}
    f, g = _fns(engine), _seg_fns(engine, c, G)
    bufs = None
    for j in range(nb):
        toks = np.zeros((1, c), np.int32)
        toks[0, :lens[j]] = tokens[j * c:j * c + lens[j]]
        x = f["embed"](emb, jnp.asarray(toks))
        if bufs is None:       # (host zeros: no op-by-op program compiled and kept for these shapes)
            bufs = [jnp.asarray(np.zeros((W, x.shape[-1]), x.dtype)) for _ in range(ng)]
            hns = [jnp.asarray(np.zeros((W, x.shape[-1]), x.dtype)) for _ in range(ng)]
        bufs[j // G] = g["put"](bufs[j // G], x, np.int32((j % G) * c))
    K = cfg.num_experts_per_tok
    real = [np.zeros((W,), bool) for _ in range(ng)]
    for j in range(nb):
        real[j // G][(j % G) * c:(j % G) * c + lens[j]] = True
    real_d = [jnp.asarray(r.reshape(1, W)) for r in real]
    sels = [None] * nb
    trace = [] if engine.opts["route_trace"] else None
    t_last = [time.perf_counter()]

    def due() -> bool:
        return slice_s is not None and time.perf_counter() - t_last[0] >= slice_s

    def paused():              # after the yield: the caller's step may have dropped / recompiled the programs
        t_last[0] = time.perf_counter()
        return _fns(engine), _seg_fns(engine, c, G)

    for i, lp in enumerate(params["layers"]):
        k = _layer_key(cfg, i)
        if "moe" not in lp:
            for j in range(nb):
                off = np.int32((j % G) * c)
                x, engine._cache[i], sels[j] = f["dense"](k, lp, g["take"](bufs[j // G], off), engine._cache[i],
                                                          starts[j], sels[j], valid[j], rw)
                bufs[j // G] = g["put"](bufs[j // G], x, off)
                if due():
                    jax.block_until_ready(bufs)
                    yield
                    f, g = paused()
            continue
        ids_np = np.zeros((ng, W, K), np.int32)
        w_np = np.zeros((ng, W, K), np.float32)
        m_np = np.zeros((ng, W, K), bool)
        res = jnp.asarray(engine.resident_for(i))
        for j in range(nb):
            gi, off = j // G, np.int32((j % G) * c)
            h, hn, engine._cache[i], sels[j], ids, w, vm, _, summ = f["attn_route"](
                k, lp, g["take"](bufs[gi], off), engine._cache[i], starts[j], sels[j], valid[j], res, None,
                np.int32(i), rw)
            engine._accumulate(summ)
            bufs[gi] = g["put"](bufs[gi], h, off)
            hns[gi] = g["put"](hns[gi], hn, off)
            o = (j % G) * c
            ids_np[gi, o:o + c] = np.asarray(ids)
            m_np[gi, o:o + c] = np.asarray(vm)
            w_np[gi, o:o + c] = np.asarray(w, np.float32)
            if due():
                jax.block_until_ready((bufs, hns))
                yield
                f, g = paused()
                res = jnp.asarray(engine.resident_for(i))      # (the step may have changed the layer's cache)
        for gi in range(ng):
            bufs[gi] = g["shared"](bufs[gi], hns[gi], real_d[gi], lp["moe"])
        union = np.unique(ids_np[m_np])
        if trace is not None:
            trace.append([i, union.tolist()])
        _acc(engine, "union_experts", len(union))
        _acc(engine, "moe_layer_forwards", 1)
        _acc(engine, "segment_layers", 1)
        union = _round_order(union, ids_np, m_np, store.resident_mask(i), store.call_limit(i))
        ids_d, w_all = [jnp.asarray(a) for a in ids_np], [jnp.asarray(a) for a in w_np]
        cap = W * SEGMENT_PAIR_CAP
        r0 = 0
        while r0 < len(union):
            lim = store.call_limit(i)          # (a step between rounds may have lowered the working set)
            part = union[r0:r0 + lim]
            r0 += len(part)
            bank, slot_of = store.fetch(i, part)
            so = jnp.asarray(slot_of)
            for gi in range(ng):
                mg = m_np[gi] & np.isin(ids_np[gi], part)
                for a, b in _pair_splits(mg, cap):
                    mm = np.zeros_like(mg)
                    mm[a:b] = mg[a:b]
                    bufs[gi] = g["routed"](bufs[gi], hns[gi], ids_d[gi], w_all[gi], jnp.asarray(mm), bank, so)
            jax.block_until_ready(bufs)           # the next round's fetch may take these slots
            if due() and r0 < len(union):
                yield
                f, g = paused()
        if due() and i + 1 < len(params["layers"]):
            yield
            f, g = paused()
    last = nb - 1
    x = g["take"](bufs[last // G], np.int32((last % G) * c))
    lr = np.zeros((1, c), bool)
    lr[0, lens[last] - 1] = True
    logits, _ = f["head"](params["norm"], params["lm_head"], x, jnp.asarray(lr))
    if trace:
        write_route_trace(engine, trace)
    return logits, lens[last] - 1

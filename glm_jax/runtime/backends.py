"""Where a forward's routed experts come from: one backend per --fetch mode, chosen once at load (Engine.load: the
memory plan picks one under --fetch=auto; a test or a user names any).  Every backend runs the same layer body
(model.layer_forward: attention -> router -> plugins -> experts -> shared expert); they differ only in what
answers "this layer's experts for these ids":

    Runner.forward -> backend.forward(rt, tokens, start, lengths, logit_rows, row, window, moe_rows)
      Resident   every expert in the params (or the store's resident view): one compiled step (model.step)
      Loop       a Python layer loop, ``store.fetch`` on the host between a MoE layer's two programs
                 (streaming.loop_step, programs: streaming.StreamPrograms)
      Callback   one program, the store called through an io_callback per MoE layer (streaming.callback_step)
      Fused      a decode / verify as one program over the store's arenas, the store called only at a miss
                 (streaming.fused_step, its bookkeeping replayed: streaming.ReplayLog); prefills the Loop's way

What the runtime asks of a mode is an attribute here (``streamed``, ``fused_decode``, ...), never a --fetch
string compared on the hot path; what a mode keeps between forwards (its programs, the replay log, a failed
route trace) lives in its backend object.
"""

from __future__ import annotations

import numpy as np

from . import streaming


class Backend:
    name = ""                # the --fetch value it answers to
    streamed = True          # the experts come from an expert store, layer by layer (else all resident)
    fused_decode = False     # the scheduler's multi-step decode runs the store's program (streaming.fused_forward)
    shared_programs = False  # its programs are shared by the layers (one per layer kind and shape): dropped between
                             # requests, they come back from the compile cache on disk
    segments = False         # a long prompt may prefill layer by layer (streaming.segment_steps)
    row_in_place = False     # a one-row forward of a batch cache works on each layer's slice of that row in place

    def forward(self, rt, tokens, start, lengths, logit_rows, row, window, moe_rows):
        """tokens [B, T] at positions start[b] on ``rt``'s cache.  Returns (logits, hidden, cache)."""
        raise NotImplementedError


class Resident(Backend):
    name = "resident"
    streamed = False

    def forward(self, rt, tokens, start, lengths, logit_rows, row, window, moe_rows):
        if window is not None and (window >= rt._cache_len or rt.cfg.is_mla):
            window = None      # DSA's top-k selection runs over every cache position: MLA is never windowed
        kw = {"moe_rows": moe_rows}
        if row is not None:
            kw["row"] = np.int32(row)
        if window is not None:
            kw["window"] = window
        logits, hidden, cache, summary = rt._step_resident()(
            rt.step_params(), rt._cache, tokens, start, lengths, rt._resident_masks(), logit_rows, **kw)
        rt._accumulate(summary)
        return logits, hidden, cache


class _Streamed(Backend):
    def __init__(self, cfg, plugin=None, opts=None):
        opts = opts or {}
        self.programs = streaming.StreamPrograms(cfg, plugin)    # the loop's; the MTP layer and prefills use them
        self.prefetch = bool(opts.get("prefetch"))   # --prefetch: the next MoE layer's predicted experts loaded
        self.overlap = bool(opts.get("overlap"))     # --overlap: a layer's hits computed while its misses are read
        self.route_trace = opts.get("route_trace") or ""     # --route_trace: the file each forward's unions go to
        self.trace_off = False      # --route_trace failed to write once: off for the rest of the run

    def forward(self, rt, tokens, start, lengths, logit_rows, row, window, moe_rows):
        B, T = tokens.shape
        viewed = row is not None and rt._cache_batch > 1
        shapes = rt._stream_shapes(B, T, moe_rows, viewed, logit_rows is None)
        if shapes not in rt._shapes_run:
            rt.before_new_shapes()          # this forward's programs compile now (Engine: room for it)
        out = self.step(rt, tokens, start, lengths, logit_rows, row if viewed else None)
        rt._shapes_run.add(shapes)
        return out

    def step(self, rt, tokens, start, lengths, logit_rows, row):
        raise NotImplementedError


def _on_row(run, rt, tokens, start, lengths, logit_rows, row):
    """A whole-model program on cache row ``row`` (its copy, Runner.row_view) or on the cache."""
    if row is None:
        return run(rt, tokens, start, lengths, logit_rows)
    with rt.row_view(row):
        logits, hidden, rt._cache = run(rt, tokens, start, lengths, logit_rows)
    return logits, hidden, rt._cache


class Loop(_Streamed):
    name = "loop"
    shared_programs = True
    segments = True
    row_in_place = True

    def step(self, rt, tokens, start, lengths, logit_rows, row):
        return streaming.loop_step(rt, tokens, start, lengths, logit_rows, row)


class Callback(_Streamed):
    name = "callback"

    def step(self, rt, tokens, start, lengths, logit_rows, row):
        return _on_row(streaming.callback_step, rt, tokens, start, lengths, logit_rows, row)


class Fused(_Streamed):
    name = "fused"
    fused_decode = True
    segments = True

    def __init__(self, cfg, plugin=None, opts=None):
        super().__init__(cfg, plugin, opts)
        self.replay = streaming.ReplayLog()

    def step(self, rt, tokens, start, lengths, logit_rows, row):
        if not streaming.fused_applies(rt, *tokens.shape, lengths):     # a prefill: the loop's way
            return streaming.loop_step(rt, tokens, start, lengths, logit_rows, row)
        return _on_row(streaming.fused_step, rt, tokens, start, lengths, logit_rows, row)


def backend_for(fetch: str, cfg, plugin=None, store=None, opts=None) -> Backend:
    """The backend of a resolved --fetch value (``opts``: the run's options its state is read from, once).
    fetch=fused on a store whose banks do not alias its arenas runs the callback program (its arenas cannot be the
    fused program's arguments)."""
    if fetch == "resident":
        return Resident()
    if fetch == "loop":
        return Loop(cfg, plugin, opts)
    if fetch == "fused" and store is not None and store.aliased:
        return Fused(cfg, plugin, opts)
    return Callback(cfg, plugin, opts)

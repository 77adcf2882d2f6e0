"""The runtime's core: forward passes of a loaded model over a KV cache of B rows (below the Engine facade).

Layering (one direction): ``model`` / ``mla`` (pure functions) -> the runtime (this module: ``Runner``, the forward
passes; ``streaming``: forwards whose experts come from the store; ``speculative``: drafting; ``scheduler``: the
generation loop, continuous batching) -> ``engine.Engine`` (the facade: loading, the public API) -> the CLIs and
the server.  Nothing below the facade imports it: the runtime modules receive a ``Runner`` (``Engine`` is one).

A ``Runner`` holds the config, the params, the options, the expert store (or None), the routing plugin, the jitted
pieces and the cache: a list (one entry per layer, + the MTP layer) of dicts of ``[B, S, ...]`` arrays.
``forward`` runs tokens [B, T] at per-row positions on it; ``row=r`` runs them on row r alone (a width-1 program on
that row's slice of the cache: a prefill chunk, or a speculative step of one row), ``window=S`` attends over the
first S cache positions only (the attention's cost is B x S; rows never reach past it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from glm_jax_plugins import contract

from .. import model as M
from ..errors import GlmJaxError, NonFiniteError, PluginError
from ..fit import KV_DEFAULT_TOKENS
from ..model.glm5_next_modules import model_class
from ..model.modules import Split
from .stats import routing_summary
from .streaming import segment_steps

BIG_POS = 1 << 30     # start of a row that takes no part in a forward: its K/V writes fall outside the cache


@dataclasses.dataclass
class GenerationResult:
    tokens: list
    text: str
    stats: dict
    prompt_tokens: list = dataclasses.field(default_factory=list)
    finish_reason: str = ""          # "stop" (EOS or a stop string), "length" (max_new_tokens or the context limit)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "stats": self.stats, "prompt_tokens": self.prompt_tokens,
                "finish_reason": self.finish_reason}


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power-of-two multiple of ``minimum`` >= n (padded shapes: few compiled programs)."""
    b = minimum
    while b < n:
        b *= 2
    return b


def round_up(n: int, m: int) -> int:
    return ((n + m - 1) // m) * m


@jax.jit
def all_finite(logits, lengths):
    """True when every real position's logits (t < lengths[b]) are finite."""
    real = jnp.arange(logits.shape[1])[None, :] < lengths[:, None]
    return jnp.all(jnp.where(real[..., None], jnp.isfinite(logits), True))


def nonfinite_error(rt, first: int, last: int) -> NonFiniteError:
    return NonFiniteError(f"{rt.path}: the model produced NaN/Inf logits (positions {first}..{last}); the weights or "
                          f"activations overflow {jnp.dtype(rt.dtype).name} (try --dtype=float32)")


def positional(key: str) -> bool:
    """Whether a layer cache's entry has a position axis (K/V); a KDA layer's state (M.STATE_KEYS) has none: it is
    never windowed, grown or shrunk, only taken and written by row."""
    return key not in M.STATE_KEYS


def window_cache(cache, row, window):
    """The part of ``cache`` a forward runs on: row ``row`` (traced int, or None: every row), positions [:window]
    (static, or None: all)."""
    out = []
    for c in cache:
        d = {}
        for k, v in c.items():
            if row is not None:
                v = jax.lax.dynamic_slice_in_dim(v, row, 1, axis=0)
            if window is not None and positional(k):
                v = v[:, :window]
            d[k] = v
        out.append(d)
    return out


def write_back(full, part, row):
    """``full`` with ``part`` (from ``window_cache``) written back at row ``row`` (None: 0), positions 0.."""
    out = []
    for cf, cp in zip(full, part):
        d = {}
        for k, v in cf.items():
            r = jnp.int32(0) if row is None else row
            d[k] = jax.lax.dynamic_update_slice(v, cp[k].astype(v.dtype), (r,) + (jnp.int32(0),) * (v.ndim - 1))
        out.append(d)
    return out


def gather_rows(cache, rmap, window):
    """Rows ``rmap`` ([w] int32, distinct) of ``cache``, positions [:window] (static, or None: all): the compact
    [w, window] part a decode of w running rows works on (``scatter_rows`` puts it back)."""
    return [{k: (v[rmap] if window is None or not positional(k) else v[rmap, :window]) for k, v in c.items()}
            for c in cache]


def scatter_rows(full, part, rmap):
    """``full`` with ``part`` (from ``gather_rows``) written back at rows ``rmap``, positions 0.."""
    return [{k: v.at[rmap, :cp[k].shape[1]].set(cp[k].astype(v.dtype)) for k, v in cf.items()}
            for cf, cp in zip(full, part)]


class Runner:
    """Forward passes over the cache.  The attributes are set by the subclass (``engine.Engine``): path, cfg,
    params, opts, store, plugin, dtype, kv_dtype, device, kernel, moe_layers, backend (backends.py: where the
    routed experts come from, chosen once at load)."""

    def _init_runtime(self):
        self._cache = None
        self._cache_len = 0
        self._cache_batch = 0
        self.kv_epoch = 0          # bumped whenever the cache's rows stop holding what the scheduler put there
        self._jits = {}
        self._route_acc = {}
        self._view = None
        self._shapes_run = set()   # the streamed forwards' shapes run at a cache length since programs were dropped

    # ------------------------------------------------------------------ limits and the cache
    @property
    def recurrent_state(self) -> bool:
        """Whether the cache holds a per-row recurrent state (glm5_next's KDA layers): it is the state after every
        token the row has seen, so a row's cache is only reusable by a prompt that extends all of them."""
        return "linear_attention" in self.cfg.layer_types

    @property
    def context_limit(self) -> int:
        """Tokens a sequence (prompt + output) may hold: the model's ``max_position_embeddings``, or ``--max_seq_len``
        when set (it may only lower it: RoPE is applied as the checkpoint defines it, without extension)."""
        n = int(self.cfg.max_position_embeddings)
        ms = int(self.opts["max_seq_len"] or 0)
        return min(n, ms) if ms else n

    @property
    def kv_reserve_tokens(self) -> int:
        """K/V positions the memory plan reserved per row: ``--max_seq_len``, the store-backed load's fit plan
        (fit.py, lowered where memory is short), else fit.KV_DEFAULT_TOKENS -- never past the context limit."""
        planned = getattr(self, "_kv_planned", None)
        return min(self.context_limit, int(self.opts["max_seq_len"] or planned or KV_DEFAULT_TOKENS))

    def before_new_shapes(self):
        """Called by a streamed ``forward`` whose shapes (rows, positions, the cache's length, ...) have not run
        since its programs were last dropped: they compile now.  Where the run keeps a RAM budget the engine makes
        room for the compile first (``Engine.before_new_shapes``)."""

    def _stream_shapes(self, B: int, T: int, moe_rows, viewed: bool, all_logits: bool) -> tuple:
        """What a streamed forward's programs are compiled for (``_shapes_run``'s entries): rows, positions, the
        cache's length, padded rows, a row view, all positions' logits or some."""
        return (B, T, self._cache_len, moe_rows, viewed, all_logits)

    def segment_tokens(self, remaining: int, chunk: int):
        """(positions, MoE width) of a prompt's ``remaining`` ones that the scheduler's next prefill step may take
        at once, layer by layer (``prefill_segment``); None: chunk by chunk.  The engine decides
        (``Engine.segment_tokens``)."""
        return None

    def prefill_segment(self, tokens: np.ndarray, start: int, chunk: int, width: int, row: Optional[int] = None):
        """A streamed prefill of ``tokens`` (one prompt's, at positions start..) layer by layer, attention in blocks
        of ``chunk``, the routed experts ``width`` positions a call (streaming.segment_steps).  Returns (logits
        [1, chunk, V] of the last block, the last token's index in it)."""
        run = self.segment_steps(tokens, start, chunk, width, row)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def segment_steps(self, tokens: np.ndarray, start: int, chunk: int, width: int, row: Optional[int] = None,
                      slice_s: Optional[float] = None):
        """``prefill_segment`` as a generator that yields every ``slice_s`` seconds of its work, where nothing it
        dispatched is in flight (streaming.segment_steps): the scheduler decodes its other rows in between.  Its
        return value is ``prefill_segment``'s."""
        self._check_open()
        viewed = row is not None and self._cache_batch > 1
        # its attention blocks run the programs of a prefill chunk's forward (``forward``'s shapes), its MoE calls
        # their own at ``width``
        shapes = [self._stream_shapes(1, int(chunk), None, viewed, False), ("segment", int(chunk), int(width))]
        if not all(s in self._shapes_run for s in shapes):
            self.before_new_shapes()
        logits, li = yield from segment_steps(self, np.asarray(tokens, np.int32), int(start), int(chunk), int(width),
                                              row if viewed else None, slice_s)
        self._shapes_run.update(shapes)
        if not bool(all_finite(logits, jnp.asarray([li + 1], jnp.int32))):
            raise nonfinite_error(self, int(start), int(start) + len(tokens) - 1)
        return logits, li

    def segment_done(self):
        """After a request's last prefill segment: the engine may hand what the segment took back to the expert
        cache."""

    def memory_guard(self, kv_positions: int = 0, rows: int = 1):
        """Called by the scheduler before a request's prefill, with the positions the KV cache is about to grow by
        (x ``rows``): where the run has a RAM budget the engine keeps inside it (``MemoryGuard.memory_guard``)."""

    def memory_settled(self):
        """Called by a server's scheduler when it goes idle after work: the engine may hand what is measured free
        back to the expert cache (``MemoryGuard.refit``)."""

    def warmed_up(self):
        """Called at the end of ``Scheduler.warmup``: the engine may drop the programs it compiled and hand the
        memory to the expert cache (``Engine.warmed_up``)."""

    def kv_give_back(self) -> bool:
        """Whether the scheduler returns the KV cache to the memory plan's reservation once no running row needs
        the positions a longer request grew it by (``shrink_cache``): a run with a RAM budget (``Engine``)."""
        return False

    def _ensure_cache(self, batch: int, need: int):
        """A cache of ``batch`` rows holding at least ``need`` positions (a new one, zeroed, when it does not)."""
        cap = self.opts["max_seq_len"] or round_up(max(need, 64), 256)
        if need > cap:
            raise GlmJaxError(f"option 'max_seq_len': {cap} tokens is too small for this request ({need} needed)")
        if self._cache is None or self._cache_len < cap or self._cache_batch != batch:
            self._new_cache(batch, cap)
        self.kv_epoch += 1         # its rows are about to be overwritten (the scheduler's prefix cache forgets them)
        return self._cache

    def _new_cache(self, batch: int, cap: int):
        self._cache = None         # free the old one first
        self.kv_epoch += 1
        cache = M.init_cache(self.cfg, batch, cap, self.kv_dtype, with_mtp=self.params.get("mtp") is not None)
        # one device, or the mesh: the KV cache split by heads where they divide the model axis (mesh.py)
        plan = getattr(self, "plan", None)
        self._cache = jax.device_put(cache, self.device) if plan is None else plan.place_cache(cache)
        self._cache_len = cap
        self._cache_batch = batch

    def grow_cache(self, batch: int, cap: int):
        """Keep the rows' contents, make room for ``cap`` positions (a cache of another batch is replaced)."""
        if self._cache is None or self._cache_batch != batch:
            self._new_cache(batch, cap)
        elif cap > self._cache_len:
            pad = cap - self._cache_len
            self._relayout(jax.jit(lambda e: {k: jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
                                              if positional(k) else v for k, v in e.items()}))
            self._cache_len = cap

    def shrink_cache(self, batch: int, cap: int):
        """Give back the positions past ``cap``; the rows keep their contents before it."""
        if self._cache is None or self._cache_batch != batch or cap >= self._cache_len:
            return
        self._relayout(jax.jit(lambda e: {k: v[:, :cap] if positional(k) else v for k, v in e.items()}))
        self._cache_len = cap

    def _relayout(self, f):
        """The cache through ``f``, one layer at a time, each old layer freed before the next is copied: the
        transient is one layer's old arrays, not the whole old cache beside the new one (a 2-row, 2048 -> 4096
        growth of the GLM-4.5-Air slice's f16 cache: 50 MB, where the 0.3x box's budget keeps ~60 MB free)."""
        old, self._cache = self._cache, None
        new = []
        while old:
            new.append(jax.block_until_ready(f(old.pop(0))))
        self._cache = new
        if getattr(self, "plan", None) is not None:
            self._cache = self.plan.place_cache(self._cache)

    # ------------------------------------------------------------------ jitted pieces
    def _jit(self, name, fn, **kw):
        f = self._jits.get(name)
        if f is None:
            f = self._jits[name] = jax.jit(fn, **kw)
        return f

    def _step_resident(self):
        cfg, plugin = self.cfg, self.plugin or M.identity_plugin
        want_stats = self.plugin is not None

        def f(params, cache, tokens, start, lengths, resident, logit_rows=None, row=None, moe_rows=None,
              window=None):
            part = cache if (row is None and window is None) else window_cache(cache, row, window)
            logits, hidden, part, routing = M.step(cfg, params, part, tokens, start, lengths, resident, plugin,
                                                   moe_rows, logit_rows)
            cache = part if (row is None and window is None) else write_back(cache, part, row)
            return logits, hidden, cache, routing_summary(routing, want_stats)

        return self._jit("step", f, donate_argnums=(1,), static_argnames=("moe_rows", "window"))

    def step_params(self):
        """What the one-jit step runs on: the NNX model split into one jit argument (``nnx_model.Split``, merged
        inside the trace), with, when an expert store holds every expert (fetch=resident on a container), each MoE
        layer's store bank and slot map (aliasing the store's arenas)."""
        if self._view is None:
            if self.store is None:
                self._view = Split.of(self.model)
                return self._view
            if not self.store.all_resident():
                raise GlmJaxError("internal: the one-jit step needs every expert resident in the store")
            L = self.cfg.num_hidden_layers
            params = dict(self.params)
            layers = list(params["layers"])
            for i, (bank, slot_of) in self.store.resident_view().items():
                if getattr(self, "plan", None) is None:
                    slot_of = jax.device_put(slot_of, self.device)
                extra = {"experts": bank, "slot_of": slot_of}
                if i < L:
                    layers[i] = dict(layers[i], **extra)
                elif params.get("mtp") is not None:
                    params["mtp"] = dict(params["mtp"], layer=dict(params["mtp"]["layer"], **extra))
            params["layers"] = layers
            self._view = Split.of(model_class(self.cfg)(params))
        return self._view

    def resident_for(self, layer: int) -> np.ndarray:
        """bool [E]: what the routing plugins see as resident in ``layer`` (--budget_residency: the live cache +
        pins, the pins only, or nothing; nothing without a store)."""
        mode = self.opts["budget_residency"]
        if self.store is None or mode == "none":
            return np.zeros(self.cfg.n_routed_experts, bool)
        return self.store.pinned_mask(layer) if mode == "pinned" else self.store.resident_mask(layer)

    def resident_masks_np(self) -> np.ndarray:
        """bool [n_moe, E]: ``resident_for`` of every MoE layer (a jit argument as it is)."""
        return np.stack([self.resident_for(l) for l in self.moe_layers]).reshape(
            len(self.moe_layers), self.cfg.n_routed_experts)

    def _resident_masks(self):
        return jnp.asarray(self.resident_masks_np())

    # ------------------------------------------------------------------ the forward
    def forward(self, tokens: np.ndarray, start: np.ndarray, lengths: np.ndarray, logit_rows=None,
                row: Optional[int] = None, window: Optional[int] = None):
        """Run tokens [B, T] at positions start[b] on the cache.  Returns (logits, hidden).
        ``logit_rows`` (bool [B, T], optional): the positions whose logits are needed (a prefill: its last); the
        native kernels leave the others 0.  ``row``: tokens [1, T] run on cache row ``row`` alone.  ``window``:
        attend over cache positions [:window] only (fetch=resident; every row's positions must lie below it)."""
        B, T = np.shape(tokens)
        # a short padded forward (decode / MTP verify at a fixed width, speculative.py) runs the routed experts on
        # its real rows only
        moe_rows = int(np.max(lengths)) if B == 1 and T <= 16 and int(np.max(lengths)) < T else None
        # numpy arrays: each program call transfers them (a jnp.asarray is an eager dispatch of its own)
        tokens = np.asarray(tokens, np.int32)
        start = np.asarray(start, np.int32)
        lengths = np.asarray(lengths, np.int32)
        self._check_open()
        lr = None if logit_rows is None else np.asarray(logit_rows, bool)
        logits, hidden, self._cache = self.backend.forward(self, tokens, start, lengths, lr, row, window, moe_rows)
        if not bool(all_finite(logits, lengths)):
            real = int(np.argmax(np.asarray(lengths) > 0))
            s0 = int(start[real])
            raise nonfinite_error(self, s0, s0 + int(lengths[real]) - 1)
        return logits, hidden

    class _RowView:
        def __init__(self, rt, row):
            self.rt, self.row = rt, row

        def __enter__(self):
            rt = self.rt
            self.full = rt._cache
            rt._cache = rt.take_row(self.row)
            self.saved = (rt._cache_batch,)
            rt._cache_batch = 1
            return self

        def __exit__(self, *exc):
            rt = self.rt
            part, rt._cache = rt._cache, self.full
            rt.put_row(part, self.row)
            rt._cache_batch = self.saved[0]
            self.full = None
            return False

    def take_row(self, row: int, upto: Optional[int] = None):
        """Row ``row`` of the batch cache: a [1, S, ...] part per entry (``put_row`` writes one back); with ``upto``
        only its positions [:W], W a power of two >= upto (a short sequence's copy, not the whole row's)."""
        w = None if upto is None or bucket(upto, 64) >= self._cache_len else bucket(upto, 64)
        take = self._jit(("row_take", w), lambda c, r: window_cache(c, r, w))
        return take(self._cache, jnp.int32(row))

    def put_row(self, part, row: int):
        """``part`` ([1, L, ...] per entry, L <= S) written into row ``row`` at positions 0.. (the cache donated)."""
        put = self._jit("row_put", write_back, donate_argnums=(0,))
        cache, self._cache = self._cache, None
        self._cache = put(cache, part, jnp.int32(row))

    def row_view(self, row: int):
        """Context: ``self._cache`` is row ``row``'s slice [1, S, ...] inside, written back at exit (code written
        for one sequence -- the streamed forward, MTP drafting -- runs on one row of the batch cache)."""
        return Runner._RowView(self, row)

    @property
    def residency_is_static(self) -> bool:
        """True when what the plugins see as ``resident`` cannot change during a run (no store, or
        --budget_residency none / pinned): a plugin that reads it is then still a function of the routing alone."""
        return self.store is None or self.opts["budget_residency"] != "cache"

    def _check_routing(self, summ):
        """Raise the contract violation a forward's routing summary reports (user plugins' in-jit value checks,
        glm_jax_plugins.contract), if any; removes those keys from ``summ``."""
        if not summ or "violation" not in summ:
            return
        code, layer = int(summ.pop("violation")), int(summ.pop("violation_layer"))
        if code:

            i, flags = contract.decode(code)
            names = getattr(self, "plugin_names", [])
            name = names[i] if 0 <= i < len(names) else f"#{i}"
            raise PluginError(f"routing plugin '{name}' broke the contract at layer {layer}: "
                              f"{contract.describe(flags)}")

    def _accumulate(self, summ):
        self._check_routing(summ)
        if summ:
            acc = self._route_acc
            for k, v in summ.items():
                acc[k] = acc.get(k, 0.0) + float(v)

    def _check_open(self):
        if getattr(self, "_closed", False):
            raise GlmJaxError(f"{self.path}: this Engine was closed (Engine.close()); load the model again")

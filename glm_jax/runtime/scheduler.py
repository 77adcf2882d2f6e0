"""The generation loop: a continuous-batching scheduler over a fixed-width batch of KV rows.

One loop serves everything: ``Engine.generate`` (one prompt or a list), ``Engine.stream`` and the HTTP server
(``glm_jax.serve.app``) submit ``Request``s to a ``Scheduler`` and drive (or let a thread drive) ``Scheduler.step``.

**Rows.**  The cache has ``max_batch`` rows (``--max_batch``), one per running request, each with its own KV
positions.  A request is admitted into a free row between decode dispatches, prefilled in chunks of at most
``--prefill_chunk`` tokens (one chunk per loop iteration, on its row alone: a width-1 program, so the prompt's
numbers do not depend on who else is running), then decodes together with the other rows.  A row that finishes
(EOS, a stop string, ``max_new_tokens``, the context limit, or a cancelled request) is freed at once.

**Batch invariance.**  Plain resident decode runs at the width of the running rows (the power-of-two bucket of
their number; ``decode_rows``), on a compact copy of their cache rows; a row's numbers are bitwise independent of
that width and of what the other rows hold (the native kernels are row-invariant; norms and softmaxes sum in a
fixed tree, ``model.layers.row_sum``), so a request's greedy output is the same alone, beside others, and at any
``max_batch`` (``tests/test_scheduler.py``).  Where that does not hold (``follows_rows``: --kernels=xla, DSA) every
decode runs at ``max_batch`` rows, one program.  The attention reads a window of the cache, ``[:S]`` with S the
power-of-two bucket (>= 64) covering every active row's positions (the masked tail adds exact zeros).

**Prefix cache.**  A finished row keeps its K/V and the tokens they belong to (``row_toks``); a request whose prompt
starts with them is admitted into that row and prefills only the rest (``Request.cached_tokens``; --prefix_cache).

**Decode.**  With every expert resident and no speculation, a dispatch is one compiled ``lax.while_loop`` of up
to ``FUSED_CHUNK`` decode steps of all rows with per-row on-device sampling (temperature / top-k / top-p / seed)
and per-row stops (EOS, budget).  With a streamed row the loop calls the host every ``--stream_interval`` steps
(``_on_steps``: tokens to the streams, stop strings / cancels stop their rows, a waiting request ends the dispatch)
and runs up to ``FUSED_CHUNK`` steps; otherwise as many as fit in ``--dispatch_ms`` at the measured step time
(tokens then reach streams between dispatches).  It runs 1 step instead while a newcomer is being prefilled or
waits for a free row, so admission and prefill interleave with the others' decode.  With an expert store (fetch=loop / callback)
each step is one batched forward: the store reads the union of the batch's experts once.  Speculative decoding
(``--mtp`` / ``--draft``) runs per row (``speculative.SpecRow``: draft, one verify forward on the row alone,
accept); at ``max_batch`` 1 it is the former loop, greedy output identical to plain decode.

**Context.**  A sequence (prompt + output) holds at most ``Runner.context_limit`` tokens (``max_position_embeddings``,
lowered by ``--max_seq_len``): a longer prompt is refused at submit naming both numbers, and generation stops there
with finish_reason "length".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
import weakref
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from .. import kernels
from .. import model as M
from ..errors import GlmJaxError
from ..kernels.formats import NATIVE_MAX_ROWS
from ..memory import trim
from .runner import (
    BIG_POS,
    GenerationResult,
    bucket,
    gather_rows,
    nonfinite_error,
    scatter_rows,
    window_cache,
    write_back,
)
from .prefix_store import PrefixStore
from .sampling import sample_rows
from .speculative import SpecRow, decode_width, draft_plan
from .stats import route_stats, routing_summary, store_stats
from .streaming import fused_applies, fused_banks, fused_finish, fused_forward, fused_state

FUSED_CHUNK = 32      # decode steps per dispatch of the compiled loop (at most; it stops when every row is done)
MIN_WINDOW = 64       # smallest attention window (cache positions)
# smallest prefill window: a prefix hit's suffix, a 1-token-cached prompt and the warm-up's prefills then share the
# programs of their bucket (seen on b: 16- and 64-token prefills at window 64 compiled in a server's first pass)
PREFILL_MIN_WINDOW = 128
# a prefill chunk of at most this many tokens (a prefix hit's new turn, a 1-token suffix) runs at this many rows, not
# the 16-row bucket: the padding rows' attention and dense products are most of a 1-token prefill
SHORT_PREFILL = 4
# a long streamed prompt's prefill segment (Runner.segment_steps) pauses after about this much of its work where other
# rows are decoding, and they take a decode step: one segment of a ~1900-token prompt's ~20 s in the GLM-4.5-Air
# slice's 0.3x box otherwise held every other row's next token for 1-1.5 s
SEGMENT_SLICE_S = 0.5


class QueueFull(GlmJaxError):
    """The scheduler's queue holds --max_queue requests already."""


class ContextLengthError(GlmJaxError):
    """A prompt that does not fit the context."""


@dataclasses.dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_on_eos: bool = True
    stop: tuple = ()           # stop strings (found across token boundaries; the text ends before them)


class TextStream:
    """Incremental detokenization, UTF-8 safe across token boundaries (a character split over tokens is held until
    complete), with stop strings: the text delivered never contains (a prefix of) a stop string."""

    def __init__(self, decode: Optional[Callable], stop: tuple = ()):
        self.decode = decode
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.toks = []
        self.prefix = self.read = 0
        self.text = ""           # stable decoded text (after a stop: cut before it)
        self.sent = 0            # characters of text delivered
        self.stopped = False

    def _decode_new(self):
        d = self.decode
        prev = d(self.toks[self.prefix:self.read])
        new = d(self.toks[self.prefix:])
        if len(new) > len(prev) and not new.endswith("\ufffd"):
            self.text += new[len(prev):]
            self.prefix, self.read = self.read, len(self.toks)

    def add(self, tokens) -> int:
        """Append tokens; returns how many of them count (all, or up to the one that completed a stop string)."""
        if self.decode is None:
            self.toks.extend(tokens)
            return len(tokens)
        if not self.stop:
            self.toks.extend(tokens)
            self._decode_new()
            return len(tokens)
        for i, t in enumerate(tokens):
            self.toks.append(t)
            before = len(self.text)
            self._decode_new()
            if len(self.text) > before:
                lo = max(0, before - self.hold)
                hits = [j for j in (self.text.find(s, lo) for s in self.stop) if j >= 0]
                if hits:
                    self.text = self.text[:min(hits)]
                    self.stopped = True
                    return i + 1
        return len(tokens)

    def delta(self, final: bool = False) -> str:
        """Text not yet delivered (holding back a possible stop-string prefix unless final)."""
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


_ids = itertools.count(1)


class Request:
    """One generation.  ``on_event(req, text_delta, tokens_delta, done)`` (optional) is called from the thread that
    drives the scheduler whenever tokens arrive and once at the end (``done`` True)."""

    def __init__(self, prompt_ids: list, sampling: Sampling, on_event: Optional[Callable] = None,
                 decode: Optional[Callable] = None):
        self.id = next(_ids)
        self.prompt = list(prompt_ids)
        self.sampling = sampling
        self.on_event = on_event
        self.out = []
        self.stream = TextStream(decode, sampling.stop)
        self.finish_reason = None
        self.error = None
        self.cancelled = False
        self.state = "queued"
        self.submitted = False
        self.row = None
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_first = self.t_done = None
        self.prefill_s = self.decode_s = 0.0
        self.forwards = 0
        self.pf_done = 0
        self.seg_run = None          # a prefill segment under way (Runner.segment_steps) and its positions
        self.seg_n = 0
        self.cached_tokens = 0       # prompt tokens whose KV a finished row still held (the prefix cache)
        # the prefix cache's tenant: K/V is reused only between requests of the same salt (the server's API key and
        # cache_salt), so a request's cached_tokens never measures another tenant's prompt
        self.salt = None
        self.done_event = threading.Event()
        self.spec = None
        self.plan = None
        self.spec_stats = {}
        self.store_prefill = None
        self.route_prefill = {}      # the routing counters when its prefill ended: its stats cover decode only
        self.hidden = []
        # a host-side logits processor (logit_bias, a grammar's token mask, logprobs: serve/constrain.py), or None:
        # a row with one is sampled on the host path (_sample_hosted) each step; rows without one are untouched
        self.processor = None

    @property
    def done(self) -> bool:
        return self.done_event.is_set()

    @property
    def text(self) -> str:
        return self.stream.text


IDLE_WAIT_S = 0.05       # serve_forever's wait for work when idle (a submit or cancel wakes it at once; a stop within this)


class Scheduler:
    def __init__(self, rt, max_batch: int = 1, prefill_chunk: int = 512, max_queue: int = 0,
                 dispatch_ms: float = 50.0, stream_interval: int = 1, prefix_cache: bool = True,
                 prefix_store_mb: float = 0.0):
        self.rt = rt
        self.stream_interval = int(stream_interval)      # --stream_interval
        self.prefix_cache = bool(prefix_cache)           # --prefix_cache
        self.row_toks = [[] for _ in range(int(max_batch))]  # per row: the tokens whose K/V it holds at 0..len-1
        self.row_salt = [None] * int(max_batch)              # per row: the salt of the request that left them
        self.row_freed = [0.0] * int(max_batch)          # when each row was last freed (LRU among free rows)
        self.kv_epoch = None                             # rt.kv_epoch the rows' contents belong to
        # K/V of sequences the rows no longer hold, in host RAM (--prefix_store_mb; not on a mesh)
        # (not with a recurrent state: the store keeps K/V positions, and a state cannot be cut back to a prefix)
        self.saved = (PrefixStore(int(prefix_store_mb * 1e6))
                      if prefix_store_mb > 0 and getattr(rt, "plan", None) is None and not rt.recurrent_state
                      else None)
        self.dispatch_s = float(dispatch_ms) / 1000.0   # a fused dispatch runs what fits in this (--dispatch_ms)
        self.step_s = None                               # measured seconds per fused decode step (EMA)
        self.B = int(max_batch)
        self.chunk = int(prefill_chunk)
        self.max_queue = int(max_queue)
        self.rows = [None] * self.B
        self.queue = collections.deque()
        self.lock = threading.Condition()
        self.keys = np.zeros((self.B, 2), np.uint32)
        self.pos = np.zeros(self.B, np.int64)        # where each row's pending token goes
        self.tok = np.zeros(self.B, np.int64)        # each row's pending token (sampled, not yet in the cache)
        self.counters = collections.Counter()        # requests / tokens / dispatches, for /metrics
        self.W = None
        self.step_lock = threading.Lock()            # one driver at a time
        self.serving = False                         # a thread runs serve_forever: others wait instead of stepping
        self._sink = None                            # kernels.StreamSink of the streamed fused loop (native_sink)
        self._missed = False                         # fetch=fused: the last optimistic dispatch ended at a miss
        self.kv_reserve = 0                          # a server's K/V positions per row, allocated up front

    # ------------------------------------------------------------------ submitting (any thread)
    def check(self, prompt_ids: list, sampling: Sampling):
        lim = self.rt.context_limit
        if len(prompt_ids) >= lim:
            raise ContextLengthError(f"the prompt is {len(prompt_ids)} tokens but the context limit is {lim} tokens "
                                     f"({self._limit_source()}), leaving no room to generate")

    def _limit_source(self) -> str:
        rt = self.rt
        if rt.opts["max_seq_len"] and rt.opts["max_seq_len"] < rt.cfg.max_position_embeddings:
            return f"{rt.opts.label('max_seq_len') if hasattr(rt.opts, 'label') else '--max_seq_len'}"
        return "max_position_embeddings in config.json"

    def submit(self, req: Request) -> Request:
        self.check(req.prompt, req.sampling)
        with self.lock:
            if self.max_queue and len(self.queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting; --max_queue)")
            self.queue.append(req)
            req.submitted = True
            self.counters["submitted"] += 1
            self.lock.notify_all()
        return req

    def cancel(self, req: Request):
        with self.lock:
            req.cancelled = True
            self.lock.notify_all()

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def busy(self) -> bool:
        return bool(self.queue) or any(r is not None for r in self.rows)

    # ------------------------------------------------------------------ driving
    def run(self, reqs: list):
        """Until every request in ``reqs`` is done: drive the loop in this thread, or wait for the thread that
        serves (``serve_forever``)."""
        stray = [r for r in reqs if not r.submitted]
        if stray:                 # (the loop would wait for them forever)
            raise GlmJaxError(f"Scheduler.run: {len(stray)} of the {len(reqs)} requests were never submitted "
                              f"(Scheduler.submit)")
        while not all(r.done for r in reqs):
            if self.serving:
                for r in reqs:
                    r.done_event.wait()
            else:
                self.step()

    def warmup(self, lengths: tuple = (72,)) -> tuple:
        """Compile, before the first client, what the first requests would otherwise compile while they wait: for a
        prompt of each of ``lengths`` tokens (72: the 128-position attention window, where a short chat turn with its
        template lands), its prefill and the decode program at every width the loop runs for 1, 2, 4, ... max_batch
        streamed requests (``decode_rows``) and for a non-streamed one, in the prompt's attention window and the next
        (its replies decode into the next window after ~56 tokens); then a prefix-cache hit's prefill, and the
        prefill of every other bucket from 32 tokens up to ``--prefill_chunk`` that fits the K/V cache as the rest
        left it (a server's: the planned length, ``kv_reserve``; else 256 positions, where a longer prompt would
        grow the cache, and with it every program).  Longer windows still
        compile on first use, and so does each real length of a prompt shorter than 16 tokens (its prefill
        computes the real rows' experts only); the persistent compile cache keeps all of them for the next start
        (but for programs holding a Python host callback: --fetch=callback / fused, meshes).  Everything it wrote
        is then forgotten (the rows' prefix knowledge, the counters), and the runner's ``warmed_up`` may drop the
        programs from memory again (a RAM budget streaming the experts: they come back from the compile cache on
        disk).  Returns (seconds compiling, seconds)."""
        t0, c0 = time.perf_counter(), self.rt.compile_s
        vocab = self.rt.cfg.vocab_size
        lim = self.rt.context_limit

        def batch(prompt, w, streamed=True, new_tokens=None, raise_error=True):
            """``w`` requests of ``prompt`` run to the end; the first one's error is raised, or returned (None)."""
            reqs = [Request(prompt, Sampling(max_new_tokens=w + 8 if new_tokens is None else new_tokens,
                                             stop_on_eos=False, seed=i),
                            on_event=(lambda *a: None) if streamed else None) for i in range(w)]
            for r in reqs:
                self.submit(r)
            self.run(reqs)
            err = next((r.error for r in reqs if r.error is not None), None)
            if err is not None and raise_error:
                raise err
            return err

        prompt = []
        for n in lengths:
            if n + 2 * self.B + 16 > lim:
                break
            prompt = [1 + i % max(1, vocab - 1) for i in range(n)]
            # decode into the next attention window too: a first dispatch reads the window of n + FUSED_CHUNK + 1
            # positions, a later one the next (a 72-token prompt's replies cross 128 at ~56 tokens; before, those
            # programs compiled while 1-8 clients waited: 1.9 s of a server's first 8-client pass on b)
            new = max(2 * self.B + 8, min(bucket(n + FUSED_CHUNK + 1, MIN_WINDOW) - n + 2, lim - n - 1))
            w = 1
            while True:
                batch(prompt, w, new_tokens=new)
                if w >= self.B:
                    break
                w = min(self.B, 2 * w)
            batch(prompt, 1, streamed=False, new_tokens=new)
        if self.prefix_cache and prompt:
            batch(prompt + [prompt[0]], 1)               # the prompt + 1 token: a row holds the rest
        if self.saved is not None and self.rt._cache is not None:
            # the prefix store's copy of a row's first positions out (save) and back (restore), for every bucket of
            # them (64, 128, ... the whole row): one small program each, compiled on a save or restore otherwise
            L = 64
            while True:
                self.rt.put_row(self.rt.take_row(0, L), 0)       # (row 0's K/V unchanged; forgotten below)
                if L >= self.rt._cache_len:
                    break
                L *= 2
        warmed = bucket(len(prompt)) if prompt else 0
        T = 32
        # the other prefill buckets (a first token, no decode) that fit the K/V the warm-up has made: a longer one
        # would grow it, and every program compiled so far is for its present length
        while T <= self.chunk and T + 2 <= min(lim, self.rt._cache_len):
            if T != warmed and batch([1 + (T + i) % max(1, vocab - 1) for i in range(T)],   # (no prefix of the others)
                                     1, streamed=False, new_tokens=1, raise_error=False) is not None:
                break                                    # (e.g. no room for its K/V: later requests will say so)
            T *= 2
        self.forget()
        self.counters.clear()
        self.rt.warmed_up()
        return self.rt.compile_s - c0, time.perf_counter() - t0

    def serve_forever(self, stop: threading.Event):
        """Drive the loop until ``stop`` is set (the server's engine thread); waits for work when idle."""
        self.serving = True
        worked = False
        try:
            while not stop.is_set():
                if self.busy():
                    self.step()
                    worked = True
                    continue
                with self.lock:            # checked under the lock: a submit's notify can't fall between the two
                    if not self.busy():
                        self.lock.wait(IDLE_WAIT_S)
                    idle = not self.busy()
                if idle and worked:        # idle for a whole wait: hand the requests' freed heap back to the OS
                    trim()                 # (not at once: a client's next request would wait for it)
                    worked = False
                    with self.step_lock:   # and what is free in the budget back to the expert cache
                        self.rt.memory_settled()
        finally:
            self.serving = False

    def step(self):
        """One iteration: free cancelled rows, admit, one prefill chunk, one decode dispatch."""
        with self.step_lock:
            self._step()

    def _step(self):
        self._reap()
        self._admit()
        pf = [r for r in self.rows if r is not None and r.state == "prefill"]
        if pf:
            req = min(pf, key=lambda r: r.t_admit)
            try:
                self._prefill_chunk(req)
            except Exception as e:
                self._fail(req, e)
                self._check_cache(e)
        dec = [r for r in self.rows if r is not None and r.state == "decode"]
        if dec:
            others_wait = any(r is not None and r.state == "prefill" for r in self.rows) or (
                bool(self.queue) and any(r is None for r in self.rows))
            try:
                self._decode(dec, 1 if others_wait else FUSED_CHUNK)
            except Exception as e:
                for r in dec:
                    if not r.done:
                        self._fail(r, e)
                self._check_cache(e)

    def _check_cache(self, e: Exception):
        """After a failed forward: a program that donated the K/V cache and failed inside (a host callback's expert
        read under fetch=callback) leaves it deleted; the rows still holding it fail too and the next request gets a
        new cache, instead of every later request failing on the deleted array."""
        leaves = jax.tree_util.tree_leaves(self.rt._cache)
        if not any(getattr(a, "is_deleted", lambda: False)() for a in leaves):
            return
        for r in self.rows:
            if r is not None and not r.done:
                self._fail(r, e)
        self.rt._cache = None
        self.rt.kv_epoch += 1

    # ------------------------------------------------------------------ rows
    def _reap(self):
        for i, r in enumerate(self.rows):
            if r is not None and r.cancelled and not r.done:
                self._finish(r, "cancelled")
        with self.lock:
            if any(r.cancelled for r in self.queue):
                keep = collections.deque()
                for r in self.queue:
                    if r.cancelled:
                        self._finish(r, "cancelled")
                    else:
                        keep.append(r)
                self.queue = keep

    def _admit(self):
        while True:
            with self.lock:
                free = [i for i, r in enumerate(self.rows) if r is None]
                if not free or not self.queue:
                    return
                req = self.queue.popleft()
            req.plan = draft_plan(self.rt)              # per request: the options may change between calls
            i = self._pick_row(free, req)
            s = req.sampling
            req.row, req.state, req.t_admit = i, "prefill", time.perf_counter()
            self.rows[i] = req
            self.counters["admitted"] += 1
            self.keys[i] = _seed_key(s.seed)
            if s.max_new_tokens == 0:
                self._finish(req, "length")
                continue
            try:
                self._make_room(len(req.prompt) + s.max_new_tokens)
            except Exception as e:
                self._fail(req, e)
                continue
            self._forget_if_replaced()
            m = self._match(i, req)
            if self.prefix_cache and self.saved is not None:
                m = self._use_saved(i, req, m)
            self.row_toks[i] = []                        # from here on the row is being rewritten
            req.pf_done = req.cached_tokens = m
            self.counters["cached_tokens"] += m

    def forget(self):
        """Drop the prefix cache's knowledge of the rows (their K/V is then never reused) and its saved copies."""
        self.row_toks = [[] for _ in range(self.B)]
        if self.saved is not None:
            self.saved.clear()

    def _use_saved(self, i: int, req, m: int) -> int:
        """Row ``i`` is about to be rewritten from position ``m`` on: first copy what it held beyond that to the
        prefix store; then, when a saved sequence shares a longer prefix with ``req``'s prompt than the row did,
        write that prefix's K/V into the row.  Returns the prompt tokens whose K/V the row now holds."""
        held = self.row_toks[i]
        if len(held) > m:
            self.saved.save(self.rt, i, held, salt=self.row_salt[i])
        if req.plan is not None:                         # speculation prefills the whole prompt (_match)
            return m
        key, ms = self.saved.best(req.prompt, len(req.prompt) - 1, salt=req.salt)
        if ms > m:
            self.saved.restore(self.rt, key, i, ms)
            return ms
        return m

    def _forget_if_replaced(self):
        if self.kv_epoch != self.rt.kv_epoch:            # a new cache, or another caller wrote its rows
            self.row_toks = [[] for _ in range(self.B)]
            self.kv_epoch = self.rt.kv_epoch

    def _match(self, i: int, req) -> int:
        """Prompt tokens whose K/V row ``i`` holds already (the longest common prefix, leaving at least the last
        prompt token to prefill: its logits give the first output token).  None under speculation (its drafter
        needs the whole prompt's hidden states)."""
        prompt = req.prompt
        if not self.prefix_cache or req.plan is not None or self.row_salt[i] != req.salt:
            return 0
        held = self.row_toks[i]
        n = min(len(held), len(prompt) - 1)
        m = 0
        while m < n and held[m] == prompt[m]:
            m += 1
        if m < len(held) and self.rt.recurrent_state:    # the state is the whole held sequence's, not a prefix's
            return 0
        return m

    def _pick_row(self, free: list, req) -> int:
        """A free row for ``req``: the one holding the longest prefix of its prompt; else the least recently freed
        (the others keep their finished requests' K/V for later turns)."""
        self._forget_if_replaced()
        return max(free, key=lambda i: (self._match(i, req), -self.row_freed[i]))

    def _make_room(self, need: int):
        rt = self.rt
        lim = rt.context_limit
        need = min(need, lim)
        if rt.opts["max_seq_len"]:
            cap = rt.opts["max_seq_len"]
        else:
            cap = min(bucket(need, 256), max(lim, 256))
            if self.kv_reserve and self._windowed():
                # a server: the positions the memory plan reserved, up front (llama-server's -c); growing the
                # cache later would recompile every program compiled for its old length while a client waits
                cap = max(cap, min(self.kv_reserve, lim))
        same = rt._cache is not None and rt._cache_batch == self.B
        if same and cap < rt._cache_len and rt.kv_give_back() and sum(r is not None for r in self.rows) <= 1:
            # a longer request grew the cache past the memory plan's reservation and no running row needs those
            # positions now (this newcomer's row is the only one taken): give them back (the rows keep their K/V
            # below), and the next refit hands what that frees to the expert cache (MemoryGuard.refit)
            keep = max(cap, bucket(rt.kv_reserve_tokens, 256))
            if keep < rt._cache_len:
                rt.shrink_cache(self.B, keep)
                self.row_toks = [t[:keep] if len(t) <= keep or not rt.recurrent_state else [] for t in self.row_toks]
        # the positions about to be allocated (a replaced cache is freed first), and the programs compiled since
        # the last check: the engine makes room in its budget before the prefill (MemoryGuard.memory_guard)
        rt.memory_guard(max(0, cap - rt._cache_len) if same else cap, self.B)
        if not same:
            if any(r is not None and r.state != "prefill" for r in self.rows):
                raise GlmJaxError("internal: the batch cache was replaced while rows were running")
            rt._new_cache(self.B, max(cap, rt._cache_len if rt._cache_batch == self.B else 0))
        elif cap > rt._cache_len:
            rt.grow_cache(self.B, cap)

    def _windowed(self) -> bool:
        """Decode reads a window of the cache (GQA, every expert resident): its cost does not grow with the cache's
        length (DSA and a streamed store's step run over the whole cache)."""
        return not self.rt.cfg.is_mla and not self.rt.backend.streamed

    def _window(self, end: int) -> int:
        return min(self.rt._cache_len, bucket(end, MIN_WINDOW))

    def _short_prefill(self) -> bool:
        """Whether a 1-4-token chunk may run at SHORT_PREFILL rows: where its rows' results are bitwise those of the
        16-row bucket (GQA, every expert resident; tested).  The streamed store's fused path gave other tokens from
        a 1-token suffix at 4 rows (b, fetch=fused: the 43rd greedy token), so it and MLA / DSA keep 16 rows."""
        return not self.rt.backend.streamed and self.rt.cfg.model_type == "glm4_moe"

    def _prefill_chunk(self, req: Request):
        rt = self.rt
        P = len(req.prompt)
        mtp = req.plan is not None and req.plan.source == "mtp"      # keeps every position's hidden state
        seg = None if mtp or req.seg_run is not None else rt.segment_tokens(P - req.pf_done, self.chunk)
        c0, t0 = rt.compile_s, time.perf_counter()
        if seg or req.seg_run is not None:
            # a long streamed prompt: up to seg[0] positions layer by layer (each expert read once a layer), paused
            # every SEGMENT_SLICE_S while other rows decode (they take a step in between: _step)
            if req.seg_run is None:
                req.seg_n = seg[0]
                req.seg_run = rt.segment_steps(req.prompt[req.pf_done:req.pf_done + seg[0]], req.pf_done, self.chunk,
                                               seg[1], row=req.row if self.B > 1 else None, slice_s=SEGMENT_SLICE_S)
            while True:
                try:
                    next(req.seg_run)
                except StopIteration as done:
                    logits, li = done.value
                    break
                except BaseException:
                    self._end_segment(req)
                    raise
                if any(r is not None and r.state == "decode" for r in self.rows):
                    req.prefill_s += time.perf_counter() - t0 - (rt.compile_s - c0)
                    return
            req.seg_run = None
            n = req.seg_n
            last = req.pf_done + n == P
            if last:
                rt.segment_done()
        else:
            n = min(self.chunk, P - req.pf_done)
            T = min(SHORT_PREFILL if n <= SHORT_PREFILL and self._short_prefill() else bucket(n), max(self.chunk, n))
            last = req.pf_done + n == P
            toks = np.zeros((1, T), np.int32)
            toks[0, :n] = req.prompt[req.pf_done:req.pf_done + n]
            lr = np.zeros((1, T), bool)
            if last:
                lr[0, n - 1] = True
            logits, hidden = rt.forward(toks, np.array([req.pf_done], np.int32), np.array([n], np.int32),
                                        logit_rows=lr, row=req.row if self.B > 1 else None,
                                        window=self._window(max(req.pf_done + T, PREFILL_MIN_WINDOW)))
            li = n - 1
            if mtp:
                req.hidden.append(hidden[0, :n])
        req.pf_done += n
        if last:
            i = req.row
            if req.processor is not None:
                tok, key = self._sample_hosted(logits[0, li][None], self.keys[i][None], [req], [0])
                tok, key = int(tok[0]), key[0]
            else:
                tok, key = _sample_one(rt, logits, li, self.keys[i], req.sampling)
            self.keys[i] = key
            req.prefill_s += time.perf_counter() - t0 - (rt.compile_s - c0)
            req.store_prefill = rt.store.stats() if rt.store is not None else None
            req.route_prefill = dict(rt._route_acc)
            req.t_first = time.perf_counter()
            req.state = "decode"
            self.pos[i], self.tok[i] = P, tok
            if self._deliver(req, [tok]):
                return
            if req.plan is not None and req.processor is None:
                s = req.sampling
                samp = dict(temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p))
                prompt_hidden = jnp.concatenate(req.hidden, 0) if req.hidden else None
                req.hidden = []
                req.spec = SpecRow(req.plan, rt, req.prompt, req.out, prompt_hidden,
                                   jnp.asarray(self.keys[i]), samp, self._eos(req))
        else:
            req.prefill_s += time.perf_counter() - t0 - (rt.compile_s - c0)

    def _eos(self, req) -> set:
        return set(self.rt.cfg.eos_token_ids) if req.sampling.stop_on_eos else set()

    def _budget(self, req) -> int:
        """Tokens this row may still generate (max_new_tokens, and the context limit)."""
        return min(req.sampling.max_new_tokens - len(req.out), self.rt.context_limit - (len(req.prompt) + len(req.out)))

    def _deliver(self, req: Request, toks: list) -> bool:
        """New tokens of a row: text, stop strings, stop conditions.  Returns True when the row finished."""
        n = req.stream.add(toks)
        toks = toks[:n]
        req.out.extend(toks)
        self.counters["tokens"] += len(toks)
        eos = self._eos(req)
        reason = None
        if req.stream.stopped or (toks and toks[-1] in eos):
            reason = "stop"
        elif self._budget(req) <= 0:
            reason = "length"
        if reason is not None:
            self._finish(req, reason, toks)
            return True
        if req.on_event is not None:
            req.on_event(req, req.stream.delta(), toks, False)
        return False

    def _finish(self, req: Request, reason: str, toks=()):
        if req.done:
            return
        failed = getattr(req.processor, "failed", None)
        if failed is not None and reason != "error":   # its constraint broke: the text ends invalid, not "stop"
            req.error, reason = failed, "error"
        req.finish_reason = reason
        self._end_segment(req)
        prev, req.state = req.state, "done"
        req.t_done = time.perf_counter()
        if req.row is not None and self.rows[req.row] is req:
            self.rows[req.row] = None
            i = req.row
            self.row_freed[i] = req.t_done
            if req.spec is None and req.plan is None and reason != "error" and self.kv_epoch == self.rt.kv_epoch:
                seq = req.prompt + req.out
                held = req.pf_done if prev == "prefill" else min(int(self.pos[i]), len(seq))
                self.row_toks[i] = seq[:held]
                self.row_salt[i] = req.salt
        if req.spec is not None:
            req.spec_stats = req.spec.stats()
            self.counters["drafts_proposed"] += req.spec_stats["drafts_proposed"]
            self.counters["drafts_accepted"] += req.spec_stats["drafts_accepted"]
        req.spec = None
        self.counters["finished_" + reason] += 1
        if req.on_event is not None:
            try:
                req.on_event(req, req.stream.delta(final=True), list(toks), True)
            except Exception:
                pass
        req.done_event.set()

    def _end_segment(self, req: Request):
        """A request that ends (cancelled, failed) inside a prefill segment: the segment's buffers go, and the engine
        may hand what the segment took back to the expert cache.  The row's K/V holds only what ``pf_done`` says."""
        if req.seg_run is not None:
            run, req.seg_run = req.seg_run, None
            run.close()
            self.rt.segment_done()

    def _fail(self, req: Request, e: Exception):
        req.error = self._cause(e)
        self._finish(req, "error")

    def _cause(self, e: Exception) -> Exception:
        """The store's own error for a compiled program whose host callback failed reading experts (fetch=fused /
        callback: XLA raises its runtime error around the callback's traceback, 74 lines); else ``e``."""
        take = getattr(getattr(self.rt, "store", None), "take_error", None)
        err = take() if take is not None else None
        return err if err is not None and not isinstance(e, GlmJaxError) else e

    # ------------------------------------------------------------------ decode
    def _decode(self, dec: list, n: int):
        rt = self.rt
        self.W = W = decode_width(rt)
        plain = [r for r in dec if r.spec is None and r.processor is None]
        hosted = [r for r in dec if r.spec is None and r.processor is not None]
        spec = [r for r in dec if r.spec is not None]
        c0, t0 = rt.compile_s, time.perf_counter()
        if rt.backend.streamed:                    # one batched forward for all of them (the store's union)
            plain, hosted = plain + hosted, []
        if plain:
            if not rt.backend.streamed or self._fused_streams(plain, W):
                self._fused(plain, n, W)
            else:
                self._one_step(plain, W)
        dt = time.perf_counter() - t0 - (rt.compile_s - c0)
        for r in plain:
            r.decode_s += dt
        if hosted:                # rows with a host-side logits processor: one step each dispatch, on the host path
            c0, t0 = rt.compile_s, time.perf_counter()
            self._one_step(hosted, W)
            dt = time.perf_counter() - t0 - (rt.compile_s - c0)
            for r in hosted:
                r.decode_s += dt
        for r in spec:
            c0, t0 = rt.compile_s, time.perf_counter()
            budget = self._budget(r)
            if self.B > 1:
                with rt.row_view(r.row):
                    new, fw = r.spec.step(budget)
            else:
                new, fw = r.spec.step(budget)
            r.forwards += fw
            r.decode_s += time.perf_counter() - t0 - (rt.compile_s - c0)
            self._deliver(r, new)

    def _rows_arrays(self, rows):
        B = self.B
        active = np.zeros(B, bool)
        temp = np.zeros(B, np.float32)
        topk = np.zeros(B, np.int32)
        topp = np.ones(B, np.float32)
        eos_on = np.zeros(B, bool)
        budget = np.zeros(B, np.int32)
        for r in rows:
            i = r.row
            s = r.sampling
            active[i] = True
            temp[i], topk[i], topp[i], eos_on[i] = s.temperature, s.top_k, s.top_p, s.stop_on_eos
            budget[i] = self._budget(r)
        return active, temp, topk, topp, eos_on, budget

    def follows_rows(self, W: int) -> bool:
        """Whether plain resident decode runs at the width of the running rows (the power-of-two bucket of their
        number: 1, 2, 4, 8, ...) rather than ``max_batch``: where every per-row number is bitwise independent of
        the width -- the native kernels (row-invariant by construction; float dense weights only up to
        ``formats.NATIVE_MAX_ROWS`` rows), GQA attention, norms and softmax summed by ``model.layers.row_sum``.  Elsewhere
        (--kernels=xla, DSA models) every decode keeps the one width, so the guarantee holds either way."""
        rt = self.rt
        return rt.kernel == "native" and not rt.cfg.is_mla and self.B * W <= NATIVE_MAX_ROWS

    def decode_rows(self, rows, W: int):
        """The rows a decode of ``rows`` runs on: None (every row, the full width), or their indices (sorted) padded
        with idle rows to the power-of-two bucket of their number (an idle row is padding: no K/V written)."""
        if not self.follows_rows(W):
            return None
        w = min(self.B, bucket(len(rows), 1))
        if w >= self.B:
            return None
        busy = sorted(r.row for r in rows)
        idle = [i for i in range(self.B) if i not in set(busy)]
        return np.asarray(busy + idle[:w - len(busy)], np.int32)

    def _fused_streams(self, rows, W: int) -> bool:
        """fetch=fused: whether these rows' decode runs as the compiled multi-step loop with the store called from
        inside it (every row plain -- no host-side logits processor --, the store's banks aliased, each step's
        union within one fetch); else one forward per step."""
        rt = self.rt
        if not rt.backend.fused_decode or any(r.processor is not None for r in rows):
            return False
        return fused_applies(rt, self.B, W, self._rows_arrays(rows)[0].astype(np.int32))

    def _fused_dispatch(self, rows, n: int, W: int, budget, streamed_store: bool):
        """The shape of a multi-step decode dispatch of ``rows``: (steps, the KV window, the rows it runs on (None:
        all), the streaming interval (0: none), the native sink or None, optimistic: the store's program without
        host calls)."""
        rt = self.rt
        # the host callback where someone reads tokens as they come (a stream; its stop strings, its cancel): the
        # loop then hands them over, stops rows and ends early for a newcomer itself, so it may run FUSED_CHUNK
        # steps; without it a dispatch runs what fits in --dispatch_ms.  A streamed dispatch of fewer steps (a
        # newcomer waits, a row's budget ends) runs the same program, in the window of FUSED_CHUNK steps: before, a
        # 1-step dispatch ran the unstreamed one and its own window, programs a server's warm-up had not compiled
        # (1.9 s of compiling in the first 8-client pass on b, at 1, 2, 4 and 8 rows)
        # Rows nobody streams take that path too where the native sink runs it (no Python call inside the loop): a
        # dispatch of one step (a 35 ms step of the GLM-4.5-Air slice against the 50 ms default) paid the KV window's
        # copy out and back and the host's turn around every token (slice bench, docs/real-scale.md)
        streamed = self.stream_interval > 0 and (any(r.on_event is not None for r in rows)
                                                 or self._native_sink() is not None)
        n = int(min(n, budget.max(), FUSED_CHUNK if streamed else self.steps_per_dispatch()))
        end = int(max(self.pos[r.row] for r in rows)) + (FUSED_CHUNK if streamed else n) + W
        # the store's path runs at max_batch over the whole cache, as fetch=loop's one step does (bitwise its output)
        window = self._window(end) if not rt.cfg.is_mla and not streamed_store else rt._cache_len
        rmap = None if streamed_store else self.decode_rows(rows, W)
        every = self.stream_interval if streamed else 0
        sink = self._native_sink() if every else None
        # the store's program without host calls first; after a dispatch it ended at a miss, the one with them,
        # until one of those runs without a miss (a cold cache: every optimistic try would end at its first step)
        optimistic = streamed_store and not rt.backend.prefetch and not self._missed
        return n, window, rmap, every, sink, optimistic

    def _fused(self, rows, n, W):
        rt = self.rt
        streamed_store = rt.backend.fused_decode
        active, temp, topk, topp, eos_on, budget = self._rows_arrays(rows)
        n, window, rmap, every, sink, optimistic = self._fused_dispatch(rows, n, W, budget, streamed_store)
        w = self.B if rmap is None else len(rmap)
        sel = slice(None) if rmap is None else rmap
        misses0 = _store_misses(rt)
        compiled = _fused_key(self.B, W, window, w, every, sink is not None, optimistic) in rt._jits
        fn = _fused_fn(rt, self.B, W, window, w, every, sink is not None, optimistic)
        live = dict(rows=[self.rows[int(i)] for i in (range(self.B) if rmap is None else rmap)],
                    sent=np.zeros(w, np.int64), pos0=self.pos.copy())
        if sink is not None:
            sink.reset(w, FUSED_CHUNK)
        else:
            rt._stream_sink = lambda out_, cnt_: self._on_steps(live, out_, cnt_)
        t0 = time.perf_counter()
        eos = sorted(rt.cfg.eos_token_ids) or [-1]
        pos = np.where(active, self.pos, BIG_POS).astype(np.int32)
        extra = () if rmap is None else (np.asarray(rmap, np.int32),)
        params = (rt.params, fused_banks(rt)) if streamed_store else rt.step_params()
        # what changes from step to step besides the cache: the store's state (streamed) or the resident masks
        state = fused_state(rt, FUSED_CHUNK, w, W) if streamed_store else rt.resident_masks_np()
        # the per-row arguments as numpy arrays of their dtypes, handed to the program as they are: jnp.asarray of
        # each ran a small conversion program, ~2 ms of every dispatch on b (12 of them, cProfile)
        rt._cache, out, cnt, keys, acc, state = fn(params, rt._cache, np.asarray(self.tok[sel], np.int32),
                                            np.asarray(pos[sel], np.int32), np.asarray(self.keys[sel], np.uint32),
                                            np.asarray(temp[sel], np.float32), np.asarray(topk[sel], np.int32),
                                            np.asarray(topp[sel], np.float32), np.asarray(eos_on[sel], np.bool_),
                                            np.asarray(budget[sel], np.int32), np.int32(n),
                                            np.asarray(eos, np.int32), state,
                                            np.int32(sink.slot if sink is not None else 0), *extra)
        if sink is not None:                              # the loop runs on: stream what it hands over meanwhile
            self._drain_sink(sink, live, cnt)
        # every result the host reads, in one transfer: a bool() / np.asarray / float() of each array was a device
        # round trip each (~0.1-0.2 ms apiece, a dozen a dispatch with the routing stats)
        out, cnt, keys, acc, state = jax.device_get((out, cnt, keys, acc, state))
        cnt = np.asarray(cnt)
        if rmap is not None:                              # back to row order
            full = np.zeros(self.B, cnt.dtype)
            full[rmap] = cnt
            cnt = full
        finite = bool(acc.pop("_finite"))
        steps = int(acc.pop("_steps"))
        if streamed_store:
            fused_finish(rt, state, steps)
            if optimistic:
                self._missed = bool(state["miss"])
                self.counters["optimistic_misses"] += self._missed
            else:
                self._missed = _store_misses(rt) > misses0
        # a first call's time is mostly its compilation; an optimistic dispatch that ended at a miss also spent a
        # rolled-back step (the store's program is timed with its misses: a cold cache's dispatches were else never
        # timed, so each ran one step, every step paying the Python dispatch of a program with host calls)
        if compiled and steps and not (optimistic and self._missed):
            self.observe_step((time.perf_counter() - t0) / steps)
        if not finite:
            r = rows[0]
            p0 = int(live["pos0"][r.row])
            raise nonfinite_error(rt, p0, p0 + int(cnt[r.row]) - 1)
        rt._accumulate(acc)
        out = np.asarray(out)
        if rmap is None:
            self.keys = np.array(keys, np.uint32)
        else:
            self.keys[rmap] = np.asarray(keys, np.uint32)
            full = np.full((out.shape[0], self.B), -1, out.dtype)
            full[:, rmap] = out
            out = full
        self.counters["dispatches"] += 1
        self.counters["decode_steps"] += steps
        self._fused_deliver(rows, out, cnt, sel, live)

    def _fused_deliver(self, rows, out, cnt, sel, live):
        """A dispatch's tokens (``out`` [steps, B], ``cnt`` [B] per row, in row order) to their requests, past what
        the loop streamed already (``live["sent"]``)."""
        sent = np.zeros(self.B, np.int64)
        sent[sel] = live["sent"]
        for r in rows:
            i = r.row
            c = int(cnt[i])
            toks = [int(t) for t in out[:c, i]]
            r.forwards += c
            if c:
                self.pos[i] = live["pos0"][i] + c
                self.tok[i] = toks[-1]
                if not r.done and not r.cancelled and c > sent[i]:   # (a stop the loop saw late: no more tokens)
                    self._deliver(r, toks[sent[i]:])

    def _native_sink(self):
        """The native stream sink (``kernels.StreamSink``) where it applies -- one process, one device, the native
        library built --, else None (the loop calls Python through ``io_callback``)."""
        if self._sink is None:
            ok = getattr(self.rt, "plan", None) is None and jax.process_count() == 1 and kernels.available()
            self._sink = kernels.StreamSink() if ok else False
            if ok:
                weakref.finalize(self, self._sink.close)
        return self._sink or None

    def _drain_sink(self, sink, live, result):
        """While the dispatched loop runs: take each snapshot it hands over (``sink.wait``, the GIL released), stream
        it (``_on_steps``) and answer with the stop / break flags, until its final call -- or, should the program
        end without one (it failed), until its ``result`` is ready."""
        try:
            while True:
                new, done = sink.wait(0.05)
                if new:
                    stop, brk = self._on_steps(live, sink.out, sink.cnt)
                    sink.set(stop, bool(brk))
                if done or (not new and result.is_ready()):
                    return
        except BaseException:
            sink.set(np.ones(len(live["rows"]), bool), True)   # stop the loop, then let the error through
            raise

    def _on_steps(self, live, out, cnt):
        """Inside a running fused dispatch (each snapshot of the stream sink, or the host callback, every
        --stream_interval steps): hand each row's new tokens to its stream.  Returns (stop [w]: rows the loop must stop -- finished on the host (a stop string),
        cancelled, or gone; break: a request waits for a free row, so end the dispatch now and admit it)."""
        out, cnt = np.asarray(out), np.asarray(cnt)
        stop = np.zeros(len(cnt), bool)
        for j, r in enumerate(live["rows"]):
            if r is None:
                continue
            c, i = int(cnt[j]), r.row
            if not r.done and c > live["sent"][j]:
                self.pos[i] = live["pos0"][i] + c
                self.tok[i] = int(out[c - 1, j])
                self._deliver(r, [int(t) for t in out[live["sent"][j]:c, j]])
                live["sent"][j] = c
            stop[j] = r.done or r.cancelled
        brk = bool(self.queue) and any(x is None for x in self.rows)
        return stop, np.bool_(brk)

    def steps_per_dispatch(self) -> int:
        """Decode steps the next fused dispatch may run: as many as fit in ``--dispatch_ms`` at the measured step
        time (1 until a step has been timed), at most ``FUSED_CHUNK``.  Tokens reach their streams and cancelled
        rows are freed between dispatches, so this bounds both."""
        if self.dispatch_s <= 0 or self.step_s is None:
            return 1
        return max(1, min(FUSED_CHUNK, int(self.dispatch_s / self.step_s)))

    def observe_step(self, seconds: float):
        self.step_s = seconds if self.step_s is None else 0.5 * self.step_s + 0.5 * seconds

    def _one_step(self, rows, W):
        """One decode step of every row: one batched forward (the expert store reads the batch's union once)."""
        rt = self.rt
        active, temp, topk, topp, eos_on, budget = self._rows_arrays(rows)
        toks = np.zeros((self.B, W), np.int32)
        toks[:, 0] = np.where(active, self.tok, 0)
        start = np.where(active, self.pos, BIG_POS).astype(np.int32)
        logits, _ = rt.forward(toks, start, active.astype(np.int32))
        if any(r.processor is not None for r in rows):
            nxt, keys = self._sample_hosted(logits[:, 0], self.keys, rows, [r.row for r in rows])
        else:
            # the first position's logits taken inside the program, the host's arrays handed over as numpy: an
            # eager slice and four jnp.asarray were a dispatch each, every step of a streamed decode
            samp = rt._jit("sample_rows_first", lambda lg, *a: sample_rows(lg[:, 0], *a))
            nxt, keys = samp(logits, self.keys, temp, topk, topp)
        nxt = np.asarray(nxt)
        keys = np.array(keys, np.uint32)
        self.keys[active] = keys[active]
        self.counters["dispatches"] += 1
        self.counters["decode_steps"] += 1
        for r in rows:
            i = r.row
            r.forwards += 1
            self.pos[i] += 1
            self.tok[i] = int(nxt[i])
            self._deliver(r, [int(nxt[i])])

    def _sample_hosted(self, logits, keys, reqs, idx):
        """Sample rows ``idx`` of logits [n, V] (on the device) whose requests ``reqs`` have host-side processors:
        each row's logits come to the host, its processor edits them (logit_bias, a grammar's mask), then the same
        ``sample_rows`` as every other row samples them with the row's key and settings, and the processor sees the
        token (its grammar advances; logprobs of the edited logits are recorded).  Returns (tokens [n], keys [n, 2])."""
        lg = np.array(logits, np.float32)
        n = lg.shape[0]
        temp, topk, topp = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
        for r, i in zip(reqs, idx):
            s = r.sampling
            temp[i], topk[i], topp[i] = s.temperature, s.top_k, s.top_p
            if r.processor is not None:
                lg[i] = r.processor.process(lg[i])
        samp = self.rt._jit("sample_rows", sample_rows)
        nxt, nkeys = samp(lg, np.asarray(keys, np.uint32), temp, topk, topp)     # numpy: transferred by the call
        nxt = np.asarray(nxt)
        for r, i in zip(reqs, idx):
            if r.processor is not None:
                r.processor.accept(lg[i], int(nxt[i]))
        return nxt, np.array(nkeys, np.uint32)

    # ------------------------------------------------------------------ results
    def result(self, req: Request, compile0: float = 0.0):
        """The ``GenerationResult`` of a finished request (stats as the one-prompt loop reported them)."""
        rt = self.rt
        if req.error is not None:
            raise req.error
        n_dec = max(len(req.out) - 1, 0)
        stats = {
            "prefill_tokens": len(req.prompt), "prefill_s": req.prefill_s, "cached_tokens": req.cached_tokens,
            "decode_tokens": n_dec, "decode_s": req.decode_s,
            "decode_tok_s": (n_dec / req.decode_s) if req.decode_s > 0 and n_dec else 0.0,
            "new_tokens": len(req.out), "forwards": req.forwards,
            "tokens_per_forward": (n_dec / req.forwards) if req.forwards else 0.0,
            "fetch": rt.opts["fetch"], "compile_s": rt.compile_s - compile0,
            "dtype": jnp.dtype(rt.dtype).name, "kv_dtype": jnp.dtype(rt.kv_dtype).name,
            "checkpoint_dtype": rt.checkpoint_dtype, "kernels": rt.kernel,
            "max_batch": self.B, "finish_reason": req.finish_reason,
            "ttft_s": (req.t_first - req.t_submit) if req.t_first else 0.0,
        }
        stats.update(req.spec_stats)
        stats.update(route_stats({k: v - req.route_prefill.get(k, 0.0) for k, v in rt._route_acc.items()}))
        if rt.store is not None:
            stats.update(store_stats(rt.store.stats(), req.store_prefill, n_dec))
        text = req.stream.text if rt.tokenizer is not None else ""
        return GenerationResult(tokens=list(req.out), text=text, stats=stats, prompt_tokens=list(req.prompt),
                                finish_reason=req.finish_reason)


# ----------------------------------------------------------------------------- compiled pieces
def _first_token(logits, t, key, temperature, top_k, top_p):
    tok, keys = sample_rows(jax.lax.dynamic_index_in_dim(logits[0], t, 0, keepdims=True), key[None], temperature,
                            top_k, top_p)
    return tok[0], keys[0]


def _sample_one(rt, logits, t: int, key, s: Sampling):
    """The first token of a row from its prefill's logits [1, T, V] at position ``t``, with the row's key: one
    dispatch and one transfer (the slicing, the parameters' transfers and the indexing were eager ops of their own,
    ~2 ms of a short request's time to first token).  Returns (token, key)."""
    f = rt._jit("first_token", _first_token)
    tok, key = jax.device_get(f(logits, np.int32(t), np.asarray(key, np.uint32),
                                np.asarray([s.temperature], np.float32), np.asarray([s.top_k], np.int32),
                                np.asarray([s.top_p], np.float32)))
    return int(tok), np.array(key, np.uint32)


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int) -> np.ndarray:
    """jax.random.PRNGKey(seed) as uint32 numpy, remembered per seed (an eager dispatch per admission otherwise);
    read-only (callers copy it into their key rows)."""
    k = np.asarray(jax.random.PRNGKey(seed), np.uint32)
    k.setflags(write=False)
    return k


def _store_misses(rt) -> int:
    return getattr(rt.store, "_stats", {}).get("misses", 0) if rt.store is not None else 0


def _fused_key(B: int, W: int, window: int, w: Optional[int] = None, every: int = 0, sink: bool = False,
               optimistic: bool = False):
    return ("fused_decode", B, W, window, B if w is None else w, every, bool(sink), bool(optimistic))


def _fused_fn(rt, B: int, W: int, window: int, w: Optional[int] = None, every: int = 0, sink: bool = False,
              optimistic: bool = False):
    """jit: up to ``n`` decode steps of every active row, on the device: step at [B, W] (row b's pending token at
    column 0, the rest padding) over the cache window [:window] -> per-row sampling -> per-row stop (EOS when the
    row stops at EOS, its budget).  Returns (cache, tokens [FUSED_CHUNK, B], counts [B], keys, stats).
    ``w`` < B: the program runs on w rows of the cache (a last argument ``rmap`` [w]: which; gathered once, the
    loop runs at [w, W], written back at the end); the per-row arguments and results are then [w].
    ``every`` > 0: every that many steps the loop hands the tokens so far to the host, which streams them and may
    stop rows or the loop: with ``sink`` through the native stream sink (``kernels.sink_call``; an int32 ``slot``
    argument names the scheduler's ``StreamSink``, drained by ``Scheduler._drain_sink``), else through
    ``io_callback`` -> ``rt._stream_sink`` (the scheduler's ``_on_steps``).
    ``optimistic`` (fetch=fused): the store's program without a host call (``streaming.fused_forward``): a step
    that meets an expert outside the cache is rolled back (its tokens, counts, keys, stats, store state) and ends
    the loop with the returned state's ``miss`` set; the scheduler runs the next dispatch with the store's calls."""
    w = B if w is None else w
    key_ = _fused_key(B, W, window, w, every, sink, optimistic)
    f = rt._jits.get(key_)
    if f is not None:
        return f
    compact = w < B
    B = w
    cfg = rt.cfg
    plugin = rt.plugin or M.identity_plugin
    want_stats = rt.plugin is not None
    full_window = window >= rt._cache_len

    # fetch=fused: experts from the store, fetch=loop's ops with the store called from inside
    # (streaming.fused_forward); params = (the params pytree, the MoE layers' banks); ``resident`` is then the
    # store's state (fused_state: slot maps, resident masks, the routing log its bookkeeping is replayed from),
    # carried step to step
    fwd = (fused_forward(rt, B, W, 1 if (B == 1 and 1 < W <= 16) else None, optimistic)
           if rt.backend.fused_decode else None)

    def one(params, part, tok, pos, active, resident):
        toks = jnp.zeros((B, W), jnp.int32).at[:, 0].set(tok)
        start = jnp.where(active, pos, BIG_POS)
        if fwd is not None:
            logits, _, part, summ, resident = fwd(params[0], params[1], part, toks, start,
                                                  active.astype(jnp.int32), resident)
            return logits[:, 0], part, dict(summ), resident
        logits, _, part, routing = M.step(cfg, params, part, toks, start, active.astype(jnp.int32), resident,
                                          plugin, moe_rows=1 if B == 1 else None)
        return logits[:, 0], part, dict(routing_summary(routing, want_stats)), resident

    def f(params, cache, tok, pos, keys, temp, topk, topp, eos_on, budget, n, eos, resident, slot, rmap=None):
        if compact:
            part = gather_rows(cache, rmap, None if full_window else window)
        else:
            part = cache if full_window else window_cache(cache, None, window)
        active = budget > 0
        shapes = jax.eval_shape(one, params, part, tok, pos, active, resident)[2]
        acc0 = {k: jnp.zeros(a.shape, a.dtype) for k, a in shapes.items()}
        acc0["_finite"] = jnp.bool_(True)
        acc0["_steps"] = jnp.int32(0)

        def body(c):
            lg, part, summ, res = one(params, c["part"], c["tok"], c["pos"], c["active"], c["res"])
            act = c["active"]
            nxt, nkeys = sample_rows(lg, c["keys"], temp, topk, topp)
            cnt = c["cnt"] + act
            stop = (eos_on & jnp.any(nxt[:, None] == eos[None, :], -1)) | (cnt >= budget)
            acc = {k: c["acc"][k] + v for k, v in summ.items()}
            acc["_finite"] = c["acc"]["_finite"] & jnp.all(jnp.where(act[:, None], jnp.isfinite(lg), True))
            acc["_steps"] = c["acc"]["_steps"] + 1
            out = c["out"].at[c["i"]].set(jnp.where(act, nxt, -1))
            brk = c["brk"]
            ok = ~res["miss"] if optimistic else True      # an optimistic step that met a miss is rolled back
            if every:
                due = ok & acc["_finite"] & ((c["i"] + 1) % every == 0) & (c["i"] + 1 < n)
                shapes = (jax.ShapeDtypeStruct((B,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.bool_))
                to_host = ((lambda: kernels.sink_call(slot, out, cnt)) if sink else
                           (lambda: io_callback(lambda o, k: rt._stream_sink(o, k), shapes, out, cnt, ordered=True)))
                host = jax.lax.cond(due, to_host, lambda: (jnp.zeros((B,), jnp.bool_), jnp.bool_(False)))
                stop, brk = stop | host[0], host[1]
            new = dict(tok=jnp.where(act, nxt, c["tok"]), pos=c["pos"] + act,
                       keys=jnp.where(act[:, None], nkeys, c["keys"]), active=act & ~stop, cnt=cnt, i=c["i"] + 1,
                       out=out, acc=acc, brk=brk, res=res)
            if optimistic:      # (the K/V this step wrote sits at the positions the step will write again)
                old = {k: c[k] for k in new}
                new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
                new["brk"] = new["brk"] | res["miss"]
                new["res"] = dict(new["res"], miss=res["miss"])
            return dict(new, part=part)

        c = jax.lax.while_loop(
            lambda c: (c["i"] < n) & jnp.any(c["active"]) & c["acc"]["_finite"] & ~c["brk"], body,
            dict(part=part, tok=tok, pos=pos, keys=keys, active=active, cnt=jnp.zeros((B,), jnp.int32),
                 i=jnp.int32(0), out=jnp.full((FUSED_CHUNK, B), -1, jnp.int32), acc=acc0, brk=jnp.bool_(False),
                 res=resident))
        if sink:                                          # the host's last snapshot: every token, and the end
            kernels.sink_call(slot, c["out"], c["cnt"], final=True)
        if compact:
            cache = scatter_rows(cache, c["part"], rmap)
        else:
            cache = c["part"] if full_window else write_back(cache, c["part"], None)
        return cache, c["out"], c["cnt"], c["keys"], c["acc"], c["res"]

    f = rt._jits[key_] = jax.jit(f, donate_argnums=(1,))
    return f

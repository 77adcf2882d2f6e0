"""The memory guard: keeps a run with a RAM budget inside its memory plan (fit.py) after the load -- the refits
that hand what is measured free to the expert cache, the guard before a request's prefill (the KV cache's growth and
its compile taken back from the cache, or the request refused), the room a streamed compile or a long prompt's
segment needs, the programs dropped where they come back from the compile cache on disk.  The Engine facade owns
one (``Engine.guard``) and answers the runner's memory hooks through it; a run without a fitted store, or with an
explicit --cache_cap, keeps no plan and every call is a no-op.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .. import fit, memory
from .. import model
from ..experts.store import RamBudgetError
from .speculative import draft_plan
from .streaming import moe_call_bytes, segment_bytes, segment_width

SEGMENT_MAX = 2048     # a long prompt's prefill segment (segment_tokens; llama.cpp's default -b)


class MemoryGuard:
    """The engine's memory plan kept at run time.  ``fitted``: the load's memory plan (engine._Fitted) where a fitted
    store streams the experts, else None; the engine's cache, store and options are read through ``engine``."""

    def __init__(self, engine, fitted=None):
        self.engine = engine
        self._fit = fitted
        self._refit_pending = fitted is not None   # the first generation's refit (refit)

    @property
    def store(self):
        return self.engine.store

    @property
    def opts(self):
        return self.engine.opts

    @property
    def _cache(self):
        return self.engine._cache

    def _kv_bytes(self) -> int:
        return self.engine._kv_bytes()

    def refit(self):
        """After the first generation (its programs compiled): what the compile's working memory took is
        measured, and the part of the workspace reserve it left free goes to the expert cache (fit.py).  Again
        after any generation that found the cache shrunk by ``memory_guard``: what is measured free then goes
        back to it, up to what was taken."""
        if self._kept_plan() is None:
            return
        first, taken = self._refit_pending, self.store.sizing.get("taken", 0)
        lowered = self.store.round_limit is not None
        if not first and taken <= 0 and not lowered:
            return
        self._refit_pending = False
        self.store.release_transient()           # the generation is done: nothing in flight reads a bank
        memory.trim()
        # the working set memory_guard lowered goes back to the opened one where that fits what is measured free
        if lowered and self._free_bytes(0, self._later_compile(), self.store.max_working_set) >= 0:
            self._set_working_set(self.store.max_working_set)
        free = self._free_bytes(0, self._later_compile())
        if not first:
            free = min(free, taken * self.store.sizing.get("per_cap_bytes", 0))
        self.store.grow_cap(free)

    def warmed_up(self):
        """Runner.warmed_up (the end of glm-jax-serve's warm-up): where a RAM budget streams the experts through
        the Python layer loop and the persistent compilation cache holds every program the warm-up compiled, those
        programs leave memory, and the refit hands what they held to the expert cache.  A program comes back from the
        cache on disk at its first use (0.6-0.7 s of the first request in the GLM-4.5-Air slice's 0.3x box), and only
        the ones the requests use come back.  There, kept, the warm-up's programs held ~130 MB and left the cache at
        1-2 experts a layer (decode 12-14 tok/s); dropped, 8 after the warm-up (22-23 tok/s), and glm-jax-serve's
        time a token at one client fell from 64-75 to 40 ms (docs/real-scale.md, memory guard).  Programs holding a
        Python host callback (fetch=callback / fused, meshes) cannot come back from the cache and stay, and so do
        all where the cache holds every expert."""
        if self._kept_plan() is None:
            return
        if (self.engine.backend.shared_programs and self.engine.plan is None and jax.config.jax_compilation_cache_dir
                and not self.store.can_hold_all()):
            self.drop_programs()
        self.refit()

    def drop_programs(self):
        """Every compiled program out of memory (each compiles again, or comes back from the compile cache on disk,
        at its next use), the streamed forwards' shapes forgotten with them (before_new_shapes makes room again),
        and the freed heap handed back to the OS."""
        jax.clear_caches()
        self.engine._shapes_run.clear()
        memory.trim()

    def _kept_plan(self):
        """The memory plan this run keeps to (a fitted store without an explicit --cache_cap), else None."""
        f = getattr(self, "_fit", None)
        return f if f is not None and self.store is not None and not self.opts["cache_cap"] else None

    def kv_give_back(self) -> bool:
        return self._kept_plan() is not None

    def _set_working_set(self, w: int):
        """The store fetches at most ``w`` experts at a time (ExpertStore.limit_rounds) and the kept plan's inputs
        count that working set's buffers (fit.with_working_set)."""
        w = min(int(w), int(self.store.max_working_set or w))
        self._fit.inputs = fit.with_working_set(self._fit.inputs, w)
        self.store.limit_rounds(w)

    def _free_bytes(self, grow: int, later: int, working_set: Optional[int] = None) -> int:
        """fit.refit_free as measured now, the KV cache about to grow by ``grow`` bytes and ``later`` kept free for
        compiling: the one measurement of the refit, the guard and before_new_shapes.  ``working_set``: as if the
        store fetched that many experts at a time (_set_working_set)."""
        f = self._kept_plan()
        inp = f.inputs if working_set is None else fit.with_working_set(f.inputs, working_set)
        return fit.refit_free(inp, f.plan, self._private_bytes() + grow, self._kv_bytes() + grow,
                            self.store.cache_cap, later=later)

    def _private_bytes(self) -> int:
        """The process's private memory with the expert cache counted full: the slots of a cap grown since they
        were filled take their pages as experts are read (ExpertStore.unfilled_bytes)."""
        return memory.private_bytes() + self.store.unfilled_bytes()

    def _later_compile(self) -> int:
        """What the budget keeps free between requests for programs not compiled yet.  fetch=loop without
        speculation compiles only where a forward's shapes are new (Runner.before_new_shapes), and takes
        fit.LATER_COMPILE back from the expert cache right then, so between requests it keeps only
        fit.LATER_COMPILE_WARM (the sampler's programs of a new case): in the GLM-4.5-Air slice's 0.3x box that is
        2-3 more experts a layer (docs/real-scale.md, memory guard).  fetch=fused's programs also follow the
        attention window, which grows during a decode, and speculation's drafts their sampling parameters: they
        keep fit.LATER_COMPILE free throughout."""
        loop = self.engine.backend.shared_programs and draft_plan(self.engine) is None
        return fit.LATER_COMPILE_WARM if loop else fit.LATER_COMPILE

    def before_new_shapes(self):
        """Runner.before_new_shapes: a streamed forward about to compile its programs.  Where the budget keeps only
        fit.LATER_COMPILE_WARM free between requests, the expert cache gives back what makes fit.LATER_COMPILE
        free first (the cap lowered; the next generation's refit hands it back)."""
        if self._kept_plan() is not None and self._later_compile() != fit.LATER_COMPILE:
            self._keep_free(0, fit.LATER_COMPILE)

    def segment_tokens(self, remaining: int, chunk: int):
        """Runner.segment_tokens: a streamed prompt longer than two chunks, whose experts do not all stay in the
        cache, is prefilled in segments of up to SEGMENT_MAX positions layer by layer (each expert read once a
        segment a layer, streaming.segment_steps).  Within a RAM budget a segment holds its buffers
        (streaming.segment_bytes) in what the budget has free with the expert cache at its floor, and its MoE calls'
        scratch (moe_call_bytes, their width lowered to fit) in what the plan keeps free for one prefill chunk's
        activations (fit.chunk_acts: its attention blocks run at that chunk, never beside a MoE call).  The cache gives
        that back first (``_keep_free``), and ``segment_done``'s refit returns it.  None (chunk by chunk) where that is
        not two chunks, on a mesh, or with every expert resident."""
        st = self.store
        if (st is None or self.engine.plan is not None or not self.engine.backend.segments or st.can_hold_all()
                or remaining < 2 * chunk):
            return None
        item = jnp.dtype(self.engine.dtype).itemsize
        seg = min(int(remaining), SEGMENT_MAX)
        kept = self._kept_plan()
        if kept is None:
            return seg, segment_width(self.engine.cfg, chunk)
        # its attention blocks run a prefill chunk's programs (Runner.forward's shapes): where those have not run
        # at this cache length, one chunk goes first and compiles them beside no segment (the GLM-5.2 slice's first
        # segment compiling them in its 0.3x box took 9.8 s where the chunk's compile takes ~3 s)
        engine = self.engine
        if engine._stream_shapes(1, chunk, None, engine._cache_batch > 1, False) not in engine._shapes_run:
            return None
        acts = fit.chunk_acts(kept.inputs, kept.plan)
        width = segment_width(self.engine.cfg, chunk, acts)
        beyond = max(0, moe_call_bytes(self.engine.cfg, width) - acts)
        # its own programs (streaming._seg_fns) compile at the first segment: 0.3-0.9 s, and they hold ~3 MB
        # (measured in-process on the GLM-4.5-Air slice), within what the budget keeps free between requests;
        # reserving fit.LATER_COMPILE for them left no segment room in that slice's 0.3x box
        later = self._later_compile()
        room = self._free_bytes(0, later) + st.shrink_room() - beyond
        while seg >= 2 * chunk and segment_bytes(self.engine.cfg, seg, width, item) > room:
            seg //= 2
        if seg < 2 * chunk:
            return None
        self._keep_free(0, later, transient=segment_bytes(self.engine.cfg, seg, width, item) + beyond)
        return seg, width

    def segment_done(self):
        if self._kept_plan() is not None and not self._refit_pending:
            self.refit()

    def memory_guard(self, kv_positions: int = 0, rows: int = 1):
        """Before a request's prefill (the scheduler's admission): keep the process inside its RAM budget when the
        run outgrows its memory plan -- the KV cache about to grow by ``kv_positions`` x ``rows`` past what the
        plan reserved, or the programs compiled since the last refit (other prompt buckets, longer attention
        windows: each keeps its code) -- by taking the deficit back from the expert cache (``shrink_cap``) while
        keeping what ``_later_compile`` says free for the next compile.  Without it a long prompt in a tight memory
        cgroup drove the process into reclaiming its own code pages while compiling (docs/real-scale.md, memory guard).
        Where the growth and its compile do not fit even with the cache at one expert a layer, the request is
        refused (RamBudgetError, one line; nothing changed): 8 rows of glm-jax-serve grown for a ~920-token prompt,
        and 2 rows for a ~1900-token one, in the GLM-4.5-Air slice's 0.3x box were OOM-killed.
        A no-op for a run without a fitted store or with an explicit --cache_cap."""
        if self._kept_plan() is None:
            return
        per = model.kv_bytes_per_token(self.engine.cfg, jnp.dtype(self.engine.kv_dtype).itemsize)
        grow = max(0, int(kv_positions)) * int(rows) * per
        # a streamed prefill on one row of several: fetch=loop's layers work on one layer's slice of that row at a
        # time (streaming.loop_step's row), the whole-model programs on a copy of the row's every layer
        # (Runner.row_view), held beside the cache through the prefill and its compile.  That copy took a
        # 2600-token prompt of 2 rows in the GLM-4.5-Air slice's 0.3x box 50 MB past its budget, and its compile
        # 270 s with the cgroup at its limit
        view = (self.engine._cache_len + max(0, int(kv_positions))) * per if self.engine._cache_batch > 1 else 0
        if self.engine.backend.row_in_place:
            view //= max(1, self.engine.cfg.num_hidden_layers)
        self._keep_free(grow, self._later_compile(), refuse=(kv_positions, rows) if grow else None, transient=view)

    def _keep_free(self, grow: int, later: int, refuse=None, transient: int = 0):
        """memory_guard and before_new_shapes: the expert cache gives back what the budget lacks for the KV cache's
        ``grow`` bytes and ``later`` free for compiling (fit.refit_free), measured as the refit measures.
        ``refuse`` (memory_guard's positions, rows): a growth that, with its programs' compile
        (fit.LATER_COMPILE), does not fit the budget even with the cache at its floor raises RamBudgetError before
        anything is given up (the budget's own margin, 0.1 of a cgroup's limit, is the process's file pages': 48 MB
        short in the GLM-4.5-Air slice's 0.3x box was OOM-killed).  ``transient``: bytes the coming
        forward holds beside the cache besides its compile (memory_guard: a row view's copy), kept free too."""
        free = self._free_bytes(grow, later) - transient
        if free < 0:
            # measured again without what malloc holds free and the last fetch's transient slots (released at the
            # next fetch anyway); every forward dispatched so far wrote the KV cache, so once it is ready none still
            # reads a bank
            if self._cache is not None:
                jax.block_until_ready(self._cache)
            self.store.release_transient()
            memory.trim()
            free = self._free_bytes(grow, later) - transient
        # a longer cache: the streamed programs compile again for it, at this request's prefill; what the budget
        # lacks for that with the cache at its floor (at a working set of w)
        def lacking(free_now, w=None):
            return -(free_now + later - max(later, fit.LATER_COMPILE) + self.store.shrink_room(w))

        # what the cap's steps cannot give (at a working set of w)
        def uncovered(free_now, w=None):
            return -(free_now + self.store.shrink_room(w))

        def lowered(short_at, short):
            """The working set halved, down to one expert, while ``short_at(free at it, it)`` is still positive
            (the store then fetches a decode's experts in rounds of it): (that working set, what is still short)."""
            w = self._fit.inputs.working_set
            while short > 0 and w > 1:
                w = max(1, w // 2)
                short = short_at(self._free_bytes(grow, later, w) - transient, w)
            return w, short

        short = lacking(free) if refuse else 0
        if short > 0:
            # before a refusal, as the plan lowers it before refusing a load.  The f16 K/V cache's plan in the
            # GLM-4.5-Air slice's 0.3x box spends the bytes it saved on a working set of 8 (one round a decode) where
            # f32's had 4; without this its 2 rows refused a ~920-token request that f32's served
            w, short = lowered(lacking, short)
            if short <= 0:
                self._set_working_set(w)
                free = self._free_bytes(grow, later) - transient
        if short > 0:
            n, rows = refuse
            f = self._kept_plan().inputs
            raise RamBudgetError(
                f"this request needs the K/V cache grown by {n} positions x {rows} rows ({grow / 1e6:.0f} MB) and "
                f"its programs compiled for the longer cache: {short / 1e6:.0f} MB more than the RAM budget "
                f"({f.budget / 1e9:.2f} GB, {f.budget_from}) holds with the expert cache at one expert a layer, "
                f"fetched one at a time; a "
                f"shorter request, fewer rows ({self.opts.label('max_batch')}) or a larger budget "
                f"({self.opts.label('ram_gb')})")
        if free < 0 and uncovered(free) > 0:
            # the cap's steps below the working set free one expert of every layer less the fetched layer's
            # transient slot, so with one streamed layer nothing: where they cannot cover what is short, the working
            # set is lowered first (the GLM-5.2 slice's server gave its whole cache, 32 -> 1, for 34 MB)
            w, _ = lowered(uncovered, uncovered(free))
            if w != self._fit.inputs.working_set:
                self._set_working_set(w)
                free = self._free_bytes(grow, later) - transient
        if free < 0:
            self.store.shrink_cap(-free)

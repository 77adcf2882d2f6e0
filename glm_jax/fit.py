"""Fitting a run into the memory it is given, decided before anything large is loaded.

``plan(FitInputs) -> FitPlan`` is pure (unit-tested on numbers: tests/test_fit.py).  The engine fills its inputs
from headers only -- the dense weights' bytes from the safetensors headers (``dense_bytes``: the container's
dense.safetensors, or a plain HF dir's non-expert tensors), the experts' record sizes from the manifest -- and the
process's resident set before the weights, so a run that cannot fit is refused *before* the dense weights are read
(the OOM killer never gets a chance), and one that can is told what to give up, in this order:

1. the KV reservation: what the run can use (``reserve_tokens``: glm-jax passes its prompt + --max_new_tokens;
   otherwise min(context limit, 4096), lowered in halves down to 256 positions when that is what stops the fit;
   the cache itself always grows with the requests, runtime.py);
2. the step's workspace: estimated from the model (``workspace_bytes``: one prefill chunk's activations, the
   logits row, the compiler's working memory), not a fixed reserve; at the KV floor the prefill chunk is halved
   (down to 32 tokens) before anything is refused, and a streamed run's chunk is halved (down to 64) while the
   expert cache would hold fewer experts a layer than two tokens route to;
3. the dense weights' storage: quantized at load (int8_row, then int4_g64) when the container's (or checkpoint's)
   float dense weights leave the experts no room -- or when quantizing lets every expert stay resident;
4. direct I/O: on when the experts do not all fit (the page cache would hold a second copy of what the expert cache
   streams, inside the same limit);
5. the expert cache: whatever is left, at least one expert per layer;
6. the working set (the store's slots for one fetch, top-k for a decode): halved, down to one expert, when nothing
   else fits -- a decode's experts are then fetched and computed in rounds (else ``RamBudgetError`` naming what
   would fit).

Where the rows are the run's to choose (glm-jax-serve without ``--max_batch``: ``plan_rows``), they are halved before
a refusal, and traded for positions at the same KV bytes where each row would reserve fewer than ROW_TOKENS and the
rows could not all grow to that even with the expert cache at its floor.

An explicit flag (``--dense_format``, ``--max_seq_len``, ``--direct_io``, ``--max_batch``) is never overridden.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from .experts.container import DENSE_SCALE_SUFFIX, SafeTensorsDir, is_routed_expert_key
from .kernels.formats import head_format, quantized_nbytes
from .memory import cache_slots, round_up_gb

DIRECT_NOTE = "the experts do not fit: read past the page cache"
QUANT_STEPS = ("int8_row", "int4_g64")        # what the dense weights are quantized to at load, in this order
KV_DEFAULT_TOKENS = 4096                      # reserved when the run's length is unknown (the Python API, a server)
KV_FLOOR_TOKENS = 256                         # the reservation is never lowered below this (nor below the run's)
CHUNK_FLOOR = 32                              # nor the prefill chunk below this (where only that lets it start)
CACHE_CHUNK_FLOOR = 32                        # nor below this to give a streamed run's cache two tokens' experts
                                              # (at 64 the f16 cache's 3 MB kept a 64-token chunk
                                              # and 2 fewer experts a layer in the GLM-4.5-Air slice's 0.3x box)
CACHE_CHUNK_TOKENS = 2                        # ... (CACHE_CHUNK_TOKENS x top-k a layer)
COMPILE_BYTES = 100 << 20                     # compiled programs, kept (see workspace_bytes)
COMPILE_TRANSIENT = 100 << 20                 # XLA's working memory while compiling, given back (measured, ibid.)
LATER_COMPILE = 64 << 20                      # kept free after the first run: later programs (other buckets)
LATER_COMPILE_WARM = 16 << 20                 # ... where the next request's forwards are all compiled (fetch=loop):
                                              # the sampling and bookkeeping programs of a new case
# compiled code of a resident run's whole-model programs, per decoder layer: one step per prefill bucket (the first
# prompt's, a prefix-cache hit's shorter one) and the decode loop, each with every layer unrolled, so O(layers); a
# streamed run (fetch=loop) shares one program per layer kind and shape, counted in the workspace.  Measured as the
# private-memory peak of two 16-token generates after load, slope over the layer count at tiny widths
# (docs/real-scale.md): glm_moe_dsa 5 -> 78 layers 13.7 MB / layer, glm4_moe 4 -> 28 layers 7.9 MB / layer.
# glm4_moe_lite: glm_moe_dsa's MLA without the indexer, taken at glm_moe_dsa's size (not measured)
RESIDENT_CODE_PER_LAYER = {"glm_moe_dsa": 14 << 20, "glm4_moe": 8 << 20, "glm4_moe_lite": 14 << 20}
ROW_TOKENS = 1024                             # rows the run did not ask for (glm-jax-serve's --max_batch): fewer
                                              # rows of this many positions before more rows of fewer (plan_rows)
FUSED_CODE_SHARE = 0.15                       # fetch=fused where its code costs at most this share of the cache:
                                              # measured at the boundary (docs/real-scale.md), fused
                                              # against loop where the plan gave fused 2 of 19 / 3 of 28 slots
                                              # a layer (the GLM-5.2 slice's 24 GB box, hit 1.00; the streaming
                                              # model at 1400 MB): +14-23% / +29-39%; where 3 of 16 (1000 MB, hit
                                              # 0.97 -> 0.93): -17-23%
LOAD_OVERHEAD = 32 << 20                      # what loading adds besides the weights (measured on the shipped model:
                                              # NNX model, tokenizer, device copies' bookkeeping: 25 MB private)


@dataclasses.dataclass(frozen=True)
class FitInputs:
    budget: int                  # bytes the whole process may use
    budget_from: str             # how the budget was decided (for messages)
    runtime: int                 # resident set before any weights (the JAX runtime, the kernels)
    dense: dict                  # dense storage format -> resident bytes; "native" (as stored) always present
    dense_fixed: bool            # --dense_format given: only dense["native"] is a candidate
    load_extra: dict             # format -> transient bytes while loading (the largest tensor's temporaries)
    kv_per_token: int            # KV bytes per position, every row (x --max_batch)
    kv_tokens: int               # positions the run can use (already min(context, ...))
    kv_fixed: bool               # --max_seq_len given, or the run's own length: never lowered
    workspace: int               # the step's buffers and the compiler's working memory
    rec_sum: int                 # bytes of one expert of every layer
    buffers: int                 # I/O scratch + one layer's transient working set
    pin_bytes: int               # pinned experts
    num_experts: int             # experts per layer (the largest layer)
    cache_cap: Optional[int] = None      # --cache_cap (experts per layer) or None
    direct_io: Optional[bool] = None     # --direct_io given (True / False) or None: decided here
    persistent: int = 0          # the part of ``workspace`` that stays after the first compile (the rest is
                                 # measured free after the first run and given to the expert cache)
    prefill_chunk: int = 0       # the prefill chunk ``workspace`` was estimated at (its activations) ...
    act_per_position: int = 0    # ... and their bytes per position: a chunk lowered with the KV reservation
    chunk_fixed: bool = True     # --prefill_chunk given (or no estimate): never lowered
    resident_code: int = 0       # a resident run's compiled whole-model programs (resident_code_bytes): counted
                                 # only when every expert is to stay resident
    layers: int = 0              # decoder layers (for the message about resident_code)
    top_k: int = 0               # experts one position routes to per layer: a streamed run's prefill chunk is halved
                                 # (down to CACHE_CHUNK_FLOOR) while the cache holds fewer than
                                 # CACHE_CHUNK_TOKENS x top_k
    working_set: int = 0         # experts one fetch holds at once (engine.working_set), and the largest record:
    max_rec: int = 0             # halved last before a refusal (FitPlan.working_set)
    released: bool = False       # transient slots go back to the OS (store.working_set_released): the fetched
                                 # layer's cached experts count among its working set (memory.cache_slots)
    fetch: str = "auto"          # --fetch: "loop" never reserves the unrolled programs' code; "fused" / "callback"
                                 # always do (a whole-model program each); "auto" where it costs <= FUSED_CODE_SHARE


@dataclasses.dataclass(frozen=True)
class FitPlan:
    dense_format: str            # "native" or the format the dense weights are quantized to at load
    kv_tokens: int
    kv_bytes: int
    direct_io: bool
    cap_fits: int                # experts per layer the budget holds (<= num_experts)
    all_fit: bool                # every expert fits: loaded at open, run resident
    dense_bytes: int
    notes: tuple                 # what was decided and why (for the one line)
    prefill_chunk: int = 0       # the prefill chunk the workspace holds (lowered with the KV reservation)
    workspace: int = 0
    fused: bool = False          # streamed: room for fetch=fused's whole-model decode programs (FUSED_CODE_SHARE)
    working_set: int = 0         # lowered from FitInputs.working_set (0: as given): a decode's union is fetched and
                                 # computed in rounds of this many experts (runtime/streaming._chunked_moe)

    def line(self, inp: FitInputs, cache_cap: Optional[int] = None, resident: Optional[bool] = None) -> str:
        """What was chosen, in one line (``cache_cap`` / ``resident``: what the store made of it, when known)."""
        gb = lambda b: f"{b / 1e9:.3f}"  # noqa: E731
        dense = (f"dense {gb(self.dense_bytes)} GB" + ("" if self.dense_format == "native" or inp.dense_fixed
                                                       else f" (quantized to {self.dense_format} at load)"))
        cap = self.cap_fits if cache_cap is None else cache_cap
        exp = ("every expert resident" if (self.all_fit if resident is None else resident)
               else f"expert cache {cap} of {inp.num_experts} per layer")
        return (f"glm-jax: memory: budget {gb(inp.budget)} GB ({inp.budget_from}): runtime {gb(inp.runtime)} + "
                f"{dense} + KV {gb(self.kv_bytes)} GB ({self.kv_tokens} positions) + workspace "
                f"{gb(self.workspace or inp.workspace)} GB; {exp}; direct I/O {'on' if self.direct_io else 'off'}"
                + (f" ({'; '.join(self.notes)})" if self.notes else ""))


class FitError(Exception):
    """Raised by ``plan`` with the one-line reason; the engine turns it into a RamBudgetError."""


def _chunk(inp: FitInputs, kv_tokens: int) -> int:
    """The prefill chunk at a KV reservation: a chunk longer than the reserved positions is lowered to them."""
    if inp.chunk_fixed or not inp.prefill_chunk:
        return inp.prefill_chunk
    return min(inp.prefill_chunk, kv_tokens)


def _steps(inp: FitInputs, kvs: list) -> list:
    """(KV positions, prefill chunk) to try in order: the KV reservation halved (the chunk following it), then at
    the KV floor the chunk halved down to CHUNK_FLOOR (llama.cpp's -ub: a smaller prefill batch, a slower prefill,
    the same output) -- the expert cache shrinks last."""
    steps = [(kv, _chunk(inp, kv)) for kv in kvs]
    kv, c = steps[-1]
    while not inp.chunk_fixed and inp.act_per_position and c > CHUNK_FLOOR:
        c = max(CHUNK_FLOOR, c // 2)
        steps.append((kv, c))
    return steps


def _workspace(inp: FitInputs, chunk: int) -> int:
    return inp.workspace - (inp.prefill_chunk - chunk) * inp.act_per_position


def _cap(inp: FitInputs, dense: int, step: tuple, code: int = 0) -> int:
    kv, chunk = step
    avail = (inp.budget - inp.runtime - _workspace(inp, chunk) - dense - inp.kv_per_token * kv - inp.buffers
             - inp.pin_bytes - code)
    if not inp.rec_sum:
        return inp.num_experts
    if inp.working_set and inp.max_rec:          # buffers count the whole working set: cache_slots places it
        return cache_slots(avail + inp.working_set * inp.max_rec, inp.rec_sum, inp.max_rec, inp.working_set,
                           inp.released)
    return int(avail // inp.rec_sum)


def _loads(inp: FitInputs, fmt: str) -> bool:
    """Loading the dense weights in ``fmt`` stays inside the budget (result + the largest tensor's temporaries)."""
    return inp.runtime + inp.dense[fmt] + inp.load_extra.get(fmt, 0) <= inp.budget


def refit_free(inp: FitInputs, plan: "FitPlan", private: int, kv_now: int, cache_cap: int,
               later: int = LATER_COMPILE) -> int:
    """What the refit after the first generation may hand the expert cache (``ExpertStore.grow_cap``): the budget
    less what is measured now (``private``: the weights, the cache's slots, the compiled programs), the KV still
    to grow into its reservation, the working set beyond the cache (memory.cache_slots), one prefill chunk's
    activations -- freed between forwards, so not in the measurement, but the next prefill allocates them again --
    and ``later`` for programs not compiled yet (LATER_COMPILE; MemoryGuard._later_compile)."""
    buffers = inp.buffers - (min(cache_cap, inp.working_set) * inp.max_rec if inp.released else 0)
    return int(inp.budget - private - max(0, plan.kv_bytes - kv_now) - buffers - chunk_acts(inp, plan) - later)


def chunk_acts(inp: FitInputs, plan: "FitPlan") -> int:
    """One prefill chunk's activations, as the plan reserves them (kept free by refit_free)."""
    return max(0, _workspace(inp, plan.prefill_chunk or inp.prefill_chunk) - COMPILE_BYTES - COMPILE_TRANSIENT)


def with_working_set(inp: FitInputs, w: int) -> FitInputs:
    """``inp`` with a working set of ``w`` experts (its buffers follow)."""
    return dataclasses.replace(inp, working_set=w, buffers=inp.buffers - (inp.working_set - w) * inp.max_rec)


def plan(inp: FitInputs) -> FitPlan:
    """See the module docstring.  Raises FitError when not even one expert per layer fits."""
    try:
        return _plan(inp)
    except FitError:
        if inp.working_set <= 1 or not inp.max_rec:
            raise
        # last, before refusing: a smaller working set (the store's slots for one fetch), halved down to one
        # expert; a decode's union is then fetched and computed in rounds (slower, the same output)
        w = inp.working_set
        while w > 1:
            w = max(1, w // 2)
            try:
                p = _plan(with_working_set(inp, w))
            except FitError:
                continue
            # a union beyond one fetch runs the loop's way: no fetch=fused programs to reserve
            ws = p.workspace - (inp.resident_code if p.fused and not p.all_fit else 0)
            return dataclasses.replace(p, working_set=w, fused=False, workspace=ws, notes=p.notes + (
                f"working set lowered from {inp.working_set} to {w} experts: a decode's experts are fetched in "
                f"rounds of {w}",))
        raise


def _rounds(p: FitPlan, inp: FitInputs) -> int:
    """Rounds in which a decode's full union is fetched under plan ``p`` (its working set, lowered or not)."""
    return -(-inp.working_set // (p.working_set or inp.working_set)) if inp.working_set else 1


def plan_rows(inputs_at, rows: int) -> tuple:
    """(rows, plan, inputs) where the row count is the run's to choose (glm-jax-serve's --max_batch not given):
    ``inputs_at(r)`` gives the FitInputs at r rows.  The rows are halved while a plan at that many does not fit at
    all (refused only at one row).  Where the plan then reserves each row fewer than ROW_TOKENS positions (nor the
    context) and its rows could not all grow to ROW_TOKENS even with the expert cache at its floor, the rows are
    traded for positions at the same KV bytes and prefill chunk (no smaller cache, no more rounds of a decode's
    fetch): the cache is [rows, positions], so a request longer than the reservation grows every row's K/V inside
    the box -- 8 rows of 256 positions in the GLM-4.5-Air slice's 0.3x box were OOM-killed by a ~920-token prompt
    (docs/real-scale.md); 2 rows of 1024 in the same bytes served it.  Where they could grow, the plan stays
    (MemoryGuard.memory_guard takes a growth's room from the cache when it comes, and gives it back after)."""
    r = rows
    while True:
        inp = inputs_at(r)
        try:
            p = plan(inp)
            break
        except FitError:
            if r <= 1:
                raise
            r = max(1, r // 2)
    notes = [f"rows lowered from {rows} to {r}: {rows} do not fit"] if r < rows else []
    want = min(ROW_TOKENS, inp.kv_tokens)

    def at(rr: int, kv: int):       # the plan at rr rows of kv positions, at the first plan's prefill chunk
        i = inputs_at(rr)
        c = p.prefill_chunk or i.prefill_chunk
        try:
            return i, plan(dataclasses.replace(i, kv_tokens=kv, kv_fixed=True, workspace=_workspace(i, c),
                                               prefill_chunk=c, chunk_fixed=True))
        except FitError:
            return i, None

    if not inp.kv_fixed and r > 1 and p.kv_tokens < want and at(r, want)[1] is None:
        # the rows could not all grow to ROW_TOKENS even with the cache at its floor: fewer rows, the same bytes
        r2, kv2 = r, p.kv_tokens
        while r2 > 1 and kv2 < want:
            r2, kv2 = r2 // 2, min(want, kv2 * 2)
        i2, p2 = at(r2, kv2)
        if p2 is not None and p2.cap_fits >= p.cap_fits and _rounds(p2, i2) <= _rounds(p, inp):
            notes.append(f"rows lowered from {r} to {r2}: {kv2} positions each instead of {p.kv_tokens}")
            if kv2 < i2.kv_tokens:
                notes.append(f"KV reservation lowered from {i2.kv_tokens} positions; a longer context takes its "
                             f"room from the expert cache")
            r, inp = r2, i2
            p = dataclasses.replace(p2, notes=p2.notes + tuple(n for n in p.notes if n.startswith("prefill chunk")))
    if notes:               # (a plan at a fixed reservation has no note of its own about it)
        p = dataclasses.replace(p, notes=tuple(notes) + p.notes)
    return r, p, inp


def _plan(inp: FitInputs) -> FitPlan:
    E = inp.num_experts
    native = inp.dense["native"]
    cands = ["native"] if inp.dense_fixed else (
        ["native"] + [f for f in QUANT_STEPS if f in inp.dense and inp.dense[f] < native])
    kvs = [inp.kv_tokens]
    if not inp.kv_fixed:
        t = inp.kv_tokens
        while t > KV_FLOOR_TOKENS:
            t = max(KV_FLOOR_TOKENS, t // 2)
            kvs.append(t)
    notes = []
    want = min(inp.cache_cap, E) if inp.cache_cap else E  # what the user asked the cache to hold
    # a resident run's whole-model programs (none with --fetch=loop: its programs are shared by the layers)
    rcode = 0 if inp.fetch == "loop" else inp.resident_code
    code = rcode if want >= E else 0
    # every expert resident (or the asked --cache_cap), with the full KV reservation: native first, then quantized;
    # then every expert cached but streamed (fetch=loop: programs shared by the layers, no resident code)
    steps = _steps(inp, kvs)
    for c in dict.fromkeys((code, 0)):
        choice = next(((f, steps[0]) for f in cands
                       if _loads(inp, f) and _cap(inp, inp.dense[f], steps[0], c) >= want), None)
        if choice is not None:
            break
    if choice is None:
        # streaming: the smallest dense storage that fits first (the cache shrinks last), KV (then the prefill
        # chunk) lowered only if needed
        order = cands[1:] + cands[:1] if len(cands) > 1 else cands
        choice = next(((f, st) for st in steps for f in order
                       if _loads(inp, f) and _cap(inp, inp.dense[f], st) >= 1), None)
    if choice is None:
        f = cands[-1]
        kv, chunk = steps[-1]
        ws = _workspace(inp, chunk)
        rel = inp.released and inp.working_set and inp.max_rec
        beyond = inp.buffers - (inp.max_rec if rel else 0)     # its cached expert apart
        need = (inp.runtime + ws + inp.dense[f] + inp.kv_per_token * kv + beyond + inp.pin_bytes + inp.rec_sum)
        need = max(need, inp.runtime + inp.dense[f] + inp.load_extra.get(f, 0))
        raise FitError(
            f"RAM budget {inp.budget / 1e9:.2f} GB ({inp.budget_from}) too small for one layer's experts: runtime "
            f"{inp.runtime / 1e9:.2f} + dense weights {inp.dense[f] / 1e9:.2f} ({f}) + KV "
            f"{inp.kv_per_token * kv / 1e9:.2f} "
            f"({kv} positions) + workspace {ws / 1e9:.2f} (prefill chunk {chunk}) + I/O buffers and one layer's "
            f"working set{' beyond its cached expert' if rel else ''} "
            f"{beyond / 1e9:.2f} + pinned {inp.pin_bytes / 1e9:.2f} GB + one expert per layer "
            f"{inp.rec_sum / 1e9:.2f} GB; --ram_gb >= {round_up_gb(need / 1e9):.2f} would fit (decided before loading anything)")
    f, (kv, chunk) = choice
    # streamed with a cache of fewer than two tokens' experts per layer, every token re-reads most of its experts; a
    # smaller prefill chunk (llama.cpp's -ub) only re-reads a long prompt's experts once more per chunk.  So the
    # chunk's activations go to the cache first, halved down to CACHE_CHUNK_FLOOR.  Measured (docs/real-scale.md):
    # the 3-layer GLM-4.5-Air slice at 0.45x, 256 -> 64 tokens took the cache from 8 to 12 experts a layer and
    # decode 9.4 -> 15.3 tok/s; the 6-layer slice at 0.3x (cache 8 = top-8 at 256) gave decode 8.5-11.1
    # -> 15.9 tok/s with a 64-token prompt, 8.6 -> 11.1 with a 512-token one, whose prefill went 55.8 -> 46.6
    want_cached = CACHE_CHUNK_TOKENS * inp.top_k
    while (not inp.chunk_fixed and inp.act_per_position and inp.top_k and chunk > CACHE_CHUNK_FLOOR
           and _cap(inp, inp.dense[f], (kv, chunk)) < min(E, want_cached, inp.cache_cap or E)):
        chunk = max(CACHE_CHUNK_FLOOR, chunk // 2)
    cap = max(0, min(E, _cap(inp, inp.dense[f], (kv, chunk))))
    all_fit = cap >= E and _cap(inp, inp.dense[f], (kv, chunk), rcode) >= E
    if cap >= E and not all_fit:
        notes.append(f"every expert cached, streamed: a resident run's compiled programs "
                     f"({inp.resident_code / 1e9:.2f} GB at {inp.layers} layers) would not fit")
    if f != "native":
        notes.append(f"the stored dense weights ({native / 1e9:.2f} GB) "
                     + ("would keep experts out of RAM" if all_fit else "leave too little for the expert cache"))
    if kv < kvs[0]:
        notes.append(f"KV reservation lowered from {kvs[0]} positions; a longer context takes its room from the expert cache")
    if chunk < inp.prefill_chunk:
        notes.append(f"prefill chunk {chunk} tokens")
    # streamed with fetch=fused: its decode programs (without and with the store's calls) unroll every layer like a
    # resident run's; counted as a resident run's whole code (an upper bound: no prefill programs), and chosen
    # only where that costs the expert cache at most FUSED_CODE_SHARE of its slots (else fetch=loop's shared
    # per-layer programs)
    fcap = max(0, min(E, _cap(inp, inp.dense[f], (kv, chunk), inp.resident_code)))
    if inp.fetch == "loop":                       # asked for: shared per-layer programs, the cache keeps its slots
        fused = False
    elif inp.fetch in ("fused", "callback"):      # asked for: its whole-model programs are reserved, whatever cost
        fused = fcap >= 1
    else:
        fused = fcap >= 1 and fcap >= (1 - FUSED_CODE_SHARE) * cap      # (where all_fit: a --cache_cap below E)
    if not all_fit and not fused and inp.fetch == "auto":
        notes.append(f"fetch=loop: fetch=fused's compiled programs ({inp.resident_code / 1e9:.2f} GB) would take "
                     f"{cap - fcap} of {cap} cached experts per layer")
    if inp.direct_io is None:
        direct = cap < E and (not inp.cache_cap or inp.cache_cap >= cap)
        if direct:
            notes.append(DIRECT_NOTE)
    else:
        direct = bool(inp.direct_io)
    return FitPlan(dense_format=f, kv_tokens=kv, kv_bytes=inp.kv_per_token * kv, direct_io=direct, cap_fits=cap,
                   all_fit=all_fit, dense_bytes=inp.dense[f], notes=tuple(notes), prefill_chunk=chunk,
                   workspace=_workspace(inp, chunk) + (rcode if all_fit or fused else 0),
                   fused=fused)


# ----------------------------------------------------------------------------- estimates from headers
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
             "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def header_tensors(path: str) -> list:
    """[(key, numpy dtype name, shape)] of the non-expert tensors in ``path``'s safetensors headers (a plain HF dir,
    or a container's dense.safetensors: the only safetensors file of a container), read and checked without
    reading any tensor."""
    st = SafeTensorsDir(path)
    try:
        return [(k, t.dtype, t.shape) for k, t in st.tensors.items() if not is_routed_expert_key(k)]
    finally:
        close = getattr(st, "close", None)
        if close is not None:
            close()

def _matrix_bytes(out: int, n_in: int, fmt: str) -> int:
    return quantized_nbytes(out, n_in, fmt if fmt != "int4_g64" or n_in % 2 == 0 else "int8_row")


def dense_bytes(tensors, cfg, fmt: str, packed: bool, itemsize: int = 4) -> tuple[int, int]:
    """(resident bytes, the largest tensor's load temporaries) of the dense (non-expert) weights at run time in
    ``fmt`` ("native" = as stored), from ``tensors``: [(key, numpy dtype name, shape)] of the safetensors headers
    (routed experts left out by the caller).  ``packed``: the dense matrices become QWeights (native kernels or a
    quantized format: a stored bf16 / int8 / int4 matrix stays so), else every float is cast to the compute dtype
    (``itemsize`` bytes).  Follows weights.load_params: norms, biases and the router f32; the embedding table as
    stored; lm_head (and a tied one, a second copy) in ``quant.head_format``; MLA's kv_b float, its linears packed."""
    infos = {k: (dt, tuple(sh)) for k, dt, sh in tensors}
    total, extra = 0, 0

    def stored(key):
        dt, sh = infos[key]
        return int(np.prod(sh, dtype=np.int64)) * _ITEMSIZE.get(dt, 4)

    def kind(key):
        dt, _ = infos[key]
        return "int8_row" if dt == "int8" else "int4" if dt == "uint8" else "bf16" if dt == "bfloat16" else \
            "f32" if dt in ("float32", "float16") or dt.startswith("float8") else "other"

    def as_fmt(key, out, n_in, f):
        k = kind(key)
        if not packed:
            return out * n_in * itemsize
        if f == "native":
            if k == "bf16":
                return out * n_in * 2
            if k in ("int8_row", "int4"):
                return stored(key) + (stored(key + DENSE_SCALE_SUFFIX) if key + DENSE_SCALE_SUFFIX in infos else 0)
            return out * n_in * 4
        if k == "int4" and f.startswith("int4"):
            return stored(key) + stored(key + DENSE_SCALE_SUFFIX)
        return _matrix_bytes(out, n_in, f)

    mla = getattr(cfg, "is_mla", False)
    for key, (dt, sh) in infos.items():
        if key.endswith(DENSE_SCALE_SUFFIX) and key[: -len(DENSE_SCALE_SUFFIX)] in infos:
            continue                                     # counted with its weight
        if key.endswith("_scale_inv"):
            continue                                     # FP8 block scales: folded into the weight
        n = int(np.prod(sh, dtype=np.int64))
        if (len(sh) != 2 or not key.endswith(".weight") or "norm" in key.split(".")[-2]
                or key.endswith("mlp.gate.weight")):
            total += n * 4
            continue
        out, n_in = sh
        if kind(key) == "int4":
            n_in *= 2                                    # packed nibbles: two inputs per byte
        if key.endswith("embed_tokens.weight"):
            if packed and fmt not in ("native", "f32", "bf16") and kind(key) not in ("int8_row", "int4"):
                b = _matrix_bytes(out, n_in, fmt)         # quantized at load (quant.pack_table)
            else:
                b = stored(key) if packed and kind(key) != "f32" else out * n_in * (4 if packed else itemsize)
            if key == "model.embed_tokens.weight" and getattr(cfg, "tie_word_embeddings", False):
                b += as_fmt(key, out, n_in, head_format(fmt) if fmt != "native" else "native")
        elif key == "lm_head.weight" or key.endswith("shared_head.head.weight"):
            b = as_fmt(key, out, n_in, head_format(fmt) if fmt != "native" else "native")
        elif mla and key.endswith("weights_proj.weight"):
            b = out * n_in * 4                           # the DSA indexer's head weights: f32 (as transformers)
        elif mla and key.endswith(("kv_b_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight")):
            b = out * n_in * itemsize                    # kv_b reshaped for absorption, the indexer's: float
        elif mla and ".self_attn." in key:
            b = as_fmt(key, out, n_in, fmt)              # MLA's linears: packed like any dense matrix
        else:
            b = as_fmt(key, out, n_in, fmt)
        total += b
        # loading: the stored tensor, the result and jnp.asarray's staging copy of it (measured: a 134 MB array
        # takes +253 MB while it is copied in, +132 MB after); quantizing adds one block of float rows
        extra = max(extra, stored(key) + 3 * b)
    return int(total), int(extra)


def resident_code_bytes(cfg) -> int:
    """Compiled code a resident run holds (RESIDENT_CODE_PER_LAYER x decoder layers, the MTP layer included)."""
    per = RESIDENT_CODE_PER_LAYER.get(getattr(cfg, "model_type", ""), RESIDENT_CODE_PER_LAYER["glm4_moe"])
    return int(per * (cfg.num_hidden_layers + (1 if getattr(cfg, "has_mtp", False) else 0)))


def activation_bytes(cfg, itemsize: int = 4) -> int:
    """Bytes per prefill position of the step's activations (two live copies of each): hidden / residual / normed /
    attention out, q|k|v, the MLP's gate|up, the MoE seam's per-(t, k) outputs (summed in routing order), the
    router's scores."""
    H = cfg.hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(1, cfg.n_shared_experts))
    return 2 * (4 * H + qkv + 2 * inter + cfg.num_experts_per_tok * H + 2 * cfg.n_routed_experts) * itemsize


def workspace_bytes(cfg, prefill_chunk: int, max_batch: int, itemsize: int = 4) -> int:
    """The step's buffers beyond the weights and the KV cache, plus the compiler's memory: one prefill chunk's
    activations (hidden, q/k/v, the dense MLP's gate/up, the router scores, a few temporaries each), the decode
    width's rows and one row of logits.  Measured (private memory, RssAnon + RssShmem, sampled every 5 ms, from
    after loading to after the first 16-token generate): the shipped model +80 MB kept / +110 MB peak with a warm
    compilation cache, +100 / +235 MB with a cold one; a 4-layer H 512 synthetic model (int4 dense) +96 MB kept with
    a warm cache, +91 kept / +194 MB peak cold.  ``COMPILE_BYTES`` is what stays, ``COMPILE_TRANSIENT`` is reserved
    until the first run; then what is measured free is handed to the expert cache (``ExpertStore.grow_cap``), so
    the reserve is not held for the run's lifetime."""
    T = max(prefill_chunk, 4 * max_batch)
    return int(COMPILE_BYTES + COMPILE_TRANSIENT + T * activation_bytes(cfg, itemsize)
               + 4 * max_batch * cfg.vocab_size * 4)

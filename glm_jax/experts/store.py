"""ExpertStore: routed experts streamed from disk through a RAM-bounded per-layer cache.

Contract (used by the engine's Python layer loop and by its io_callback fetch mode)::

    store = ExpertStore.open(model_dir, cfg, cache_cap=None, ram_gb=None, direct_io=False, io_threads=4,
                             read_chunk_mb=1.0, pin=None | "auto" | PATH, pin_gb=0.0, policy="lru" | "lfu",
                             dense_bytes=0, kv_bytes=0, max_working_set=None)
    bank, slot_of = store.fetch(layer, expert_ids)     # every id present in bank; slot_of int32 [E], -1 absent
    store.resident_mask(layer) / store.pinned_mask(layer) -> bool [E]
    store.prefetch(layer, expert_ids)                  # background loads of predicted experts into FREE slots
    store.stats() / store.reset_stats() / store.close()

Memory layout.  Each expert layer owns a slot arena: one page-aligned (anonymous mmap) numpy array per record
section (``gate_up [S, ...]``, ``gate_up_scale``, ``down``, ``down_scale``), wrapped once as the jax arrays of an
``ExpertBank``.  ``S = min(E, pinned + max(cache_cap, max_working_set))``: the pinned experts, then room for the
retained cache OR the whole expert union of one forward, whichever is larger (a union larger than the cap is
served, then trimmed back to ``cache_cap`` retained experts at the end of the call).  A miss reads the expert's
record straight into its slot rows of the four arrays (``preadv`` scatter; padding goes to scratch); all misses of
one call are issued at once; where they are fewer than ``io_threads``, each record split into a multiple of
``io_threads`` near-equal byte ranges of at most ``read_chunk_mb`` (``container.balanced_chunk``) so every I/O thread
stays busy to the end of the batch (a handful of large records over 4 threads otherwise leaves threads idle at the
tail); with as many or more, one read each (``fetch_chunk``).  The retained slots' pages are faulted in
by a background thread at open (``MADV_POPULATE_WRITE``; never more than the RAM budget holds), so a first read
into a slot does not pay page faults.

No re-transfer of hits.  On XLA:CPU ``jax.device_put`` of a 64-byte-aligned numpy array aliases it (checked at
open with ``unsafe_buffer_pointer``; ``aliased`` in stats), so a read into a slot IS the device update and a hit
costs nothing.  On other backends (or if aliasing is not observed) the arena is host staging and only the missed
slots are sent, with a jitted, donated ``bank.at[slots].set(rows)``.

Why overwriting a slot is safe.  A slot is only overwritten inside ``fetch``, only if its expert is not in the
current call's union, or by ``prefetch`` into a FREE slot (one no expert holds) of a layer not yet dispatched in
the current forward.  The engine calls ``fetch(L, ids)`` after reading layer
L's routing decision back to the host, and it runs one forward at a time.  Those ids depend on the hidden state
entering layer L, which depends on every earlier layer's MoE output of this forward, which in turn depends on
the previous forward's output (the sampled token).  So when ``fetch`` runs, every computation dispatched
earlier that could read ANY bank of this store (earlier layers of this forward, all layers of earlier forwards)
has finished.  A slot evicted at the end of a call keeps its bytes until a later ``fetch`` reuses it, so the
computation dispatched with this call's ``slot_of`` (a fresh copy per call) reads valid data.  Slots beyond
``pinned + cache_cap`` that held a transient working set are given back at the start of a later fetch, under the
same argument, so resident memory stays near ``(pinned + cap) x record`` per layer: their pages move to the fresh
slots the fetching layer's misses take (``mremap``, memory.move_pages: no zero fill, no page faults -- a cache below
the working set needs fresh slots at every fetch), and those no fetch takes go to the OS (``MADV_DONTNEED``).
On non-CPU backends the donated scatter is ordered by JAX after earlier readers of the bank.

Prefetch.  ``prefetch(L, ids)`` (the engine calls it for layer L+1 right after ``fetch(L)``, with layer L+1's router
applied to layer L's state) starts background reads of the predicted non-resident experts into free slots (never
evicting; free slots are not referenced by any pending computation, per the argument above, since layer L+1 of the
current forward is not dispatched yet).  They join the cache at once (so the routing plugins see them as resident);
``fetch`` / ``peek`` of that layer first wait for them.  Their bytes count in ``bytes_read`` and ``expert_loads``
(they are loads) and in ``prefetch_loads``; a later request served by one is a ``prefetch_hit`` (neither a cache hit
nor a miss); ``prefetch_unused`` counts those the next call of the layer did not ask for.

Counters are taken where the bytes move: ``bytes_read`` is the sum of what the read calls returned.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import fcntl
import functools
import json
import mmap
import os
import sys
import threading
import time
from typing import Optional

import numpy as np

from .. import fileio, paths
from ..errors import GlmJaxError
from ..kernels import dir_problem
from ..kernels.formats import FLOAT_FORMATS, ExpertBank, with_kernel
from ..memory import cache_slots, default_budget, evict_page_cache, huge_pages, move_pages, round_up_gb
from ..model.config import ModelConfig
from .container import balanced_chunk, config_hash, open_expert_source

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)    # Linux >= 5.14; older kernels: EINVAL -> skip
USAGE_VERSION = 1


class StoreError(GlmJaxError):
    pass


class RamBudgetError(StoreError):
    pass


# ----------------------------------------------------------------------------- policies
class LRUPolicy:
    """Least recently used.  Within one call, ids are 'used' in the order given."""
    name = "lru"

    def __init__(self, E: int):
        self.last = np.zeros(E, np.int64)
        self.t = 0

    def touch(self, ids):
        for e in ids:
            self.t += 1
            self.last[e] = self.t

    def touch_many(self, unions: list):
        """``touch(u)`` for each ``u`` in order, in one pass: an expert's last use is its last occurrence."""
        cat = np.concatenate([np.asarray(u, np.int64).reshape(-1) for u in unions]) if unions else np.zeros(0, int)
        if cat.size:
            np.maximum.at(self.last, cat, self.t + np.arange(1, cat.size + 1, dtype=np.int64))
            self.t += int(cat.size)

    def victims(self, candidates) -> list:
        """Candidates sorted eviction-first."""
        return sorted(candidates, key=lambda e: self.last[e])


class LFUDecayPolicy(LRUPolicy):
    """Frequency-aware: score = exponentially decayed use count (half-life in layer calls); ties -> LRU."""
    name = "lfu"

    def __init__(self, E: int, half_life: float = 64.0):
        super().__init__(E)
        self.score = np.zeros(E, np.float64)
        self.at = np.zeros(E, np.int64)
        self.calls = 0
        self.decay = 0.5 ** (1.0 / half_life)

    def touch(self, ids):
        self.calls += 1
        u = np.asarray(ids, np.int64).reshape(-1)
        # one vector expression per call, also for a single id: every path computes a score the same way (bitwise)
        for part in ([u] if np.unique(u).size == u.size else [u[i:i + 1] for i in range(u.size)]):
            self.score[part] = self.score[part] * self.decay ** (self.calls - self.at[part]) + 1.0
            self.at[part] = self.calls
        super().touch(ids)

    def touch_many(self, unions: list):
        """``touch(u)`` for each ``u`` (ids without repeats) in order: the decay depends on the call count, so one
        call at a time, each the vector expression ``touch`` computes."""
        for u in unions:
            u = np.asarray(u, np.int64).reshape(-1)
            self.calls += 1
            self.score[u] = self.score[u] * self.decay ** (self.calls - self.at[u]) + 1.0
            self.at[u] = self.calls
        super().touch_many(unions)

    def victims(self, candidates) -> list:
        now = self.calls
        return sorted(candidates, key=lambda e: (self.score[e] * self.decay ** (now - self.at[e]), self.last[e]))


POLICIES = {"lru": LRUPolicy, "lfu": LFUDecayPolicy}


class CacheIndex:
    """Bookkeeping of one layer's cache (no data): shared by ExpertStore and tools/bench/cache_sim.py.

    ``room`` = slots available to non-pinned experts (>= cap).  ``access(union)`` returns
    (hits_pinned, hits_cache, misses, evict_now, evict_after): ``evict_now`` frees room for the misses before
    they are loaded (only experts outside the union), ``evict_after`` trims the retained set back to ``cap``
    after the call (possibly experts of this union that do not fit)."""

    def __init__(self, E: int, cap: int, room: int, policy: str = "lru", pinned: Optional[np.ndarray] = None):
        if policy not in POLICIES:
            raise StoreError(f"unknown cache policy {policy!r} (expected one of {', '.join(POLICIES)})")
        self.E, self.cap, self.room = E, cap, max(room, cap)
        self.policy = POLICIES[policy](E)
        self.pinned = np.zeros(E, bool) if pinned is None else pinned.copy()
        self.cached: set = set()

    def access(self, union: list):
        hp = [e for e in union if self.pinned[e]]
        hc = [e for e in union if not self.pinned[e] and e in self.cached]
        miss = [e for e in union if not self.pinned[e] and e not in self.cached]
        if len(hc) + len(miss) > self.room:
            raise StoreError(f"the expert union of one call ({len(hc) + len(miss)} unpinned experts) exceeds the "
                             f"working-set slots ({self.room}); open the store with a larger max_working_set")
        need = len(self.cached) + len(miss) - self.room
        evict_now = []
        if need > 0:
            u = set(union)
            evict_now = self.policy.victims([e for e in self.cached if e not in u])[:need]
            self.cached.difference_update(evict_now)
        self.cached.update(miss)
        self.policy.touch(union)
        evict_after = []
        if len(self.cached) > self.cap:
            evict_after = self.policy.victims(list(self.cached))[:len(self.cached) - self.cap]
            self.cached.difference_update(evict_after)
        return hp, hc, miss, evict_now, evict_after


# ----------------------------------------------------------------------------- helpers
def _mmap_array(shape: tuple, dtype, huge: bool = False) -> tuple[np.ndarray, mmap.mmap]:
    """A page-aligned array in a private anonymous mapping (not mmap's default MAP_SHARED: shared anonymous memory is
    shmem, which gets no transparent huge pages -- shmem_enabled is "never" by default -- and which MADV_DONTNEED only
    unmaps instead of freeing).  ``huge``: advised MADV_HUGEPAGE before any page is faulted in, so the populate and
    the reads fill 2 MB pages.  Only for an arena that will be filled whole: a first touch faults in the whole 2 MB
    page around it, so a partly used arena could hold up to 2 MB more than its slots, which no budget counts."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mm = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(mm, dtype=np.uint8, count=n)
    if huge:
        huge_pages(a.ctypes.data, n)
    return a.view(dtype).reshape(shape), mm


def _parse_usage(d, cfg: Optional[ModelConfig]) -> Optional[dict]:
    """{layer: counts} of a usage-history object, or None when it is not one (or belongs to another model)."""
    if not isinstance(d, dict) or d.get("version") != USAGE_VERSION or not isinstance(d.get("layers", {}), dict):
        return None
    if cfg is not None and d.get("config_hash") not in (None, config_hash(cfg)):
        return None
    try:
        out = {int(k): np.asarray(v, np.float64) for k, v in d.get("layers", {}).items()}
    except (TypeError, ValueError):
        return None
    if any(c.ndim != 1 or not np.isfinite(c).all() or (c < 0).any() for c in out.values()):
        return None
    return out


def _trusted_state_root(opt: str, labels: dict, src) -> Optional[str]:
    """The state directory (usage histories: which experts get pinned), checked like the kernels' and the compile
    cache's: one of ours others may write is made private; one others control (another owner, a parent others may
    write without the sticky bit) is refused when named and unused (no history) when it is the default."""
    root = paths.state_root(opt)
    if root is None:
        return None
    try:
        st = os.stat(root)
        if st.st_uid == os.getuid() and st.st_mode & 0o022:
            os.chmod(root, st.st_mode & 0o7755 & ~0o077)
    except OSError:
        pass
    why = dir_problem(root)
    if why is None:
        return root
    if opt:
        src.close()
        raise StoreError(f"{labels.get('state_dir') or '--state_dir'}={opt}: not used: {why} (other users could "
                         f"choose this run's pinned experts)")
    print(f"glm-jax: note: keeping no usage history ({root}: {why})", file=sys.stderr, flush=True)
    return None


def load_usage(path: str, cfg: Optional[ModelConfig] = None, strict: bool = False, label: str = "") -> dict:
    """{layer: float counts [E]} from a usage-history file.  Lenient (``{}`` if absent / unreadable / another
    model's) unless ``strict``: then a file that is not this model's usage history is a StoreError naming
    ``label`` (the flag or alias the user set)."""
    try:
        d = fileio.read_json(path)
    except OSError as e:
        if strict:
            raise StoreError(f"{label or path}: {path} is not a glm-jax usage-history file ({e})") from None
        return {}
    u = _parse_usage(d, cfg)
    if u is None:
        if strict:
            raise StoreError(f"{label or path}: {path} is not a usage history of this model (expected the JSON "
                             f"glm-jax writes to --state_dir, version {USAGE_VERSION}, same config)")
        return {}
    return u


def choose_pins(usage: dict, rec_bytes: dict, pin_bytes: float) -> dict:
    """Hottest (layer, expert) pairs by count, greedily within ``pin_bytes``: {layer: [experts]}."""
    items = sorted(((c, L, e) for L, cs in usage.items() if L in rec_bytes for e, c in enumerate(cs) if c > 0),
                   key=lambda t: (-t[0], t[1], t[2]))
    out, used = {}, 0
    for c, L, e in items:
        if used + rec_bytes[L] > pin_bytes:
            continue
        used += rec_bytes[L]
        out.setdefault(L, []).append(e)
    return out


def fetch_chunk(record_len: int, n: int, threads: int, chunk: int) -> int:
    """The byte ranges a read of ``n`` records is split into (0: one read per record): ranges (``balanced_chunk``)
    only where the records are fewer than the I/O threads, so that a lone miss is read by every thread; with at least
    as many records as threads each thread reads whole records.  Measured on the GLM-5.2 slice (20 MB records, 6.5
    misses a token at 7 of 256 cached): decode 1.07-1.17x with whole records against 1 MB ranges, three interleaved
    rounds; neutral where a layer misses one or two (docs/real-scale.md, disk reads)."""
    return 0 if n >= max(1, threads) else balanced_chunk(record_len, threads, chunk)


LANDED_GROUPS = 3     # a fetch's misses in this many groups at most: all but the last computed as soon as they land


def landed_groups(n: int) -> list:
    """[(start, end)] of ``n`` misses (in the order their reads were issued) in up to ``LANDED_GROUPS`` groups: the
    last is the last miss alone, the others split the rest near-equally.  ``fetch``'s ``landed`` is called for each
    but the last, whose compute is left to the caller once every read is done: one expert's compute after the last
    read instead of every miss's, at one more dispatch a group."""
    if n < 2:
        return [(0, n)] if n else []
    g = min(n - 1, LANDED_GROUPS - 1)
    return [((n - 1) * i // g, (n - 1) * (i + 1) // g) for i in range(g)] + [(n - 1, n)]


def _then(jobs: list, fin) -> list:
    """Wrap a record's read jobs so that whichever finishes last runs ``fin`` (its checksum) on that I/O thread,
    in parallel with the other records' reads instead of serially on the caller's thread."""
    left = [len(jobs)]
    lock = threading.Lock()

    def wrap(j):
        def run():
            n = j()
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fin()
            return n
        return run
    return [wrap(j) for j in jobs]


def working_set_released(src, layers) -> bool:
    """A layer's slots beyond its kept cache go back to the OS at the next fetch (``release_pages``: MADV_DONTNEED
    of whole slots) only where every section of a slot is a multiple of the page size; elsewhere a working set
    larger than the cap stays resident in every layer (memory.cache_slots then does not apply)."""
    return all(all(s.nbytes % mmap.PAGESIZE == 0 for s in src.layout(L).sections) for L in layers)


class _Layer:
    def __init__(self, layer, source, E, slots, aliased_ok, devices, kernel="xla"):
        import jax
        self.layer, self.E, self.S = layer, E, slots
        self.layout = source.layout(layer)
        self.arrays, self._mms = {}, []
        for s in self.layout.sections:
            # 2 MB pages where the arena has a slot for every expert (no limit: preload_all fills it whole)
            a, mm = _mmap_array((slots,) + tuple(s.shape), s.np_dtype, huge=slots >= E)
            self.arrays[s.name] = a
            self._mms.append(mm)
        self.slot_bytes = {n: a[0].nbytes if slots else 0 for n, a in self.arrays.items()}
        tiles = self.layout.fmt not in FLOAT_FORMATS            # container records: quantized in the tiles layout
        # one bank per device (a mesh shard's model-axis replicas alias the same arena on CPU)
        self.banks, self.aliased = [], True
        for device in devices:
            dev = {n: jax.device_put(a, device) for n, a in self.arrays.items()}
            aliased = aliased_ok and all(dev[n].unsafe_buffer_pointer() == a.ctypes.data
                                         for n, a in self.arrays.items())
            if not aliased:   # host staging + device copy updated per miss
                dev = {n: jax.device_put(np.array(a), device) for n, a in self.arrays.items()}
            self.aliased = self.aliased and aliased
            self.banks.append(with_kernel(ExpertBank(dev["gate_up"], dev["down"], dev.get("gate_up_scale"),
                                                     dev.get("down_scale"), fmt=self.layout.fmt,
                                                     layout="tiles" if tiles else "rows", hidden=self.layout.hidden,
                                                     inter=self.layout.inter), kernel))
        self.devices = list(devices)
        self.slot_of = np.full(E, -1, np.int32)
        self.free = list(range(slots - 1, -1, -1))
        self.touched: set = set()
        self.release: list = []
        self.pending: list = []          # prefetch loads in flight: lists of futures
        self.prefetched: set = set()     # experts loaded by prefetch, not yet asked for

    def dests(self, slot: int) -> dict:
        return {n: a[slot] for n, a in self.arrays.items()}

    def release_pages(self, keep: int):
        """MADV_DONTNEED free slots beyond ``keep`` touched slots (transient working set: ``spare``)."""
        if not self.release:
            return
        rel, self.release = self.spare(keep), []
        for slot in rel:
            ok = True
            for (n, a), mm in zip(self.arrays.items(), self._mms):
                nb = self.slot_bytes[n]
                if nb % mmap.PAGESIZE:
                    ok = False
                    continue
                try:
                    mm.madvise(mmap.MADV_DONTNEED, slot * nb, nb)
                except (AttributeError, OSError, ValueError):
                    ok = False
            if ok:
                self.touched.discard(slot)

    def spare(self, keep: int) -> list:
        """The free slots ``release_pages(keep)`` would return to the OS now (evicted, their pages faulted in, while
        more than ``keep`` slots are): the layer's transient working set once its computation is done."""
        out, n = [], len(self.touched)
        for slot in self.release:
            if n - len(out) <= keep:
                break
            if slot in self.touched and self.slot_of_slot(slot) < 0 and slot not in out:
                out.append(slot)
        return out

    def give_pages(self, slot: int, other: "_Layer", oslot: int) -> bool:
        """Move ``slot``'s pages to ``other``'s ``oslot`` (memory.move_pages, per record section; same section sizes):
        a spare slot's memory becomes another layer's fresh slot without a release and a refault.  False where the
        kernel refuses (the caller then lets the slot fault in, as before)."""
        for n, a in self.arrays.items():
            nb = self.slot_bytes[n]
            if not move_pages(a.ctypes.data + slot * nb, other.arrays[n].ctypes.data + oslot * nb, nb):
                return False
        self.touched.discard(slot)
        self.release = [s for s in self.release if s != slot]
        other.touched.add(oslot)
        return True

    def populate(self, n: int) -> bool:
        """Fault in the first ``n`` slots' pages (MADV_POPULATE_WRITE: page tables only, the contents are not
        touched, so it is safe while reads land in those slots), so that a miss into a fresh slot does not pay
        its page faults inside the read.  Slots are handed out from 0 up: these are the retained cache's slots.
        False where the kernel lacks it (< 5.14): the pages then fault in on first use, as before."""
        for name, mm in zip(list(self.arrays), list(self._mms)):
            nb = min(n, self.S) * self.slot_bytes[name]
            if nb:
                try:
                    mm.madvise(MADV_POPULATE_WRITE, 0, nb)
                except (AttributeError, OSError, ValueError):     # old kernel, or the store closed meanwhile
                    return False
        self.touched.update(range(min(n, self.S)))              # their pages are in (taken first, counted full)
        return True

    def evict(self, experts):
        """``experts`` leave their slots: the slots are free again, and their pages are returned to the OS at the
        next release (``release_pages``), once nothing in flight can read them."""
        for e in experts:
            s = int(self.slot_of[e])
            self.slot_of[e] = -1
            self.free.append(s)
            self.release.append(s)

    def slot_of_slot(self, slot: int) -> int:
        hit = np.nonzero(self.slot_of == slot)[0]
        return int(hit[0]) if len(hit) else -1

    @property
    def bank(self):
        return self.banks[0]

    def close(self):
        self.arrays = {}
        self.banks = []


class ExpertStore:
    """See the module docstring."""

    def __init__(self, source, cfg: ModelConfig, model_dir: str, cache_cap: int, pins: dict, policy: str,
                 io_threads: int, max_working_set: int, usage_path: Optional[str], sizing: dict, alias: bool = True,
                 read_chunk: int = 0, kernel: str = "xla", owned: Optional[list] = None, devices: Optional[list] = None,
                 owns_source: bool = True, slot_limit: Optional[int] = None, extra_slots: int = 0):
        import jax
        self.source, self.cfg, self.model_dir = source, cfg, model_dir
        self.cache_cap, self.policy_name, self.max_working_set = cache_cap, policy, max_working_set
        self.round_limit = None    # fetches of at most this many experts (limit_rounds), None: the slots' room
        self.sizing = sizing
        self.usage_path = usage_path
        self.sim_disk_gbps, self.sim_expert_mb = 0.0, 19.0   # --sim_disk_gbps (benchmarks only)
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="glm-jax-io")
        self.io_threads = io_threads
        self.read_chunk = int(read_chunk)
        devices = devices or [jax.devices()[0]]
        on_cpu = all(d.platform == "cpu" for d in devices) and alias
        self.owns_source = owns_source
        self.layers: dict = {}
        self.index: dict = {}
        self._usage: dict = {}
        self.owned: dict = {}          # layer -> bool [E]: the experts this store serves (a mesh shard's; default all)
        for L in source.expert_layers:
            E = source.num_experts(L)
            own = np.zeros(E, bool)
            own[list(range(E)) if owned is None else [e for e in owned if e < E]] = True
            n_own = int(own.sum())
            pinned = np.zeros(E, bool)
            pinned[pins.get(L, [])] = True
            P = int(pinned.sum())
            # a mesh shard: every shard the same slot count (slot_limit = experts per shard), so their arenas stack
            # extra_slots: room the cache may grow into later (grow_cap), address space only until used
            S = min(n_own if slot_limit is None else slot_limit, P + max(cache_cap + extra_slots, max_working_set))
            self.owned[L] = own
            self.layers[L] = _Layer(L, source, E, S, on_cpu, devices, kernel)
            self.index[L] = CacheIndex(E, min(cache_cap, n_own - P), S - P, policy, pinned)
            self._usage[L] = np.zeros(E, np.float64)
        self.aliased = all(lc.aliased for lc in self.layers.values())
        # fault in the retained cache's pages in the background (startup is not delayed; ~2 GB/s of page tables),
        # never more than the RAM budget holds (an explicit --cache_cap beyond it must not OOM the process at open)
        fits = sizing.get("cap_that_fits", cache_cap)
        todo = [(lc, int(self.index[L].pinned.sum()) + min(self.index[L].cap, fits)) for L, lc in self.layers.items()]
        self._closing = False
        self._populated = [False]
        self._populate = threading.Thread(
            target=lambda: self._populated.__setitem__(
                0, all(not self._closing and lc.populate(n) for lc, n in todo)), daemon=True,
            name="glm-jax-populate")
        self._populate.start()
        self._scatter = None
        self._move_ok = True             # memory.move_pages works here (the first refusal turns it off)
        self.reset_stats()
        # load pinned experts (counted: pin_bytes_read and bytes_read)
        t0 = time.perf_counter()
        for L, lc in self.layers.items():
            pe = np.nonzero(self.index[L].pinned)[0].tolist()
            if pe:
                slots = [lc.free.pop() for _ in pe]
                n = self._read_many(L, pe, slots)
                self._stats["pin_bytes_read"] += n
                self._stats["pinned_experts"] += len(pe)
                for e, s in zip(pe, slots):
                    lc.slot_of[e] = s
                self._sync_device(lc, slots)
        self._stats["pin_load_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, model_dir: str, cfg: ModelConfig, cache_cap: Optional[int] = None, ram_gb: Optional[float] = None,
             direct_io: bool = False, io_threads: int = 4, read_chunk_mb: float = 1.0, pin=None, pin_gb: float = 0.0,
             policy: str = "lru",
             used_bytes: int = 0, kv_bytes: int = 0, max_working_set: Optional[int] = None,
             verify: str = "first", source=None, alias: bool = True, state_dir: str = "",
             labels: Optional[dict] = None, kernel: str = "xla", owned: Optional[list] = None, share: int = 1,
             devices: Optional[list] = None, owns_source: bool = True,
             slot_limit: Optional[int] = None, headroom_bytes: int = 0) -> "ExpertStore":
        """``used_bytes``: what the rest of the process holds or will hold (the engine passes its resident set at
        open -- runtime + dense weights -- plus a reserve for compilation); ``kv_bytes``: the KV cache it will
        allocate.  The expert cache gets the RAM budget minus those, the I/O buffers, one layer's transient working
        set and the pins.  ``alias=False`` forces the non-CPU path (host staging + donated scatter of missed slots;
        tests).  ``state_dir``: where the usage history lives (``paths.state_root``: '' = the per-user default,
        'off' = none).  ``labels``: option name -> where the user set it (flag / alias), for messages.
        A mesh shard (``ShardedStore``): ``owned`` the expert ids it serves (pins chosen among them), ``share`` the
        number of shards this process's budget is split over, ``devices`` where its banks live (the shard's
        model-axis replicas), ``owns_source=False`` when the shards share one open source.  ``headroom_bytes``:
        part of ``used_bytes`` that may come back (the first compile's transient memory): the arenas get room for
        that many more experts, which ``grow_cap`` hands to the cache once it is measured free."""
        labels = labels or {}
        if policy not in POLICIES:
            raise StoreError(f"unknown cache policy {policy!r} (expected one of {', '.join(POLICIES)})")
        src = source if source is not None else (
            open_expert_source(model_dir, cfg, verify=verify, direct_io=direct_io))
        layers = list(src.expert_layers)
        if not layers:
            raise StoreError(f"{model_dir}: no routed expert layers to stream")
        E = max(src.num_experts(L) for L in layers)
        if owned is not None:
            E = len(owned)
        W = min(E, max_working_set if max_working_set else cfg.num_experts_per_tok)
        rec = {L: src.layout(L).record_len for L in layers}
        rec_sum = sum(rec.values())
        max_rec = max(rec.values())
        usage_path = paths.usage_file(_trusted_state_root(state_dir, labels, src), model_dir)
        pins = {}
        if pin:
            plabel = labels.get("pin") or "--pin"
            if pin == "auto":
                if usage_path is None:
                    src.close()
                    raise StoreError(f"{plabel}=auto: no usage history is kept with --state_dir=off")
                usage = load_usage(usage_path, cfg)          # none yet (a first run): no pins
            else:
                if not os.path.isfile(pin):
                    src.close()
                    raise StoreError(f"{plabel}={pin}: file not found")
                try:
                    usage = load_usage(pin, cfg, strict=True, label=f"{plabel}={pin}")
                except StoreError:
                    src.close()
                    raise
            if owned is not None:       # a shard pins among its own experts, within its share of --pin_gb
                mask = np.zeros(max(len(c) for c in usage.values()) if usage else 0, bool)
                mask[[e for e in owned if e < len(mask)]] = True
                usage = {L: np.where(mask[:len(c)], c, 0.0) for L, c in usage.items()}
            pins = choose_pins(usage, rec, pin_gb * 1e9 / max(1, share))
        pin_bytes = sum(rec[L] * len(v) for L, v in pins.items())
        if ram_gb:
            budget, why = ram_gb * 1e9, "--ram_gb"
        else:
            budget, why = default_budget()
        # the reads' staging buffers + one layer's working set (its cached experts among it: memory.cache_slots)
        staging = src.read_buffer_bytes(io_threads)
        buffers = staging + max(0, W) * max_rec
        avail = budget - used_bytes - kv_bytes - staging - pin_bytes
        if share > 1:       # this shard's part of what the process has left (the shards' buffers and pins too)
            avail = (budget - used_bytes - kv_bytes) / share - staging - pin_bytes
        released = working_set_released(src, layers)
        fit = cache_slots(avail, rec_sum, max_rec, W, released) if rec_sum else E
        sizing = dict(budget_bytes=int(budget), budget_from=why, used_bytes=int(used_bytes), kv_bytes=int(kv_bytes),
                      buffer_bytes=int(buffers), pin_bytes=int(pin_bytes), per_cap_bytes=int(rec_sum),
                      max_record_bytes=int(max_rec), working_set=int(W), working_set_released=released,
                      cap_that_fits=max(0, min(fit, E)))
        if cache_cap is None:
            if fit < 1:
                # the working set beyond the fetched layer's one cached expert
                beyond = buffers - (max_rec if released else 0)
                need = (used_bytes + kv_bytes + share * (beyond + pin_bytes + rec_sum)) / 1e9
                src.close()
                rlabel = (labels.get("ram_gb") or "--ram_gb") if ram_gb else why
                raise RamBudgetError(
                    f"RAM budget {budget / 1e9:.2f} GB ({rlabel}) too small: the process (runtime, dense weights, "
                    f"compile reserve) {used_bytes / 1e9:.2f} + KV {kv_bytes / 1e9:.2f} + I/O buffers and one layer's "
                    f"working set{' beyond its cached expert' if released else ''} {beyond / 1e9:.2f} + pinned {pin_bytes / 1e9:.2f} GB leave "
                    f"{max(avail - beyond + staging, 0) / 1e9:.2f} GB, but one expert per layer needs "
                    f"{rec_sum / 1e9:.2f} GB; "
                    f"--ram_gb >= {round_up_gb(need):.2f} would fit"
                    + (f" (or a smaller --pin_gb than {pin_gb:g})" if pin_bytes else "")
                    + "; smaller dense weights: --dense_format=int8_row (or a container converted with "
                      "glm-jax-convert --dense_format=int8); a shorter --max_seq_len")
            cache_cap = min(fit, E)
        cache_cap = int(max(1, min(cache_cap, E)))
        if read_chunk_mb < 0:
            src.close()
            raise StoreError(f"--read_chunk_mb={read_chunk_mb}: must be >= 0 (0 = one read per record)")
        extra = int(headroom_bytes // rec_sum) if rec_sum and headroom_bytes > 0 else 0
        return cls(src, cfg, model_dir, cache_cap, pins, policy, io_threads, W, usage_path, sizing, alias,
                   read_chunk=int(read_chunk_mb * (1 << 20)), kernel=kernel, owned=owned, devices=devices,
                   owns_source=owns_source, slot_limit=slot_limit, extra_slots=extra)

    # ------------------------------------------------------------------ I/O
    def _submit(self, L: int, experts: list, slots: list) -> list:
        """Issue every read of these records at once, in their order (records split into ``read_chunk`` byte
        ranges; a record's checksum runs on the thread that completes its last range); returns each record's
        futures (bytes each)."""
        lc = self.layers[L]
        chunk = fetch_chunk(lc.layout.record_len, len(experts), self.io_threads, self.read_chunk)
        recs = []
        for e, s in zip(experts, slots):
            jobs, fin = self.source.read_jobs(L, e, lc.dests(s), chunk)
            recs.append([self._pool.submit(j) for j in _then(jobs, fin)])
        return recs

    def _read_many(self, L: int, experts: list, slots: list, during=None, landed=None) -> int:
        """Read the records into the slots.  ``during()`` runs once every read is issued; ``landed(experts,
        slots)`` (fetch's) for each group of ``landed_groups`` but the last, in order, as soon as its records have
        been read and checked, while the later ones are still being read."""
        t = time.perf_counter()
        lc = self.layers[L]
        if self.io_threads <= 1 and len(experts) == 1:     # no thread hop for a single read on one thread
            if during is not None:
                t = self._during(during, t)
            jobs, fin = self.source.read_jobs(L, experts[0], lc.dests(slots[0]), 0)
            n = sum(j() for j in jobs)
            fin()
        else:
            recs = self._submit(L, experts, slots)
            n, done = 0, 0
            try:
                if during is not None:
                    t = self._during(during, t)
                for a, b in (landed_groups(len(experts))[:-1] if landed is not None else ()):
                    n += sum(f.result() for fs in recs[a:b] for f in fs)
                    done = b
                    t = self._during(functools.partial(landed, experts[a:b], slots[a:b]), t)
                    self._stats["landed"] += 1
            finally:                # (a failure raises once no read is writing into the slots)
                n += sum(f.result() for fs in recs[done:] for f in fs)
        if self.sim_disk_gbps > 0:
            time.sleep(self._sim_disk(len(experts)))
        self._stats["bytes_read"] += n
        self._stats["read_s"] += time.perf_counter() - t
        lc.touched.update(slots)
        return n

    def _during(self, during, t: float) -> float:
        """Run a fetch's ``during`` with its misses' reads issued; its time is counted apart (overlap_s), not as
        waiting for the reads.  Returns ``t`` moved on by that time."""
        t0 = time.perf_counter()
        during()
        dt = time.perf_counter() - t0
        self._stats["overlapped"] += 1
        self._stats["overlap_s"] += dt
        return t + dt

    def _sim_disk(self, n_experts: int) -> float:
        """Benchmark aid (--sim_disk_gbps): seconds that ``n_experts`` loads of ``sim_expert_mb`` MB would take on a
        disk of that bandwidth; counted apart (sim_io_s, sim_bytes), bytes_read stays what was really read."""
        sim = n_experts * self.sim_expert_mb * 1e6
        self._stats["sim_io_s"] += sim / (self.sim_disk_gbps * 1e9)
        self._stats["sim_bytes"] += int(sim)
        return sim / (self.sim_disk_gbps * 1e9)

    def _wait_pending(self, L: int):
        """Block until the layer's prefetch loads have landed (their bytes counted now, where they are known)."""
        lc = self.layers[L]
        if not lc.pending:
            return
        t = time.perf_counter()
        pend, lc.pending = lc.pending, []
        n = 0
        for experts, slots, futs in pend:
            try:
                n += sum(f.result() for f in futs)
            except Exception as e:      # noqa: BLE001  (a prefetch is a guess: undone; a fetch reads them again)
                for f in futs:
                    f.exception()       # every read of the group finished before its slots are freed
                with self._lock:
                    self._undo_prefetch(L, lc, experts, slots)
                self._read_failed(e)
        dt = time.perf_counter() - t
        with self._lock:
            self._stats["bytes_read"] += n
            self._stats["prefetch_bytes"] += n
            self._stats["prefetch_wait_s"] += dt
            self._stats["io_wait_s"] += dt

    def _sync_device(self, lc: _Layer, slots: list):
        """Non-aliased backends: send only the given slots to the device bank (donated in-place update)."""
        if lc.aliased or not slots:
            return
        import jax
        if self._scatter is None:
            def scatter(bank, idx, rows):
                upd = {n: getattr(bank, n).at[idx].set(r) for n, r in rows.items()}
                return dataclasses.replace(bank, gate_up=upd["gate_up"], down=upd["down"],
                                           gate_up_scale=upd.get("gate_up_scale"), down_scale=upd.get("down_scale"))
            self._scatter = jax.jit(scatter, donate_argnums=(0,))
        idx = np.asarray(slots, np.int32)
        rows = {n: a[idx] for n, a in lc.arrays.items()}
        lc.banks = [self._scatter(b, jax.device_put(idx, d), jax.device_put(rows, d))
                    for b, d in zip(lc.banks, lc.devices)]

    # ------------------------------------------------------------------ the contract
    def _layer(self, layer: int) -> _Layer:
        try:
            return self.layers[layer]
        except KeyError:
            raise StoreError(f"layer {layer} has no streamed routed experts (expert layers: "
                             f"{sorted(self.layers)})") from None

    def call_limit(self, layer: int) -> int:
        """The most distinct non-pinned experts one ``fetch`` of ``layer`` can serve (its slots beyond the pins, or
        fewer where ``limit_rounds`` lowered the working set)."""
        room = self.index[self._layer(layer).layer].room
        return room if self.round_limit is None else min(room, self.round_limit)

    def limit_rounds(self, w: Optional[int]):
        """From the next fetch on, fetch at most ``w`` experts at a time (None: the working set the store was
        opened with): a larger union (a decode's experts) is fetched and computed in rounds of ``w``, so a fetch
        holds at most ``w`` slots at once.  MemoryGuard.memory_guard lowers it to make room for a longer K/V cache
        where the expert cache at its floor is not enough, and the refit puts it back when there is room."""
        with self._lock:
            self.round_limit = None if w is None or w >= (self.max_working_set or 0) else max(1, int(w))
            self.sizing["working_set"] = self.max_working_set if self.round_limit is None else self.round_limit

    def peek(self, layer: int):
        """(bank, slot_of copy) as they are now, without loading anything: lets the engine start computing the
        experts that are already resident while ``fetch`` reads the misses (a later ``fetch`` of a union only
        writes slots of experts outside that union)."""
        lc = self._layer(layer)
        self._wait_pending(layer)
        with self._lock:
            return lc.bank, lc.slot_of.copy()

    def fetch(self, layer: int, expert_ids, during=None, landed=None):
        """Make every id in ``expert_ids`` resident; returns (ExpertBank, slot_of int32 [E]).  ``during`` (no
        arguments) is called once the misses' reads have been issued, before they are waited for (at once where there
        are none): the caller dispatches work on the experts already resident there, so that it runs beside the reads
        even where XLA:CPU runs a program inline on the calling thread (it does for one it costs under 1000 flops --
        a program of native kernels alone).  It must not call the store; the slots it reads are those of experts in
        ``expert_ids`` that were resident, which this fetch does not write.  ``landed(experts, bank, slot_of)``
        (aliased banks, two misses or more) is called for each group of the misses but the last (``landed_groups``)
        once its records are read and checked, while the later ones are still being read: the caller computes on
        them beside those reads (``slot_of``: those experts' slots; the same rule as ``during``)."""
        t0 = time.perf_counter()
        lc = self._layer(layer)
        ids = np.asarray(expert_ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= lc.E):
            raise StoreError(f"layer {layer}: expert id out of range [0, {lc.E}): {ids.min()}..{ids.max()}")
        union = list(dict.fromkeys(int(e) for e in ids))
        if union and not self.owned[layer][union].all():
            raise StoreError(f"layer {layer}: internal: experts {[e for e in union if not self.owned[layer][e]]} "
                             f"belong to another mesh shard")
        t1 = time.perf_counter()
        self._wait_pending(layer)
        wait_pf = time.perf_counter() - t1
        with self._lock:
            self._usage[layer] += np.bincount(ids.astype(np.int64), minlength=lc.E)[:lc.E]
            idx = self.index[layer]
            hp, hc, miss, ev_now, ev_after = idx.access(union)
            hpf = [e for e in hc if e in lc.prefetched]
            self._stats["prefetch_unused"] += len(lc.prefetched) - len(hpf)
            lc.prefetched.clear()
            for e in ev_now:
                lc.free.append(int(lc.slot_of[e]))
                lc.slot_of[e] = -1
            slots = self._take_slots(layer, lc, len(miss))
            # earlier computations are finished (module docstring): the transient pages nobody took go to the OS
            self._release_transient()
            t1 = time.perf_counter()
            o0 = self._stats["overlap_s"]
            land = None
            if landed is not None and lc.aliased and len(miss) > 1:
                def land(es, ss):           # the bank aliases the arenas: the landed slots hold their experts now
                    so = lc.slot_of.copy()
                    so[es] = ss
                    landed(es, lc.bank, so)
            if miss:
                try:
                    self._read_many(layer, miss, slots, during, land)
                except BaseException as e:
                    self._undo_fetch(layer, lc, miss, slots, ev_after, ids)
                    self._read_failed(e)
                    raise
                self.health["consecutive"] = 0
                self.last_error = None
            elif during is not None:
                during()
            ov = self._stats["overlap_s"] - o0     # the caller's work beside the reads: neither waiting nor the store's
            t1 += ov
            t2 = time.perf_counter()
            for e, s in zip(miss, slots):
                lc.slot_of[e] = s
            self._sync_device(lc, slots)
            out_slot_of = lc.slot_of.copy()
            lc.evict(ev_after)
            st = self._stats
            st["fetch_calls"] += 1
            st["requested"] += len(union)
            st["hits_pinned"] += len(hp)
            st["hits_cache"] += len(hc) - len(hpf)
            st["prefetch_hits"] += len(hpf)
            st["misses"] += len(miss)
            st["expert_loads"] += len(miss)
            st["evictions"] += len(ev_now) + len(ev_after)
            st["loads_per_layer"][layer] = st["loads_per_layer"].get(layer, 0) + len(miss)
            st["io_wait_s"] += t2 - t1
            st["fetch_s"] += time.perf_counter() - t0 - wait_pf - ov
            return lc.bank, out_slot_of

    def _undo_fetch(self, layer: int, lc: _Layer, miss: list, slots: list, ev_after: list, ids):
        """A fetch whose reads failed (short read, checksum, EIO, a missing file): the store as it was but for the
        experts evicted to make room (their slots may hold part of a miss now): the misses not cached, their slots
        free, the experts evicted after the reads still cached in their slots, the usage counts unchanged.  Caller
        holds the lock; no read is in flight (_read_many waits for all before raising)."""
        idx = self.index[layer]
        idx.cached.difference_update(miss)
        idx.cached.update(e for e in ev_after if lc.slot_of[e] >= 0 and e not in miss)
        for e in miss:
            lc.slot_of[e] = -1
        lc.free.extend(slots)
        self._usage[layer] -= np.bincount(ids.astype(np.int64), minlength=lc.E)[:lc.E]

    def _undo_prefetch(self, layer: int, lc: _Layer, experts: list, slots: list):
        idx = self.index[layer]
        for e, s in zip(experts, slots):
            if lc.slot_of[e] == s:
                lc.slot_of[e] = -1
                idx.cached.discard(e)
                lc.prefetched.discard(e)
                lc.free.append(s)

    def _read_failed(self, e: BaseException):
        """Counted for /health (a store that keeps failing) and kept as the error a compiled program's host callback
        raised (``take_error``: fetch=fused / callback runs fetch inside XLA, which wraps the error)."""
        if not isinstance(e, Exception):
            return
        h = self.health
        h["errors"] += 1
        h["consecutive"] += 1
        h["last"] = " ".join(str(e).split())[:300]
        self.last_error = e if isinstance(e, GlmJaxError) else StoreError(f"expert read failed: {h['last']}")

    def take_error(self):
        """The last read error (then forgotten), or None."""
        e, self.last_error = self.last_error, None
        return e

    def replay_hits(self, layer: int, unions: list) -> bool:
        """``fetch(layer, u)`` for each ``u`` (ids without repeats) in order, where every expert of every ``u`` is
        already resident: the same bookkeeping (usage, the policy's order, the hit counters) in one pass instead of a
        call each -- a fused program's layers that skipped the host, replayed between its dispatches.  Returns False,
        having changed nothing, where that does not hold (a miss, a prefetched expert not asked for yet, a cache
        over its cap): the caller then calls ``fetch`` for each."""
        t0 = time.perf_counter()
        lc = self._layer(layer)
        if not unions:
            return True
        self._wait_pending(layer)
        with self._lock:
            idx = self.index[layer]
            cat = np.concatenate([np.asarray(u, np.int64).reshape(-1) for u in unions])
            if lc.prefetched or len(idx.cached) > idx.cap or max(len(u) for u in unions) > idx.room:
                return False
            if cat.size and (cat.min() < 0 or cat.max() >= lc.E or not self.owned[layer][cat].all()):
                return False
            have = idx.pinned.copy()
            have[list(idx.cached)] = True
            if not have[cat].all():
                return False
            self._usage[layer] += np.bincount(cat, minlength=lc.E)[:lc.E]
            self._release_transient()
            idx.policy.touch_many(unions)
            pinned = int(idx.pinned[cat].sum())
            st = self._stats
            st["fetch_calls"] += len(unions)
            st["requested"] += int(cat.size)
            st["hits_pinned"] += pinned
            st["hits_cache"] += int(cat.size) - pinned
            st["loads_per_layer"][layer] = st["loads_per_layer"].get(layer, 0)
            st["fetch_s"] += time.perf_counter() - t0
            return True

    def _take_slots(self, layer: int, lc: _Layer, n: int) -> list:
        """``n`` free slots of ``lc`` for a fetch's misses: slots whose pages are faulted in first; a fresh slot
        takes the pages of a slot another layer would return to the OS now (its transient working set, evicted at
        the end of its fetch: ``_Layer.spare``), moved instead of released, zero-filled and faulted in again.  Safe
        under the argument of the module docstring: when ``fetch`` runs, no computation reads another layer's free
        slots.  Caller holds the lock."""
        warm = [s for s in lc.free if s in lc.touched][-n:] if n else []
        cold = [s for s in reversed(lc.free) if s not in lc.touched][:n - len(warm)]
        taken = set(warm) | set(cold)
        lc.free = [s for s in lc.free if s not in taken]
        lc.release = [s for s in lc.release if s not in taken]
        todo = list(cold)
        for L2, lc2 in self.layers.items():
            if not todo or not self._move_ok:
                break
            if lc2 is lc or not lc2.release or lc2.slot_bytes != lc.slot_bytes:
                continue
            for s2 in lc2.spare(int(self.index[L2].pinned.sum()) + self.index[L2].cap):
                if not todo:
                    break
                if not lc2.give_pages(s2, lc, todo[0]):
                    self._move_ok = False
                    break
                todo.pop(0)
                self._stats["pages_moved"] += 1
        return list(reversed(warm)) + cold

    def _release_transient(self):
        for L2, lc2 in self.layers.items():     # only layers with slots to return (75 layers: 75 x 75 sums/token)
            if lc2.release:
                lc2.release_pages(int(self.index[L2].pinned.sum()) + self.index[L2].cap)

    def release_transient(self):
        """Return the last fetch's transient slots (a working set beyond the cap) to the OS now, as the next fetch
        would: for a measurement of what the process holds between forwards (the caller has no computation in
        flight that reads a bank)."""
        with self._lock:
            self._release_transient()

    def unfilled_bytes(self) -> int:
        """Bytes the cache's slots will take once every layer holds its cap (and pins) and that no page holds yet:
        a cap just grown (``grow_cap``) fills as experts are read, so a measurement of the process's memory before
        then must add them (MemoryGuard.memory_guard, MemoryGuard.refit)."""
        with self._lock:
            return sum(max(0, int(self.index[L].pinned.sum()) + self.index[L].cap - len(lc.touched))
                       * sum(lc.slot_bytes.values()) for L, lc in self.layers.items())

    def grow_cap(self, free_bytes: int) -> int:
        """Give ``free_bytes`` (measured free inside the budget) to the cache: each layer's cap grows by
        free_bytes / (one expert of every layer), up to the slots its arena has room for.  Waits for the
        background page population first (the retained slots' pages must already be counted in what was
        measured); a no-op where it did not run.  Returns the cache cap (experts per layer)."""
        self._populate.join(timeout=60)
        per = self.sizing.get("per_cap_bytes", 0)
        n = int(free_bytes // per) if per and free_bytes > 0 and self._populated[0] else 0
        if n > 0:
            with self._lock:
                before = self.cache_cap
                for L, lc in self.layers.items():
                    idx = self.index[L]
                    P = int(idx.pinned.sum())
                    idx.cap = int(min(idx.cap + n, lc.S - P, int(self.owned[L].sum()) - P))
                self.cache_cap = max(ix.cap for ix in self.index.values())
                self.sizing["grown_by"] = self.sizing.get("grown_by", 0) + n
                self.sizing["taken"] = max(0, self.sizing.get("taken", 0) - (self.cache_cap - before))
        return self.cache_cap

    def shrink_cap(self, need_bytes: int) -> int:
        """Give ``need_bytes`` back from the cache: each layer's cap is lowered by need_bytes / (one expert of every
        layer), rounded up, never below one expert; the experts beyond it (the policy's victims) are evicted and
        their slots' pages returned to the OS now.  The engine calls it between forwards (no computation in flight
        reads a bank: module docstring) when the run outgrows its memory plan -- a KV cache grown past its
        reservation, programs compiled since -- and ``grow_cap`` hands the room back once it is measured free.
        A step that frees nothing is not taken (MemoryGuard._keep_free lowers the working set for those).
        Returns the cache cap (experts per layer)."""
        if not self.sizing.get("per_cap_bytes", 0) or need_bytes <= 0:
            return self.cache_cap
        c, saved = self.cache_cap, 0
        while saved < need_bytes and c > 1:
            c -= 1
            saved += self._step_bytes(c)
        # no step that frees nothing: below the working set of one streamed layer, the fetched layer's transient
        # slots take every evicted expert's room again (GLM-5.2 slice: cache 32 -> 1 for 34 MB)
        while c < self.cache_cap and self._step_bytes(c) <= 0:
            c += 1
        n = self.cache_cap - c
        if n <= 0:
            return self.cache_cap
        for L in self.layers:
            self._wait_pending(L)            # prefetches in flight write into slots: let them land first
        with self._lock:
            for L, lc in self.layers.items():
                idx = self.index[L]
                idx.cap = max(1, idx.cap - n)
                if len(idx.cached) > idx.cap:
                    ev = idx.policy.victims(list(idx.cached))[:len(idx.cached) - idx.cap]
                    idx.cached.difference_update(ev)
                    lc.prefetched.difference_update(ev)
                    lc.evict(ev)
                    self._stats["evictions"] += len(ev)
            self._release_transient()
            self.cache_cap = max(ix.cap for ix in self.index.values())
            self.sizing["shrunk_by"] = self.sizing.get("shrunk_by", 0) + n
            self.sizing["taken"] = self.sizing.get("taken", 0) + n      # cap steps grow_cap has not given back
        return self.cache_cap

    def _step_bytes(self, c: int, working_set: Optional[int] = None) -> int:
        """What lowering the cap to ``c`` experts a layer (from c + 1) saves: one expert of every layer, less, below
        the working set, the one the fetched layer still holds while it computes (its transient slot:
        memory.cache_slots).  ``working_set``: at that working set instead of the current one."""
        W = self.sizing.get("working_set", 0) if working_set is None else working_set
        mx = self.sizing.get("max_record_bytes", 0)
        rel = self.sizing.get("working_set_released", False)
        return self.sizing.get("per_cap_bytes", 0) - (mx if rel and c < W else 0)

    def shrink_room(self, working_set: Optional[int] = None) -> int:
        """The most ``shrink_cap`` can give back: every layer's cap lowered to one expert (at ``working_set``:
        with the working set lowered to that first, limit_rounds)."""
        return sum(self._step_bytes(c, working_set) for c in range(1, self.cache_cap))

    def can_hold_all(self) -> bool:
        """Every expert of every layer fits in the cache (its cap is the layer's expert count)."""
        return all(int(self.index[L].pinned.sum()) + self.index[L].cap >= int(self.owned[L].sum())
                   and lc.S >= int(self.owned[L].sum()) for L, lc in self.layers.items())

    def preload_all(self):
        """Load every expert of every layer (the model fits the RAM budget): afterwards no forward needs the store
        and the engine runs one compiled step per token over the slot arenas (``resident_view``).  Counted apart
        (``preload_bytes_read``, ``preload_s``), not as the first tokens' misses; not added to the usage history."""
        t0 = time.perf_counter()
        with self._lock:
            n = 0
            for L, lc in self.layers.items():
                self._wait_pending(L)
                idx = self.index[L]
                todo = [e for e in np.nonzero(self.owned[L])[0].tolist() if not idx.pinned[e] and e not in idx.cached]
                slots = [lc.free.pop() for _ in todo]
                if todo:
                    n += self._read_many(L, todo, slots)
                for e, s in zip(todo, slots):
                    lc.slot_of[e] = s
                    idx.cached.add(e)
                idx.policy.touch(todo)
                self._sync_device(lc, slots)
        dt = time.perf_counter() - t0
        pinned = self._stats["pinned_experts"]
        self.reset_stats()
        self._stats.update(pinned_experts=pinned, preload_bytes_read=n, preload_s=dt)

    def all_resident(self) -> bool:
        """Every expert of every layer is in its slot arena (nothing to fetch for any routing)."""
        return all(bool((lc.slot_of[self.owned[L]] >= 0).all()) and not lc.pending for L, lc in self.layers.items())

    def resident_view(self) -> dict:
        """{layer: (bank, slot_of int32 [E])} while ``all_resident()``: no forward can miss, so no fetch runs and
        nothing rewrites a slot; the banks alias the arenas (no copy)."""
        return {L: (lc.bank, lc.slot_of.copy()) for L, lc in self.layers.items()}

    def drop_cache(self, page_cache: bool = True):
        """Make the store cold: forget every cached (non-pinned) expert and, with ``page_cache``, ask the kernel to
        drop the expert files from the page cache (posix_fadvise DONTNEED).  Benchmarks call this between runs."""
        for L in self.layers:
            self._wait_pending(L)
        with self._lock:
            for L, lc in self.layers.items():
                idx = self.index[L]
                for e in list(idx.cached):
                    s = int(lc.slot_of[e])
                    lc.slot_of[e] = -1
                    if s >= 0:
                        lc.free.append(s)
                        lc.release.append(s)
                idx.cached.clear()
                lc.prefetched.clear()
        if page_cache:
            evict_page_cache(self.source.files())

    def resident_mask(self, layer: int) -> np.ndarray:
        idx = self.index[self._layer(layer).layer]
        m = idx.pinned.copy()
        m[list(idx.cached)] = True
        return m

    def pinned_mask(self, layer: int) -> np.ndarray:
        return self.index[self._layer(layer).layer].pinned.copy()

    def prefetch(self, layer: int, expert_ids) -> int:
        """Start background loads of the non-resident experts among ``expert_ids`` into free slots of ``layer``
        (never evicting; as many as there are free slots).  They count as cached at once; ``fetch``/``peek`` of the
        layer wait for them.  Returns the number of loads started.  Only call it for a layer that no dispatched
        computation of the current forward reads (the engine: layer L+1, right after fetch(L))."""
        if layer not in self.layers:
            return 0
        lc, idx = self.layers[layer], self.index[layer]
        with self._lock:
            ids = dict.fromkeys(int(e) for e in np.asarray(expert_ids).reshape(-1).tolist())
            todo = [e for e in ids if 0 <= e < lc.E and self.owned[layer][e] and not idx.pinned[e]
                    and e not in idx.cached][:len(lc.free)]
            if not todo:
                return 0
            slots = [lc.free.pop() for _ in todo]
            taken = set(slots)
            lc.release = [s for s in lc.release if s not in taken]     # never madvise a slot being written
            lc.touched.update(slots)
            for e, s in zip(todo, slots):
                lc.slot_of[e] = s
                idx.cached.add(e)
            lc.prefetched.update(todo)
            futs = [f for fs in self._submit(layer, todo, slots) for f in fs]
            if self.sim_disk_gbps > 0:      # the simulated disk time runs in the background too
                futs.append(self._pool.submit(lambda t=self._sim_disk(len(todo)): time.sleep(t) or 0))
            lc.pending.append((todo, slots, futs))
            self._stats["prefetch_loads"] += len(todo)
            self._stats["expert_loads"] += len(todo)
            self._stats["loads_per_layer"][layer] = self._stats["loads_per_layer"].get(layer, 0) + len(todo)
            return len(todo)

    def stats(self) -> dict:
        s = dict(self._stats)
        s["loads_per_layer"] = dict(s["loads_per_layer"])
        s["hits"] = s["hits_pinned"] + s["hits_cache"]      # prefetch_hits are loads of this token, not hits
        s["hit_rate"] = s["hits"] / s["requested"] if s["requested"] else 0.0
        s["read_gbps"] = s["bytes_read"] / s["io_wait_s"] / 1e9 if s["io_wait_s"] > 0 else 0.0
        s.update(cache_cap=self.cache_cap, policy=self.policy_name, aliased=self.aliased,
                 max_working_set=self.max_working_set, io_threads=self.io_threads, read_chunk=self.read_chunk)
        return s

    def reset_stats(self):
        if not hasattr(self, "health"):     # expert reads that failed (/health): not a run's statistics
            self.health = dict(errors=0, consecutive=0, last=None)
            self.last_error = None
        self._stats = dict(bytes_read=0, expert_loads=0, hits_pinned=0, hits_cache=0, misses=0, evictions=0,
                           requested=0, fetch_calls=0, io_wait_s=0.0, read_s=0.0, fetch_s=0.0,
                           loads_per_layer={}, prefetch_loads=0, prefetch_hits=0, prefetch_unused=0,
                           prefetch_bytes=0, prefetch_wait_s=0.0, pin_bytes_read=0,
                           pinned_experts=getattr(self, "_stats", {}).get("pinned_experts", 0), pin_load_s=0.0,
                           preload_bytes_read=getattr(self, "_stats", {}).get("preload_bytes_read", 0),
                           preload_s=getattr(self, "_stats", {}).get("preload_s", 0.0),
                           sim_io_s=0.0, sim_bytes=0, pages_moved=0, overlapped=0, overlap_s=0.0,
                           landed=0)

    def save_usage(self, decay: float = 1.0):
        """Merge this session's routing counts into the usage-history file (best effort, never raises).  The
        read-modify-write holds an exclusive lock (``flock`` on ``<file>.lock``) and the file is replaced atomically,
        so concurrent sessions add up instead of overwriting each other's counts."""
        if not self.usage_path:
            return
        try:
            os.makedirs(os.path.dirname(self.usage_path), exist_ok=True)
            with open(self.usage_path + ".lock", "a") as lock:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                old = load_usage(self.usage_path, self.cfg)
                layers = {}
                for L, c in self._usage.items():
                    prev = old.get(L)
                    tot = c + (decay * prev if prev is not None and len(prev) == len(c) else 0.0)
                    layers[str(L)] = [round(float(x), 3) for x in tot]
                for L, c in old.items():
                    layers.setdefault(str(L), c.tolist())
                tmp = self.usage_path + f".{os.getpid()}.{threading.get_ident()}.tmp"
                try:
                    with open(tmp, "w") as f:
                        json.dump({"version": USAGE_VERSION, "config_hash": config_hash(self.cfg),
                                   "model": getattr(self, "model_dir", ""), "layers": layers}, f)
                    os.replace(tmp, self.usage_path)
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)
        except OSError:
            pass

    def close(self, save_usage: bool = True):
        self._closing = True
        if save_usage and any(c.any() for c in self._usage.values()):
            self.save_usage()
        for lc in self.layers.values():
            for futs in lc.pending:
                cf.wait(futs)
            lc.pending = []
        self._pool.shutdown(wait=True)
        self._populate.join()
        if self.owns_source:
            self.source.close()
        for lc in self.layers.values():
            lc.close()
        self.layers = {}


class ShardedStore:
    """The expert store of a mesh process: one ``ExpertStore`` per expert shard this process holds (shard d serves
    experts ``[d*E/n, (d+1)*E/n)`` from its own slot arena, on the devices of mesh row d), behind the same contract.
    ``fetch`` splits the union by shard and returns the mesh bank (every shard's arena as one array sharded over
    the ``expert`` axis, no copy) and its slot map ``[n, E]``.  In a multi-process run each process reads only its
    own shards' experts; the union (every process computes the same routing) names experts of other processes too,
    and those are theirs to load."""

    def __init__(self, plan, stores: dict, source, E: int):
        self.plan, self.stores, self.source, self.E = plan, stores, source, E
        self.per = plan.experts_per_shard(E)
        first = next(iter(stores.values()))
        self.cache_cap, self.policy_name = first.cache_cap, first.policy_name
        self.max_working_set, self.sizing = first.max_working_set, first.sizing
        self._rows = dict(plan.expert_rows())

    @classmethod
    def open(cls, plan, model_dir: str, cfg: ModelConfig, source, **kw) -> "ShardedStore":
        rows = plan.expert_rows()
        E = max(source.num_experts(L) for L in source.expert_layers)
        stores = {}
        try:
            for d, devs in rows:
                stores[d] = ExpertStore.open(model_dir, cfg, source=source, owned=plan.owned(E, d), share=len(rows),
                                             devices=devs, owns_source=False, slot_limit=plan.experts_per_shard(E),
                                             **kw)
        except BaseException:           # the caller closes the source
            for st in stores.values():
                st.close(save_usage=False)
            raise
        return cls(plan, stores, source, E)

    # ------------------------------------------------------------------ the sim knobs (benchmarks)
    @property
    def sim_disk_gbps(self):
        return next(iter(self.stores.values())).sim_disk_gbps

    @sim_disk_gbps.setter
    def sim_disk_gbps(self, v):
        for st in self.stores.values():
            st.sim_disk_gbps = v

    @property
    def sim_expert_mb(self):
        return next(iter(self.stores.values())).sim_expert_mb

    @sim_expert_mb.setter
    def sim_expert_mb(self, v):
        for st in self.stores.values():
            st.sim_expert_mb = v

    # ------------------------------------------------------------------ the contract
    def _split(self, expert_ids) -> dict:
        ids = np.asarray(expert_ids).reshape(-1).astype(np.int64)
        return {d: ids[(ids // self.per) == d] for d in self.stores}

    def _layer(self, layer: int) -> _Layer:
        return next(iter(self.stores.values()))._layer(layer)

    def call_limit(self, layer: int) -> int:
        return min(st.call_limit(layer) for st in self.stores.values())

    def _global(self, layer: int, parts: dict):
        """(mesh bank, slot map) of ``layer`` from {d: (bank, slot_of)} of this process's shards."""
        per_dev, rows = {}, {}
        for d, (_, slot_of) in parts.items():
            lc = self.stores[d]._layer(layer)
            for dev, b in zip(lc.devices, lc.banks):
                per_dev[dev] = b
            rows[d] = slot_of
        return self.plan.bank_from_devices(per_dev, self._layer(layer).bank), self.plan.slot_map(rows, self.E)

    def fetch(self, layer: int, expert_ids, during=None, landed=None):
        if during is not None:      # the shards read one after another: nothing to overlap with (nor ``landed``)
            during()
        parts = {d: (self.stores[d].fetch(layer, p) if len(p) else self.stores[d].peek(layer))
                 for d, p in self._split(expert_ids).items()}
        return self._global(layer, parts)

    def peek(self, layer: int):
        return self._global(layer, {d: st.peek(layer) for d, st in self.stores.items()})

    def prefetch(self, layer: int, expert_ids) -> int:
        return sum(self.stores[d].prefetch(layer, p) for d, p in self._split(expert_ids).items() if len(p))

    def resident_mask(self, layer: int) -> np.ndarray:
        return np.logical_or.reduce([st.resident_mask(layer) for st in self.stores.values()])

    def pinned_mask(self, layer: int) -> np.ndarray:
        return np.logical_or.reduce([st.pinned_mask(layer) for st in self.stores.values()])

    def can_hold_all(self) -> bool:
        return all(st.can_hold_all() for st in self.stores.values())

    def preload_all(self):
        for st in self.stores.values():
            st.preload_all()

    def all_resident(self) -> bool:
        return all(st.all_resident() for st in self.stores.values())

    def resident_view(self) -> dict:
        views = {d: st.resident_view() for d, st in self.stores.items()}
        return {L: self._global(L, {d: v[L] for d, v in views.items()}) for L in next(iter(views.values()))}

    def drop_cache(self, page_cache: bool = True):
        for st in self.stores.values():
            st.drop_cache(page_cache)

    @property
    def aliased(self) -> bool:
        return all(st.aliased for st in self.stores.values())

    def stats(self) -> dict:
        per = [st.stats() for st in self.stores.values()]
        out = dict(per[0])
        for k, v in per[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in (
                    "cache_cap", "max_working_set", "io_threads", "read_chunk", "hit_rate", "read_gbps"):
                out[k] = sum(p[k] for p in per)
        out["loads_per_layer"] = {}
        for p in per:
            for L, n in p["loads_per_layer"].items():
                out["loads_per_layer"][L] = out["loads_per_layer"].get(L, 0) + n
        out["hit_rate"] = out["hits"] / out["requested"] if out["requested"] else 0.0
        out["read_gbps"] = out["bytes_read"] / out["io_wait_s"] / 1e9 if out["io_wait_s"] > 0 else 0.0
        out["aliased"] = self.aliased
        out["expert_shards"] = len(self.stores)
        return out

    def reset_stats(self):
        for st in self.stores.values():
            st.reset_stats()

    def close(self, save_usage: bool = True):
        for st in self.stores.values():
            st.close(save_usage)
        self.source.close()

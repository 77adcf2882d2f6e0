"""What this process may use: its resident set now, the machine's available memory and its memory cgroup's limit.

The RAM budget (``--ram_gb``, or by default the smaller of "what is in use now + 0.8 x MemAvailable" and 0.9 x the
cgroup's limit) is the budget of the whole process: the runtime, the dense weights, the KV cache, compile workspace,
transient buffers and the expert cache all count against it (the expert cache gets what is left; ExpertStore.open).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
from typing import Optional


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def private_bytes() -> int:
    """Memory only this process holds and the kernel cannot reclaim without swap: RssAnon + RssShmem (the heap, the
    weights, the KV cache, the expert arenas, compiled code).  Unlike VmRSS it leaves out file-backed pages (the
    shared libraries' text, ~100 MB for jaxlib), which a memory cgroup reclaims under pressure; VmRSS where the
    kernel does not report them."""
    got, n = 0, 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    n += int(line.split()[1]) * 1024
                    got += 1
    except OSError:
        pass
    return n if got == 2 else rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trim():
    """Return freed heap memory to the OS (glibc ``malloc_trim``): loading leaves megabytes of numpy temporaries in
    malloc's free lists, which count against a memory cgroup like live data.  A no-op elsewhere."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


M_MMAP_THRESHOLD = -3          # glibc <malloc.h>: mallopt's parameter
HEAP_MMAP_THRESHOLD = 1 << 20  # blocks from 1 MiB up get their own mapping, unmapped when freed


def compact_heap(threshold: int = HEAP_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` (``mallopt(M_MMAP_THRESHOLD)``): a block at least that large is
    mapped on its own and given back to the OS when freed.  glibc's default threshold follows the largest mapped
    block freed so far (up to 32 MiB), so after loading and compiling, XLA's multi-MB buffers are carved out of the
    heap and its arenas, where freeing them leaves holes ``malloc_trim`` cannot return.  In the GLM-4.5-Air slice's
    0.3x box that drift cost the expert cache 1-3 experts a layer, one generation after another; with the threshold
    fixed the cache held 9 (docs/real-scale.md).  For a run inside a RAM budget (Engine.load).  False where
    the C library has no mallopt (not glibc)."""
    try:
        return bool(_libc().mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return libc


MREMAP_MAYMOVE, MREMAP_FIXED, MREMAP_DONTUNMAP = 1, 2, 4     # Linux: <linux/mman.h>


def move_pages(src: int, dst: int, nbytes: int) -> bool:
    """Move the pages behind [src, src + nbytes) to [dst, dst + nbytes) without copying them: ``mremap`` with
    MREMAP_FIXED | MREMAP_DONTUNMAP (Linux >= 5.7) moves the page-table entries (~150 us for 9 MB), whatever was
    mapped at ``dst`` is unmapped first, and ``src`` stays mapped but empty (zero-filled on a later touch).  Both
    ranges page aligned, inside private anonymous mappings.  The memory stays counted once; nothing is zero-filled or
    faulted in, which a release (MADV_DONTNEED) followed by a write into fresh pages costs (~1 ms and 2,300 faults a
    9 MB record).  False where the kernel or platform refuses: the caller falls back to that."""
    if nbytes <= 0 or src % mmap.PAGESIZE or dst % mmap.PAGESIZE or nbytes % mmap.PAGESIZE:
        return False
    try:
        libc = _libc()
        r = libc.mremap(src, nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, dst)
    except (OSError, AttributeError):
        return False
    return r == dst


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25       # Linux: <asm-generic/mman-common.h>


def huge_pages(addr: int, nbytes: int, collapse: bool = False) -> int:
    """Back the whole 2 MB pages inside [addr, addr + nbytes) with transparent huge pages: ``madvise(MADV_HUGEPAGE)``
    (pages faulted in later come huge, where THP is "always" or "madvise"), and with ``collapse`` also
    ``MADV_COLLAPSE`` (Linux >= 6.1: the pages already there are merged now).  A decode step streams every weight
    once; with 4 KB pages the hardware prefetcher stops at each page and the TLB misses every 4 KB (on the AVX-512
    EPYC, one core's int4 tile loop read 27 GB/s from 4 KB pages and 33-37 from huge pages:
    tools/bench/tiles_vnni.cc).  Only the aligned interior is advised, so memory outside the range is never touched.
    Best effort: returns the bytes advised, 0 where the kernel or platform refuses (a failed collapse, e.g. under a
    tight memory cgroup, leaves the 4 KB pages as they were)."""
    lo = (addr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    hi = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    try:
        libc = _libc()
        if libc.madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            return 0
        if collapse:
            libc.madvise(lo, hi - lo, MADV_COLLAPSE)
    except (OSError, AttributeError):
        return 0
    return hi - lo


def evict_page_cache(paths) -> None:
    """Ask the kernel to drop these files' pages from the page cache (``posix_fadvise(DONTNEED)``; dirty pages and
    other processes' mappings stay).  Best effort: a file that can't be opened, or a platform without fadvise, is
    skipped."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (AttributeError, OSError):
            pass


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The memory limit of this process's cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``, the smallest
    along the path to the root), or None when there is none."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    cands = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if "memory" in ctrls.split(","):             # v1
            cands.append((os.path.join(root, "memory"), path, "memory.limit_in_bytes"))
        elif ctrls == "":                             # v2 unified
            cands.append((root, path, "memory.max"))
    best = None
    for base, path, name in cands:
        p = path.strip("/")
        while True:
            f = os.path.join(base, p, name) if p else os.path.join(base, name)
            try:
                with open(f) as fh:
                    v = fh.read().strip()
                if v != "max":
                    n = int(v)
                    if n < (1 << 60):                 # v1 "unlimited" is a huge number
                        best = n if best is None else min(best, n)
            except (OSError, ValueError):
                pass
            if not p:
                break
            p = os.path.dirname(p)
    return best


def budget_problem(ram_gb: float, label: str = "--ram_gb") -> Optional[str]:
    """Why an explicit ``--ram_gb`` can't be kept here (above the memory cgroup's limit: the kernel would OOM-kill
    the process long before the budget is reached), or None."""
    lim = cgroup_limit()
    if not ram_gb or lim is None or ram_gb * 1e9 <= lim:
        return None
    ok = math.floor(0.9 * lim / 1e7) / 100
    return (f"{label}={ram_gb:g}: above this process's memory cgroup limit ({lim / 1e9:.2f} GB), so the budget "
            f"could not be kept (the kernel would kill the process first); use {label} <= {ok:.2f}, or leave it "
            f"unset (default: at most 0.9 x the limit)")


def round_up_gb(x: float) -> float:
    """A GB figure for a "would fit" suggestion: rounded UP to 0.01 with a 5 MB margin, so the value printed is
    itself accepted (rounding 0.3749 to 0.37 suggested a value that is then refused)."""
    return math.ceil((x + 0.005) * 100 - 1e-9) / 100


def default_budget() -> tuple[int, str]:
    """(bytes, how it was decided) for the whole process when --ram_gb is not given."""
    now = private_bytes()
    b, why = now + int(0.8 * mem_available()), "in use + 0.8 x MemAvailable"
    lim = cgroup_limit()
    if lim is not None and int(0.9 * lim) < b:
        b, why = int(0.9 * lim), f"0.9 x the memory cgroup's limit ({lim / 1e9:.2f} GB)"
    return b, why


def cache_slots(avail: int, rec_sum: int, max_rec: int, working_set: int, released: bool = True) -> int:
    """Experts per layer an expert cache can keep in ``avail`` bytes, the cache and one fetch's working set
    together (< 1: not even one).  Each layer keeps ``cap`` records; the layer being fetched holds up to
    ``working_set`` at once -- its kept slots plus working_set - cap transient ones, returned to the OS at the next
    fetch of any layer (``released``: experts/store.working_set_released) -- so a cap below the working set costs
    cap x rec_sum + (working_set - cap) x max_rec, and one at or above it cap x rec_sum.  Where the transient slots
    are not released, the working set stays resident beside the cap.  ``rec_sum``: one record of every layer;
    ``max_rec``: the largest record."""
    if not released:
        return int((avail - working_set * max_rec) // rec_sum)
    working_set = max(1, working_set)
    c = int(avail // rec_sum)
    if c >= working_set:
        return c
    if rec_sum <= max_rec:              # one layer: its working set is all of it
        return -1
    return min(working_set - 1, int((avail - working_set * max_rec) // (rec_sum - max_rec)))

"""Streaming benchmark of the ExpertStore (python -m tools.bench.stream).

    python -m tools.bench.stream --model=CONTAINER_DIR [--cap=16] [--tokens=48] [--io_threads=4]
                                         [--read_chunk_mb=1] [--direct_io] [--policy=lru] [--compute]
    python -m tools.bench.stream --model=CONTAINER_DIR --engine [--fetch=loop,callback] [--prefetch=0,1]

1. Cold cache: ``posix_fadvise(DONTNEED)`` on every expert file before every token (outside the timing), so an
   evicted expert read again comes from the disk, not the page cache (or O_DIRECT reads with --direct_io).
2. Disk limit (``DiskLimit``): reads of the records the run missed, with the SAME read path (the store's byte
   ranges into page-aligned buffers), request size and thread count, every range queued at once, page cache dropped
   first; sampled in bursts of ``--limit_burst`` records every ``--limit_every`` fetch calls during the run (outside
   the timing) and ``--limit_reads`` records after it, so the disk's drift hits the run and its limit alike.
3. Decode: a routing trace (``--trace`` jsonl from the engine, else synthetic: Zipf popularity from the model's
   ``e_score_correction_bias`` + temporal locality) replayed through ``store.fetch`` per layer per token, with
   the experts' compute (in-jit dequant + matvec of the routed experts via ``bank_take``) when ``--compute``.
   This drives the store directly, not the engine (``decode tok/s`` is the store + expert-compute rate).
4. Prints a markdown table: tok/s, bytes read/token, achieved GB/s (bytes_read / io_wait), the disk limit and
   their ratio (goal >= 0.9).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import numpy as np

from glm_jax.experts.container import _aligned_empty, balanced_chunk, open_container, record_reads
from glm_jax.model.config import load_config


def drop_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class DiskLimit:
    """The disk limit, sampled in bursts interleaved with the run (this virtual disk drifts by +-30% within
    minutes, so a limit measured only before and after a run scatters the ratio more than the store does).

    A burst: ``n`` distinct records read with the store's read path (the same ``record_reads`` byte ranges,
    ``balanced_chunk`` of ``chunk`` bytes, the same thread count), every range queued at once so no thread idles:
    the best the disk does with these requests.  The records are drawn from the run's own misses so far (``note``;
    uniform over the container before any): the virtual disk's host caches recently read blocks, and a limit read
    from uniformly random records ran 25-40% below the store's O_DIRECT reads of its popular experts.  The page
    cache is dropped before and after each burst, so the burst reads the disk and leaves the run nothing to hit.
    ``gbps`` = all bursts' bytes / all bursts' seconds."""

    def __init__(self, container, io_threads: int, chunk: int = 0, seed: int = 1):
        """``container`` opened as the store's (its O_DIRECT fds are used when it has them)."""
        self.c, self.threads, self.chunk = container, io_threads, chunk
        self.rng = np.random.default_rng(seed)
        self.pool = cf.ThreadPoolExecutor(io_threads)
        self.bufs: dict = {}
        self.bytes, self.s, self.bursts = 0, 0.0, 0
        self.seen: list = []            # (layer, expert) of the run's misses, with multiplicity

    def note(self, layer: int, experts):
        self.seen.extend((int(layer), int(e)) for e in experts)

    def _reads(self, i, L, e):
        lay = self.c.layout(L)
        key = (lay.fmt, lay.record_len, i % (2 * self.threads))
        if key not in self.bufs:    # a few reused, pre-touched buffer sets, like the store's slots (no page faults)
            self.bufs[key] = {s.name: _aligned_empty(s.nbytes) for s in lay.sections}
            for b in self.bufs[key].values():
                b.fill(0)
        ent = self.c.entry(L)
        return record_reads(ent.fd, ent.direct_fd, lay, int(ent.offsets[e]), self.bufs[key],
                            balanced_chunk(lay.record_len, self.threads, self.chunk))

    def burst(self, n: int) -> float:
        """Read ``n`` records drawn from the run's misses (uniform before any); returns the seconds spent (reading
        and dropping the page cache)."""
        t0 = time.perf_counter()
        if self.seen:
            jobs = [self.seen[i] for i in self.rng.integers(len(self.seen), size=n)]
        else:
            layers = list(self.c.expert_layers)
            jobs = [(layers[self.rng.integers(len(layers))], int(self.rng.integers(self.c.num_experts(layers[0]))))
                    for _ in range(n)]
        jobs = list(dict.fromkeys(jobs))          # each record once (no page-cache re-hits)
        work = [r for i, (L, e) in enumerate(jobs) for r in self._reads(i, L, e)]
        drop_cache(self.c.files())
        t = time.perf_counter()
        nb = sum(f.result() for f in [self.pool.submit(r) for r in work])
        self.s += time.perf_counter() - t
        self.bytes += nb
        self.bursts += 1
        drop_cache(self.c.files())
        return time.perf_counter() - t0

    @property
    def gbps(self) -> float:
        return self.bytes / self.s / 1e9 if self.s else float("nan")

    def close(self):
        self.pool.shutdown()


def interleave_limit(store, lim: DiskLimit, every: int, n: int, skip: int = 0) -> dict:
    """Wrap ``store.fetch`` so that every ``every``-th call (after the first ``skip``) first runs a disk-limit burst
    of ``n`` records, and every call tells ``lim`` its misses; returns {"s": seconds spent in bursts} (the caller
    takes them out of its wall time)."""
    out = {"s": 0.0, "calls": 0}
    fetch = store.fetch

    def wrapped(layer, ids):
        out["calls"] += 1
        res = store.resident_mask(layer)
        lim.note(layer, [e for e in dict.fromkeys(np.asarray(ids).reshape(-1).tolist()) if not res[e]])
        if every > 0 and out["calls"] > skip and out["calls"] % every == 0:
            out["s"] += lim.burst(n)
        return fetch(layer, ids)
    store.fetch = wrapped
    return out


def synthetic_trace_from_model(model_dir, cfg, n_tokens, repeat=0.3, seed=0):
    from glm_jax.experts.container import SafeTensorsDir, expert_layers
    st = SafeTensorsDir(model_dir)
    rng = np.random.default_rng(seed)
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    layers = [L for L in expert_layers(cfg)]
    pops = {}
    for L in layers:
        key = f"model.layers.{L}.mlp.gate.e_score_correction_bias"
        b = st.read(key).astype(np.float64) if key in st else np.zeros(E)
        p = np.exp((b - b.max()) / max(b.std(), 1e-6) * 1.0)
        pops[L] = p / p.sum()
    prev = {L: [] for L in layers}
    trace = []
    for _ in range(n_tokens):
        fwd = []
        for L in layers:
            chosen = [e for e in prev[L] if rng.random() < repeat]
            p = pops[L].copy()
            p[chosen] = 0
            rest = rng.choice(E, size=k - len(chosen), replace=False, p=p / p.sum())
            ids = chosen + [int(e) for e in rest]
            prev[L] = ids
            fwd.append((L, ids))
        trace.append(fwd)
    st.close()
    return trace


def bench(model_dir, cap=16, tokens=48, io_threads=4, direct_io=False, policy="lru", compute=False,
          trace_path=None, limit_reads=64, warmup_tokens=0, seed=0, verify="none", cold_every_token=True,
          read_chunk_mb=1.0, limit_every=8, limit_burst=16) -> dict:
    import jax
    import jax.numpy as jnp

    from glm_jax.experts.store import ExpertStore
    from glm_jax.model import moe
    cfg = load_config(model_dir)
    c = open_container(model_dir, cfg, verify="none", direct_io=direct_io)
    lim = DiskLimit(c, io_threads, int(read_chunk_mb * (1 << 20)), seed=seed + 1)
    rec = c.layout(c.expert_layers[0]).record_len
    if trace_path:
        from tools.bench.cache_sim import load_trace
        trace = load_trace(trace_path)[:tokens]
    else:
        trace = synthetic_trace_from_model(model_dir, cfg, tokens, seed=seed)
    drop_cache(open_container(model_dir, cfg, verify="none").files())
    st = ExpertStore.open(model_dir, cfg, cache_cap=cap, io_threads=io_threads, direct_io=direct_io,
                          policy=policy, verify=verify, max_working_set=cfg.num_experts_per_tok,
                          read_chunk_mb=read_chunk_mb)
    bursts = interleave_limit(st, lim, limit_every, limit_burst)
    H = cfg.hidden_size

    @jax.jit
    def experts(bank, slots, x):
        gu, dn = moe.bank_take(bank, slots, jnp.float32)
        I = dn.shape[-1]
        h = jnp.einsum("kih,h->ki", gu, x)
        a = jax.nn.silu(h[:, :I]) * h[:, I:]
        return jnp.einsum("khi,ki->h", dn, a)

    x = jnp.ones((H,), jnp.float32) * 0.01
    compute_s = 0.0
    t0 = time.perf_counter()
    files = c.files()
    for i, fwd in enumerate(trace):
        if cold_every_token and not direct_io:
            tc = time.perf_counter()
            drop_cache(files)        # an evicted expert re-read later must come from disk, not the page cache
            t0 += time.perf_counter() - tc
        if i == warmup_tokens and warmup_tokens:
            st.reset_stats()
            t0 = time.perf_counter()
            compute_s = 0.0
            bursts["s"] = 0.0
        for L, ids in fwd:
            bank, so = st.fetch(L, np.asarray(ids, np.int32))
            if compute:
                tc = time.perf_counter()
                y = experts(bank, jnp.asarray(so[ids]), x)
                y.block_until_ready()            # the engine reads the next routing back: same sync point
                compute_s += time.perf_counter() - tc
    wall = time.perf_counter() - t0 - bursts["s"]
    s = st.stats()
    st.close(save_usage=False)
    lim.burst(limit_reads)
    lim.close()
    c.close()
    n = len(trace) - warmup_tokens
    return dict(tokens=n, wall_s=wall, tok_s=n / wall, bytes_per_token=s["bytes_read"] / n,
                achieved_gbps=s["read_gbps"], limit_gbps=lim.gbps, ratio=s["read_gbps"] / lim.gbps,
                e2e_ratio=s["bytes_read"] / wall / 1e9 / lim.gbps, limit_bursts=lim.bursts,
                loads_per_layer=s["loads_per_layer"],
                hit_rate=s["hit_rate"], io_wait_s=s["io_wait_s"], compute_s=compute_s, record_mb=rec / 1e6,
                cap=cap, io_threads=io_threads, direct_io=direct_io, misses=s["misses"], aliased=s["aliased"],
                chunk_mb=read_chunk_mb, prefetch=False)


def bench_engine(model_dir, cap=16, tokens=32, io_threads=4, direct_io=True, fetch="loop", limit_reads=64,
                 seed=0, read_chunk_mb=1.0, prefetch=False, limit_every=8, limit_burst=16) -> dict:
    """The same measurement through the real engine (glm_jax.Engine, fetch=loop|callback, MTP off): the store is
    made cold (cache forgotten, page cache dropped) before the timed generation; with ``direct_io`` every miss is a
    disk read.  Compile time is excluded (a warm-up generation first).  Disk-limit bursts run between fetch calls
    of the decode (not the prefill's) and their time is taken out of the decode time."""
    import glm_jax

    cfg = load_config(model_dir)
    c = open_container(model_dir, cfg, verify="none", direct_io=direct_io)
    lim = DiskLimit(c, io_threads, int(read_chunk_mb * (1 << 20)), seed=seed + 1)
    rec = c.layout(c.expert_layers[0]).record_len
    eng = glm_jax.Engine.load(model_dir, fetch=fetch, cache_cap=cap, io_threads=io_threads, direct_io=direct_io,
                              mtp=False, draft=0, read_chunk_mb=read_chunk_mb, prefetch=prefetch)
    prompt = [1 + (7 * i) % (cfg.vocab_size - 1) for i in range(8)]
    eng.generate(prompt, max_new_tokens=tokens, stop_on_eos=False)      # compile (same cache size as the timed run)
    eng.store.drop_cache()
    bursts = interleave_limit(eng.store, lim, limit_every, limit_burst, skip=len(c.expert_layers))  # not prefill
    r = eng.generate(prompt, max_new_tokens=tokens, stop_on_eos=False)
    s = r.stats
    lim.burst(limit_reads)
    lim.close()
    c.close()
    eng.close()
    limit = lim.gbps
    n = s["decode_tokens"]
    decode_s = s["decode_s"] - bursts["s"]
    if s.get("compile_s", 0.0) > 0.05:
        print(f"warning: {s['compile_s']:.2f} s of compilation inside the timed run", flush=True)
    return dict(tokens=n, wall_s=decode_s, tok_s=n / decode_s, bytes_per_token=s["bytes_read_per_token"],
                achieved_gbps=s["read_gbps"], limit_gbps=limit, ratio=s["read_gbps"] / limit, hit_rate=s["hit_rate"],
                e2e_ratio=s["decode_bytes_read"] / decode_s / 1e9 / limit, chunk_mb=read_chunk_mb,
                limit_bursts=lim.bursts,
                prefetch=prefetch, prefetch_recall=s.get("prefetch_recall", float("nan")),
                io_wait_s=s["io_wait_s"], compute_s=max(decode_s - s["io_wait_s"], 0.0), record_mb=rec / 1e6,
                cap=cap, io_threads=io_threads, direct_io=direct_io, misses=s["misses"], aliased=s["aliased"],
                fetch=fetch)


COLS = ["fetch", "prefetch", "cap/layer", "io_threads", "direct", "chunk MB", "record MB", "tok/s", "hit rate",
        "MB read/token", "achieved GB/s", "disk limit GB/s", "ratio", "e2e ratio", "io_wait s", "compute s"]


def table(rows) -> str:
    from tools.bench.tables import markdown
    return markdown([{"fetch": r.get("fetch", "store"), "prefetch": int(r.get("prefetch", False)),
                      "cap/layer": r["cap"], "io_threads": r["io_threads"], "direct": int(r["direct_io"]),
                      "chunk MB": r.get("chunk_mb"), "record MB": r["record_mb"], "tok/s": r["tok_s"],
                      "hit rate": r["hit_rate"], "MB read/token": r["bytes_per_token"] / 1e6,
                      "achieved GB/s": r["achieved_gbps"], "disk limit GB/s": r["limit_gbps"], "ratio": r["ratio"],
                      "e2e ratio": r["e2e_ratio"], "io_wait s": r["io_wait_s"], "compute s": r["compute_s"]}
                     for r in rows], COLS)


NOTE = ("ratio = achieved read rate (bytes read / time blocked on reads) / disk limit; e2e ratio = bytes read / "
        "decode wall time / disk limit (compute included: 1.0 means decode runs at the disk's speed). The disk limit "
        "is measured by this tool on the same files with the same request size (chunk) and thread count, every "
        "read queued at once, of the records the run missed, in bursts during the run and after it (outside the "
        "timing).")


def _median_row(runs: list) -> dict:
    import statistics
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in runs)
    out["reps"] = len(runs)
    return out


def main(argv):
    from absl import flags
    F = flags.FLAGS
    threads = [int(t) for t in F.io_threads.split(",")]
    chunks = [float(c) for c in F.read_chunk_mb.split(",")]
    plan = []
    for th in threads:
        for ch in chunks:
            for cap in [int(c) for c in F.cap.split(",")]:
                if F.engine:
                    for fetch in F.fetch.split(","):
                        for pf in sorted({int(p) for p in F.prefetch.split(",")}):
                            if not (pf and fetch != "loop"):
                                plan.append((th, ch, cap, fetch, bool(pf)))
                else:
                    plan.append((th, ch, cap, "store", False))
    runs = {p: [] for p in plan}
    for rep in range(F.reps):            # interleaved: config A B C, A B C, ... (the disk's drift hits all alike)
        for p in plan:
            th, ch, cap, fetch, pf = p
            if F.engine:
                r = bench_engine(F.model, cap, F.tokens, th, F.direct_io, fetch, F.limit_reads, seed=rep,
                                 read_chunk_mb=ch, prefetch=pf, limit_every=F.limit_every, limit_burst=F.limit_burst)
            else:
                r = bench(F.model, cap, F.tokens, th, F.direct_io, F.policy, F.compute, F.trace, F.limit_reads,
                          F.warmup_tokens, seed=rep, read_chunk_mb=ch, limit_every=F.limit_every,
                          limit_burst=F.limit_burst)
            runs[p].append(r)
            print(f"rep {rep}: " + table([r]).splitlines()[-1], flush=True)
    print(table([_median_row(v) for v in runs.values()]))
    print(f"\nmedian of {F.reps} interleaved reps per row. " + NOTE)
    if F.engine:
        print("engine decode through the store (MTP off), cold start; compute s = decode s - io_wait s")


def run():
    from absl import app, flags
    flags.DEFINE_string("model", None, "container directory", required=True)
    flags.DEFINE_string("cap", "16", "cache caps (comma list)")
    flags.DEFINE_integer("tokens", 48, "decode tokens")
    flags.DEFINE_integer("reps", 3, "interleaved repetitions per configuration (the median is printed)")
    flags.DEFINE_integer("warmup_tokens", 0, "tokens not counted (0: cold from the first token)")
    flags.DEFINE_string("io_threads", "4", "I/O threads (comma list)")
    flags.DEFINE_bool("direct_io", False, "O_DIRECT reads")
    flags.DEFINE_string("policy", "lru", "cache policy")
    flags.DEFINE_bool("compute", True, "run the routed experts' compute per layer")
    flags.DEFINE_string("trace", None, "routing trace jsonl (default: synthetic from the router bias)")
    flags.DEFINE_bool("engine", False, "drive the real engine (Engine.generate) instead of replaying a trace")
    flags.DEFINE_string("fetch", "loop,callback", "with --engine: fetch modes to run (both printed)")
    flags.DEFINE_string("read_chunk_mb", "1", "read chunk sizes in MB (comma list; 0 = one read per record)")
    flags.DEFINE_string("prefetch", "0", "with --engine: router-lookahead prefetch off/on (comma list of 0/1)")
    flags.DEFINE_integer("limit_reads", 96, "record reads for the disk limit after the run")
    flags.DEFINE_integer("limit_every", 8, "a disk-limit burst every this many fetch calls during the run (0: none)")
    flags.DEFINE_integer("limit_burst", 16, "records per disk-limit burst")
    app.run(main)


if __name__ == "__main__":
    run()

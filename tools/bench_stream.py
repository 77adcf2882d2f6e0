"""Streaming benchmark of the ExpertStore (the streaming part of tools/bench.py).

    python -m glm_jax_tools.bench_stream --model=CONTAINER_DIR [--cap=16] [--tokens=48] [--io_threads=4]
                                         [--direct_io] [--policy=lru] [--compute]

1. Cold cache: ``posix_fadvise(DONTNEED)`` on every expert file before every token (outside the timing), so an
   evicted expert read again comes from the disk, not the page cache (or O_DIRECT reads with --direct_io).
2. Disk limit (measured before and after the run, averaged): random whole-record reads of the SAME files, with the SAME read path (one preadv per record into
   page-aligned buffers), request size (= record length) and thread count, page cache dropped first.
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

from glm_jax.config import load_config
from glm_jax.container import open_container, read_record_into, _aligned_empty


def drop_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_limit(container, n_reads: int, io_threads: int, direct_io: bool, seed: int = 1) -> dict:
    """Random record reads of the container's files with the store's read path; page cache dropped first."""
    drop_cache(container.files())
    rng = np.random.default_rng(seed)
    layers = list(container.expert_layers)
    jobs = [(layers[rng.integers(len(layers))], int(rng.integers(container.num_experts(layers[0]))))
            for _ in range(n_reads)]
    jobs = list(dict.fromkeys(jobs))        # each record once (no page-cache re-hits)
    import threading
    tls = threading.local()

    def one(job):
        L, e = job
        lay = container.layout(L)
        if not hasattr(tls, "bufs"):
            tls.bufs = {}
        key = (lay.fmt, lay.record_len)
        if key not in tls.bufs:     # reused, pre-touched buffers, like the store's slots (no page faults timed)
            tls.bufs[key] = {s.name: _aligned_empty(s.nbytes) for s in lay.sections}
            for b in tls.bufs[key].values():
                b.fill(0)
        ent = container.entry(L)
        return read_record_into(ent.fd, ent.direct_fd, lay, int(ent.offsets[e]), tls.bufs[key])

    t = time.perf_counter()
    with cf.ThreadPoolExecutor(io_threads) as ex:
        n = sum(ex.map(one, jobs))
    dt = time.perf_counter() - t
    drop_cache(container.files())
    return {"bytes": n, "s": dt, "gbps": n / dt / 1e9, "reads": len(jobs)}


def synthetic_trace_from_model(model_dir, cfg, n_tokens, repeat=0.3, seed=0):
    from glm_jax.container import SafeTensorsDir, expert_layers
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
          trace_path=None, limit_reads=64, warmup_tokens=0, seed=0, verify="none", cold_every_token=True) -> dict:
    import jax
    import jax.numpy as jnp
    from glm_jax import quant
    from glm_jax.store import ExpertStore
    cfg = load_config(model_dir)
    c = open_container(model_dir, cfg, verify="none", direct_io=direct_io)
    lim = disk_limit(c, limit_reads, io_threads, direct_io, seed=seed + 1)
    rec = c.layout(c.expert_layers[0]).record_len
    if trace_path:
        from glm_jax_tools.cache_sim import load_trace
        trace = load_trace(trace_path)[:tokens]
    else:
        trace = synthetic_trace_from_model(model_dir, cfg, tokens, seed=seed)
    drop_cache(open_container(model_dir, cfg, verify="none").files())
    st = ExpertStore.open(model_dir, cfg, cache_cap=cap, io_threads=io_threads, direct_io=direct_io,
                          policy=policy, verify=verify, max_working_set=cfg.num_experts_per_tok)
    H = cfg.hidden_size

    @jax.jit
    def experts(bank, slots, x):
        gu, dn = quant.bank_take(bank, slots, jnp.float32)
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
        for L, ids in fwd:
            bank, so = st.fetch(L, np.asarray(ids, np.int32))
            if compute:
                tc = time.perf_counter()
                y = experts(bank, jnp.asarray(so[ids]), x)
                y.block_until_ready()            # the engine reads the next routing back: same sync point
                compute_s += time.perf_counter() - tc
    wall = time.perf_counter() - t0
    s = st.stats()
    st.close(save_usage=False)
    lim2 = disk_limit(c, limit_reads, io_threads, direct_io, seed=seed + 2)   # before and after: noisy disk
    c.close()
    lim = {"gbps": (lim["gbps"] + lim2["gbps"]) / 2}
    n = len(trace) - warmup_tokens
    return dict(tokens=n, wall_s=wall, tok_s=n / wall, bytes_per_token=s["bytes_read"] / n,
                achieved_gbps=s["read_gbps"], limit_gbps=lim["gbps"], ratio=s["read_gbps"] / lim["gbps"],
                hit_rate=s["hit_rate"], io_wait_s=s["io_wait_s"], compute_s=compute_s, record_mb=rec / 1e6,
                cap=cap, io_threads=io_threads, direct_io=direct_io, misses=s["misses"], aliased=s["aliased"])


def bench_engine(model_dir, cap=16, tokens=32, io_threads=4, direct_io=True, fetch="loop", limit_reads=64,
                 seed=0) -> dict:
    """The same measurement through the real engine (glm_jax.Engine, fetch=loop|callback, MTP off): the store is
    made cold (cache forgotten, page cache dropped) before the timed generation; with ``direct_io`` every miss is a
    disk read.  Compile time is excluded (a warm-up generation first)."""
    import glm_jax

    cfg = load_config(model_dir)
    c = open_container(model_dir, cfg, verify="none", direct_io=direct_io)
    lim = disk_limit(c, limit_reads, io_threads, direct_io, seed=seed + 1)
    rec = c.layout(c.expert_layers[0]).record_len
    eng = glm_jax.Engine.load(model_dir, fetch=fetch, cache_cap=cap, io_threads=io_threads, direct_io=direct_io,
                              mtp=False, draft=0)
    prompt = [1 + (7 * i) % (cfg.vocab_size - 1) for i in range(8)]
    eng.generate(prompt, max_new_tokens=3, stop_on_eos=False)           # compile
    eng.store.drop_cache()
    r = eng.generate(prompt, max_new_tokens=tokens, stop_on_eos=False)
    s = r.stats
    lim2 = disk_limit(c, limit_reads, io_threads, direct_io, seed=seed + 2)
    c.close()
    eng.close()
    limit = (lim["gbps"] + lim2["gbps"]) / 2
    n = s["decode_tokens"]
    return dict(tokens=n, wall_s=s["decode_s"], tok_s=s["decode_tok_s"], bytes_per_token=s["bytes_read_per_token"],
                achieved_gbps=s["read_gbps"], limit_gbps=limit, ratio=s["read_gbps"] / limit, hit_rate=s["hit_rate"],
                io_wait_s=s["io_wait_s"], compute_s=max(s["decode_s"] - s["io_wait_s"], 0.0), record_mb=rec / 1e6,
                cap=cap, io_threads=io_threads, direct_io=direct_io, misses=s["misses"], aliased=s["aliased"],
                fetch=fetch)


def table(rows) -> str:
    out = ["| cap/layer | io_threads | direct | record MB | tok/s | hit rate | MB read/token | achieved GB/s | "
           "disk limit GB/s (same files, size, threads) | ratio | io_wait s | compute s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['cap']} | {r['io_threads']} | {int(r['direct_io'])} | {r['record_mb']:.2f} | {r['tok_s']:.2f} | "
                   f"{r['hit_rate']:.3f} | {r['bytes_per_token'] / 1e6:.1f} | {r['achieved_gbps']:.2f} | "
                   f"{r['limit_gbps']:.2f} | {r['ratio']:.2f} | {r['io_wait_s']:.2f} | {r['compute_s']:.2f} |")
    return "\n".join(out)


def main(argv):
    from absl import flags
    F = flags.FLAGS
    rows = []
    if F.engine:
        for fetch in F.fetch.split(","):
            for cap in [int(c) for c in F.cap.split(",")]:
                rows.append(bench_engine(F.model, cap, F.tokens, int(F.io_threads.split(",")[0]), F.direct_io,
                                         fetch, F.limit_reads))
        out = table(rows).splitlines()
        out[0] = "| fetch " + out[0]
        out[1] = "|---" + out[1]
        for i, r in enumerate(rows):
            out[2 + i] = f"| {r['fetch']} " + out[2 + i]
        print("\n".join(out))
        print("\nengine decode through the store (MTP off), cold start; compute s = decode s - io_wait s")
        return
    for threads in [int(t) for t in F.io_threads.split(",")]:
        for cap in [int(c) for c in F.cap.split(",")]:
            rows.append(bench(F.model, cap, F.tokens, threads, F.direct_io, F.policy, F.compute, F.trace,
                              F.limit_reads, F.warmup_tokens))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))


def run():
    from absl import app, flags
    flags.DEFINE_string("model", None, "container directory", required=True)
    flags.DEFINE_string("cap", "16", "cache caps (comma list)")
    flags.DEFINE_integer("tokens", 48, "decode tokens")
    flags.DEFINE_integer("warmup_tokens", 0, "tokens not counted (0: cold from the first token)")
    flags.DEFINE_string("io_threads", "4", "I/O threads (comma list)")
    flags.DEFINE_bool("direct_io", False, "O_DIRECT reads")
    flags.DEFINE_string("policy", "lru", "cache policy")
    flags.DEFINE_bool("compute", True, "run the routed experts' compute per layer")
    flags.DEFINE_string("trace", None, "routing trace jsonl (default: synthetic from the router bias)")
    flags.DEFINE_bool("engine", False, "drive the real engine (Engine.generate) instead of replaying a trace")
    flags.DEFINE_string("fetch", "loop,callback", "with --engine: fetch modes to run (both printed)")
    flags.DEFINE_integer("limit_reads", 96, "random record reads for the disk limit (measured before and after)")
    app.run(main)


if __name__ == "__main__":
    run()

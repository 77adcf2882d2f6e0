"""Replay routing traces through the ExpertStore cache logic and compare eviction policies.

    python -m tools.bench.cache_sim [--trace=FILE.jsonl] [--caps=1,2,4,8,16,32] [--policies=lru,lfu,belady]

A trace is one forward per line: ``[[layer, [expert ids...]], ...]`` (the engine can dump one).  Without
``--trace`` a synthetic trace is generated: per layer a Zipf(``--zipf``) popularity over a random permutation of
the experts, and temporal locality (each of the top-k picks repeats one of the previous token's experts of that
layer with probability ``--repeat``).  The simulation uses ``glm_jax.store.CacheIndex``, the exact bookkeeping
of the store (same evictions, same working-set room), so hit rates here are the store's hit rates.  ``belady`` is
the offline optimum on the same trace (how far the shipped policies are from the limit).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from glm_jax.experts.store import CacheIndex


def synthetic_trace(n_tokens=2000, layers=8, E=64, k=8, zipf=1.0, repeat=0.3, seed=0) -> list:
    rng = np.random.default_rng(seed)
    pops = []
    for _ in range(layers):
        p = 1.0 / np.arange(1, E + 1) ** zipf
        pops.append(rng.permutation(p / p.sum()))
    prev = [None] * layers
    trace = []
    for _ in range(n_tokens):
        fwd = []
        for L in range(layers):
            chosen = []
            if prev[L] is not None:
                for e in prev[L]:
                    if rng.random() < repeat:
                        chosen.append(e)
            p = pops[L].copy()
            p[chosen] = 0
            rest = rng.choice(E, size=k - len(chosen), replace=False, p=p / p.sum())
            ids = [int(e) for e in chosen] + [int(e) for e in rest]
            prev[L] = ids
            fwd.append((L, ids))
        trace.append(fwd)
    return trace


def load_trace(path: str) -> list:
    with open(path) as f:
        return [[(int(L), [int(e) for e in ids]) for L, ids in json.loads(line)] for line in f if line.strip()]


def belady(trace: list, cap: int, warmup: int = 0) -> dict:
    """Offline optimum (Belady's MIN) per layer on the same trace: a forward's experts must all be present (misses
    are loaded), then the cache keeps the ``cap`` experts of cache + forward whose next use is soonest (never-used
    ones go first).  No policy that sees only the past can hit more often with ``cap`` experts kept per layer."""
    by_layer = {}
    for t, fwd in enumerate(trace):
        for L, ids in fwd:
            by_layer.setdefault(L, []).append((t, list(dict.fromkeys(ids))))
    hits = req = 0
    inf = float("inf")
    for L, seq in by_layer.items():
        nxt = [None] * len(seq)             # nxt[i][e]: index in seq of e's next use after i
        last = {}
        for i in range(len(seq) - 1, -1, -1):
            nxt[i] = {e: last.get(e, inf) for e in seq[i][1]}
            for e in seq[i][1]:
                last[e] = i
        cache = {}                           # expert -> index of its next use
        for i, (t, u) in enumerate(seq):
            h = sum(1 for e in u if e in cache)
            if t >= warmup:
                hits += h
                req += len(u)
            for e in u:
                cache[e] = nxt[i][e]
            if len(cache) > cap:
                keep = sorted(cache.items(), key=lambda kv: kv[1])[:cap]
                cache = dict(keep)
    return {"hit_rate": hits / max(req, 1), "requests": req}


def simulate(trace: list, policy: str, cap: int, E: int, working_set: int = 8, warmup: int = 0) -> dict:
    if policy == "belady":
        return belady(trace, min(cap, E), warmup)
    idx = {}
    hits = req = 0
    for t, fwd in enumerate(trace):
        for L, ids in fwd:
            if L not in idx:
                idx[L] = CacheIndex(E, min(cap, E), max(cap, working_set), policy)
            u = list(dict.fromkeys(ids))
            hp, hc, miss, _, _ = idx[L].access(u)
            if t >= warmup:
                hits += len(hp) + len(hc)
                req += len(u)
    return {"hit_rate": hits / max(req, 1), "requests": req}


def in_rounds(trace: list, room: int) -> list:
    """The trace as the store sees it: a layer's union larger than the ``room`` one fetch can hold (a prefill chunk
    or segment within a RAM budget) is fetched in rounds of ``room`` experts, in the order given (the engine's
    _chunked_moe and segment rounds), each round one access."""
    out = []
    for fwd in trace:
        row = []
        for L, ids in fwd:
            u = list(dict.fromkeys(ids))
            row += [(L, u[i:i + room]) for i in range(0, len(u), room)] if len(u) > room else [(L, u)]
        out.append(row)
    return out


def compare(trace, caps, policies, E, working_set, warmup) -> list:
    rows = []
    for cap in caps:
        t = in_rounds(trace, max(min(cap, E), working_set))
        rows.append((cap, [simulate(t, p, cap, E, working_set, warmup)["hit_rate"] for p in policies]))
    return rows


def markdown(rows, policies, title="") -> str:
    out = [title] if title else []
    out.append("| cap/layer | " + " | ".join(policies) + " | best |")
    out.append("|---|" + "---|" * (len(policies) + 1))
    for cap, hs in rows:
        best = policies[int(np.argmax(hs))] if max(hs) - min(hs) > 1e-3 else "tie"
        out.append(f"| {cap} | " + " | ".join(f"{h:.3f}" for h in hs) + f" | {best} |")
    return "\n".join(out)


def main(argv):
    from absl import flags
    F = flags.FLAGS
    caps = [int(c) for c in F.caps.split(",")]
    policies = F.policies.split(",")
    if F.trace:
        trace = load_trace(F.trace)
        E = F.experts or 1 + max(max(ids) for fwd in trace for _, ids in fwd)
        print(markdown(compare(trace, caps, policies, E, F.working_set, F.warmup), policies, f"trace {F.trace}"))
        return
    for zipf, repeat in ((0.8, 0.2), (1.1, 0.3), (1.1, 0.0), (1.4, 0.5)):
        trace = synthetic_trace(F.tokens, F.layers, F.experts or 64, F.top_k, zipf, repeat, F.seed)
        print(markdown(compare(trace, caps, policies, F.experts or 64, F.working_set, F.warmup), policies,
                       f"\nsynthetic: zipf={zipf} repeat={repeat} E={F.experts or 64} k={F.top_k} "
                       f"tokens={F.tokens} layers={F.layers}"))
        sys.stdout.flush()


def run():
    from absl import app, flags
    flags.DEFINE_string("trace", None, "jsonl routing trace (one forward per line)")
    flags.DEFINE_string("caps", "1,2,4,8,16,32", "cache caps (experts per layer)")
    flags.DEFINE_string("policies", "lru,lfu,belady", "policies to compare (belady: the offline optimum)")
    flags.DEFINE_integer("experts", 0, "experts per layer (default: from the trace, or 64)")
    flags.DEFINE_integer("top_k", 8, "synthetic: experts per token")
    flags.DEFINE_integer("layers", 4, "synthetic: layers")
    flags.DEFINE_integer("tokens", 1500, "synthetic: tokens")
    flags.DEFINE_integer("working_set", 8, "working-set slots (max_working_set)")
    flags.DEFINE_integer("warmup", 100, "forwards not counted")
    flags.DEFINE_integer("seed", 0, "seed")
    app.run(main)


if __name__ == "__main__":
    run()

"""Single-request decode speed of this tree vs another source tree (e.g. the commit before the scheduler), measured in
the same run: alternating subprocesses, each loading the engine, compiling, then timing ``--reps`` greedy
generations of ``--tokens`` tokens (EOS ignored); the table shows the median decode tok/s of every process and the
median over them.

    git archive <commit> | tar -x -C /tmp/base && (cd /tmp/base && ln -s plugins glm_jax_plugins)
    python -m tools.bench.serve --baseline_src=/tmp/base [--max_batch=1,8]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS

CHILD = r"""
import json, statistics, sys
import glm_jax
kw = json.loads(sys.argv[1])
n, reps, prompt = kw.pop("tokens"), kw.pop("reps"), kw.pop("prompt")
e = glm_jax.Engine.load(**kw)
e.generate(prompt, max_new_tokens=n, stop_on_eos=False)
e.generate(prompt, max_new_tokens=n, stop_on_eos=False)
r = [e.generate(prompt, max_new_tokens=n, stop_on_eos=False) for _ in range(reps)]
print(json.dumps({"tok_s": statistics.median(x.stats["decode_tok_s"] for x in r), "tokens": r[0].tokens}))
"""


def child(src: str, kw: dict) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw)], cwd=src, env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"bench_serve: {src}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


STREAM_CHILD = r"""
import json, sys, time
import glm_jax
kw = json.loads(sys.argv[1])
n, prompts, cold = kw.pop("tokens"), kw.pop("prompts"), kw.pop("cold")
e = glm_jax.Engine.load(**kw)
B = kw["max_batch"]
ps = prompts[:B]
e.generate(ps, max_new_tokens=4, stop_on_eos=False)                 # compile
out = []
for rep in range(2):
    if cold:
        e.store.drop_cache()
    else:
        e.generate(ps, max_new_tokens=n, stop_on_eos=False)         # every expert this run needs: cached
    t0 = time.perf_counter()
    rs = e.generate(ps, max_new_tokens=n, stop_on_eos=False)
    wall = time.perf_counter() - t0
    st = e.store.stats()
    gen = sum(len(r.tokens) for r in rs)
    out.append(dict(tok_s=gen / wall, bytes_per_tok=st["bytes_read"] / gen, hit_rate=st.get("hit_rate", 0.0),
                    dropped=rs[0].stats.get("experts_dropped", 0) / gen))
print(json.dumps(min(out, key=lambda d: -d["tok_s"])))
"""


INTERVAL_CHILD = r"""
import json, statistics, sys
import glm_jax
kw = json.loads(sys.argv[1])
n, reps, prompt, intervals = kw.pop("tokens"), kw.pop("reps"), kw.pop("prompt"), kw.pop("intervals")
e = glm_jax.Engine.load(**kw)
s = e.scheduler
res = {str(i): [] for i in intervals}
events = {}
def one(i):
    s.stream_interval = i
    ev = []
    req = e.request(prompt, max_new_tokens=n, stop_on_eos=False, on_event=lambda r, t, k, d: ev.append(len(k)))
    s.submit(req)
    s.run([req])
    events[str(i)] = (n - 1) / max(1, sum(1 for x in ev[1:] if x))
    return s.result(req).stats["decode_tok_s"]
for i in intervals:
    one(i); one(i)
for _ in range(reps):
    for i in intervals:
        res[str(i)].append(one(i))
print(json.dumps({"tok_s": {k: statistics.median(v) for k, v in res.items()}, "per_event": events}))
"""


def interval_table():
    """A streamed request (on_event set, as the server's) at each --stream_interval: decode tok/s and tokens per
    stream event, interleaved in each process."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    iv = [int(x) for x in FLAGS.intervals.split(",")]
    res = {i: [] for i in iv}
    per = {}
    for _ in range(FLAGS.procs):
        for b in FLAGS.max_batch.split(","):
            kw = dict(tokens=FLAGS.tokens, reps=FLAGS.reps, prompt=FLAGS.prompt, intervals=iv, max_batch=int(b))
            out = subprocess.run([sys.executable, "-c", INTERVAL_CHILD, json.dumps(kw)], cwd=here,
                                 capture_output=True, text=True, timeout=900)
            if out.returncode:
                raise SystemExit(out.stderr.strip().splitlines()[-1])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            for i in iv:
                res[i].append((b, r["tok_s"][str(i)]))
                per[i] = r["per_event"][str(i)]
            print(f"  max_batch {b}: {r}", file=sys.stderr, flush=True)
    print(f"\none streamed request (on_event, as the server's), embedded model, {FLAGS.tokens} tokens, median of "
          f"{FLAGS.reps} per process, {FLAGS.procs} processes, intervals interleaved\n")
    print("| --stream_interval | max_batch | decode tok/s per process | median | tokens per stream event |")
    print("|---|---|---|---|---|")
    for i in iv:
        for b in FLAGS.max_batch.split(","):
            v = [x for bb, x in res[i] if bb == b]
            print(f"| {i} | {b} | {', '.join(f'{x:.0f}' for x in v)} | {np.median(v):.0f} | {per[i]:.1f} |")


def stream_table():
    """Batched expert streaming: the embedded container with fetch=loop and a small cache, B sequences decoded
    together (one expert read serves every row that routes to it)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools.bench.load_test import prompts

    ps = prompts(8, 120, 1)
    rows = []
    configs = [("baseline", {})]
    if FLAGS.budget:
        # budget_max_positions=0: a batched decode forward carries one position per row, so the default (budget only
        # forwards of <= 4 positions, never a prefill) would switch the budget off from 5 rows on
        configs += [("budget2 union", dict(expert_budget=2, budget_scope="union", budget_max_positions=0)),
                    ("budget2 position", dict(expert_budget=2, budget_scope="position", budget_residency="none",
                                              budget_max_positions=0))]
    for name, extra in configs:
        for B in [int(b) for b in FLAGS.batches.split(",")]:
            for cold in (True, False):
                if name != "baseline" and not cold:
                    continue
                kw = dict(fetch="loop", max_batch=B, cache_cap=FLAGS.cache_cap if cold else 16, tokens=FLAGS.tokens,
                          prompts=ps, cold=cold, state_dir="off", **extra)
                if cold and FLAGS.sim_disk_gbps > 0:      # every load also waits as for a GLM-5.2-sized expert
                    kw.update(sim_disk_gbps=FLAGS.sim_disk_gbps, sim_expert_mb=19.0)
                env = dict(os.environ)
                out = subprocess.run([sys.executable, "-c", STREAM_CHILD, json.dumps(kw)], cwd=here, env=env,
                                     capture_output=True, text=True, timeout=900)
                if out.returncode:
                    raise SystemExit(out.stderr.strip().splitlines()[-1])
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append((name, B, "cold" if cold else "warm", r))
                print(f"  {name} B={B} {'cold' if cold else 'warm'}: {r}", file=sys.stderr, flush=True)
    sim = (f", and every expert load also waits as for a 19 MB expert at {FLAGS.sim_disk_gbps:g} GB/s (simulated; "
           "bytes are the real ones)") if FLAGS.sim_disk_gbps > 0 else ""
    print(f"\nbatched expert streaming, embedded container, fetch=loop, {FLAGS.tokens} new tokens per sequence; cold = "
          f"cache_cap {FLAGS.cache_cap} and the store's cache dropped before the run{sim}, warm = every expert "
          "cached\n")
    print("| config | sequences | cache | aggregate tok/s | expert bytes read / generated token (prefill included) | hit rate | dropped / token |")
    print("|---|---|---|---|---|---|---|")
    for name, B, c, r in rows:
        print(f"| {name} | {B} | {c} | {r['tok_s']:.0f} | {r['bytes_per_tok'] / 1e3:.1f} kB | {r['hit_rate']:.2f} | "
              f"{r['dropped']:.2f} |")


def main(argv):
    if FLAGS.mode == "stream":
        stream_table()
        return 0
    if FLAGS.mode == "interval":
        interval_table()
        return 0
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = []
    if FLAGS.baseline_src:
        bl = [b for b in FLAGS.baseline_max_batch.split(",") if b]
        runs = [(f"baseline, max_batch {b}", FLAGS.baseline_src, {"max_batch": int(b)}) for b in bl] or [
            ("baseline", FLAGS.baseline_src, {})]
    for b in FLAGS.max_batch.split(","):
        runs.append((f"this tree, max_batch {b}", here, {"max_batch": int(b)}))
    res = {name: [] for name, _, _ in runs}
    toks = {}
    for rep in range(FLAGS.procs):
        for name, src, extra in runs:
            kw = dict(tokens=FLAGS.tokens, reps=FLAGS.reps, prompt=FLAGS.prompt, **extra)
            r = child(src, kw)
            res[name].append(r["tok_s"])
            toks[name] = r["tokens"]
            print(f"  {name}: {r['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    base = np.median(res[runs[0][0]])
    print(f"\nsingle-request greedy decode, embedded model, {FLAGS.tokens} tokens, median of {FLAGS.reps} "
          f"generations per process, {FLAGS.procs} processes each, interleaved\n")
    print(f"| tree | decode tok/s per process | median | vs {runs[0][0]} | same tokens as {runs[0][0]} |")
    print("|---|---|---|---|---|")
    for name, _, _ in runs:
        m = np.median(res[name])
        print(f"| {name} | {', '.join(f'{x:.0f}' for x in res[name])} | {m:.0f} | {m / base:.2f}x | "
              f"{toks[name] == toks[runs[0][0]]} |")
    return 0


def run():
    flags.DEFINE_string("baseline_src", "", "another source tree to compare with (its glm_jax imported from there)")
    flags.DEFINE_string("max_batch", "1", "widths of this tree to measure (comma-separated)")
    flags.DEFINE_string("baseline_max_batch", "", "widths of the baseline tree to measure (comma-separated; empty: "
                        "its default)")
    flags.DEFINE_integer("tokens", 128, "tokens per generation")
    flags.DEFINE_integer("reps", 5, "timed generations per process")
    flags.DEFINE_integer("procs", 3, "processes per tree")
    flags.DEFINE_string("prompt", "ROMEO:\n", "prompt")
    flags.DEFINE_string("intervals", "0,1,4", "--mode=interval: --stream_interval values")
    flags.DEFINE_enum("mode", "single", ["single", "stream", "interval"], "single: one request vs a baseline tree; "
                      "stream: batched expert streaming table; interval: a streamed request at each --intervals")
    flags.DEFINE_string("batches", "1,2,4,8", "--mode=stream: sequences decoded together")
    flags.DEFINE_integer("cache_cap", 2, "--mode=stream: experts cached per layer in the cold runs")
    flags.DEFINE_bool("budget", True, "--mode=stream: also EXPERT_BUDGET=2 union vs position scope")
    flags.DEFINE_float("sim_disk_gbps", 1.5, "--mode=stream: cold runs also wait as if every loaded expert were 19 MB "
                       "on a disk of this bandwidth (0: off; the shipped model's experts are 30 kB)")
    app.run(main)


if __name__ == "__main__":
    run()

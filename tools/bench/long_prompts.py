"""One glm-jax run in the memory cgroup long_prompts.sh made for it: Engine.load(MODEL) with the defaults, then a
sequence of requests whose prompts grow past the KV the memory plan reserved (64, 220, 700, 1500 tokens, then 64
again); prints a line per request (decode tok/s, expert cache cap, hit rate, private MB, the cgroup's usage, its
mapped file pages and failcnt) and a summary line.  A request that outgrows the plan must neither OOM-kill the
process nor leave it reclaiming its own code pages (Engine.memory_guard; docs/real-scale.md, memory guard).  Not part
of CI.

    python tools/bench/long_prompts.py MODEL        # run by tools/bench/long_prompts.sh
"""
import json
import sys
import time

import numpy as np

from glm_jax import Engine
from glm_jax import memory as MEM

SEQ = [(64, 2), (64, 2), (64, 32), (64, 32), (64, 32), (220, 32), (220, 32), (700, 32), (700, 32), (1500, 16),
       (64, 32)]


def cgroup() -> dict:
    p = [ln.split(":")[2].strip() for ln in open("/proc/self/cgroup") if ":memory:" in ln][0]
    d = "/sys/fs/cgroup/memory" + p
    st = dict(ln.split() for ln in open(d + "/memory.stat"))
    return dict(usage_mb=int(open(d + "/memory.usage_in_bytes").read()) >> 20,
                mapped_mb=int(st["mapped_file"]) >> 20, failcnt=int(open(d + "/memory.failcnt").read()))


def main(argv):
    eng = Engine.load(argv[1])
    rng = np.random.default_rng(0)
    summary = []
    for n, m in SEQ:
        t0 = time.perf_counter()
        r = eng.generate([int(t) for t in rng.integers(10, 2000, n)], max_new_tokens=m)
        s, wall = r.stats, time.perf_counter() - t0
        row = dict(prompt=n, new=m, wall_s=round(wall, 1), decode_tok_s=round(s["decode_tok_s"], 2),
                   cap=s.get("cache_cap"), hit=round(s.get("hit_rate") or 0, 2),
                   private_mb=MEM.private_bytes() >> 20, **cgroup())
        print(json.dumps(row), flush=True)
        summary.append(f"{n}:{row['decode_tok_s']}/c{row['cap']}/{row['wall_s']}s")
    print("SUMMARY " + " ".join(summary))


if __name__ == "__main__":
    main(sys.argv)

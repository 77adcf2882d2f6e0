"""One glm-jax run in the memory cgroup ram_margin.sh made for it: Engine.load(MODEL, ram_gb=RAM or the default), two
2-token warm-up generations, then three generations of 32 tokens after a PROMPT-token random prompt; prints one JSON
line (decode tok/s of each, the cache cap and hit rate, the peak RSS).  What the default budget's margin (0.9 x the
cgroup's limit) costs: docs/real-scale.md, memory guard.  Not part of CI.

    python tools/bench/ram_margin.py MODEL RAM_GB [PROMPT]       # run by tools/bench/ram_margin.sh
"""
import json
import resource
import sys

import numpy as np

from glm_jax import Engine


def main(argv):
    model, ram = argv[1], float(argv[2])
    n = int(argv[3]) if len(argv) > 3 else 64
    eng = Engine.load(model, **({"ram_gb": ram} if ram > 0 else {}))
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 2000, n)]
    for _ in range(2):
        eng.generate(prompt, max_new_tokens=2)
    rates, r = [], None
    for _ in range(3):
        r = eng.generate(prompt, max_new_tokens=32)
        rates.append(r.stats["decode_tok_s"])
    print(json.dumps(dict(ram=ram, prompt=n, rates=[round(x, 2) for x in rates], median=float(np.median(rates)),
                          hit=r.stats.get("hit_rate"), cap=r.stats.get("cache_cap"),
                          peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))


if __name__ == "__main__":
    main(sys.argv)

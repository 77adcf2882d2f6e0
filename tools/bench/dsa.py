"""--mode=dsa: decode cost of one GLM-5 MLA + DSA attention layer at its real widths vs context length, the O(k)
gathered top-k path against the dense O(S) masked one (glm_jax.model.mla.mla_attention(gather=True|False)).

    python -m tools.bench --mode=dsa [--contexts=1024,2048,4096,16384,65536] [--reps=5]

Each context runs with the engine's default K/V cache (float16 with f32 compute, --kv_cache_dtype=auto) and with a
float32 one (the cache transformers keeps).

One layer, batch 1, T = 1 (a decode step) with a cache of S slots of which all but the last are filled (random
values), random weights at GLM-5's widths (tools.fixtures.synth_slice glm52: H 6144, 64 heads, q_lora 2048, kv_lora
512, nope 192, rope 64, v 256, indexer 32 x 128, index_topk 2048), f32 compute (glm-jax's CPU default).  Per row:
median ms per step over --reps after a warm-up (compile excluded), the cache bytes of that layer, the step's peak
RSS growth, and "x 78 layers" = the attention part of a GLM-5 decode token at that context (attention only: no
experts, no dense MLP).  The indexer (O(S) with nI x dI = 4096 per key) runs in both paths.
"""

from __future__ import annotations

import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm_jax.model import mla
from glm_jax.model.config import config_from_dict
from tools.fixtures import synth_slice
from tools.fixtures.synth_model import dsa_tensor_specs, make_tensor


def _params(cfg_dict: dict, cfg, dtype):
    specs = {k: (shape, role) for k, shape, role in dsa_tensor_specs(cfg_dict)}
    pre = "model.layers.0.self_attn."

    def get(key, shape):
        s, role = specs[key]
        assert tuple(s) == tuple(shape), (key, s, shape)
        return make_tensor(key, s, role, seed=0)
    p = mla.load_mla_params(get, pre, cfg, 0)
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32 if a.ndim == 1 else dtype), p)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1000.0


def bench(contexts: list, reps: int = 5, dtype=jnp.float32, kv_dtypes=(jnp.float16, jnp.float32)) -> str:
    cd = synth_slice.slice_config("glm52", 2)
    cd["max_position_embeddings"] = max(contexts)
    cfg = config_from_dict(cd)
    p = _params(cd, cfg, dtype)
    rng = np.random.default_rng(0)
    rows = []
    for S in contexts:
        for kv in kv_dtypes:
            cache = mla.init_mla_cache(cfg, 0, 1, S, kv)
            cache = {k: jnp.asarray(rng.standard_normal(v.shape).astype(np.float32) * 0.5, kv) for k, v in cache.items()}
            x = jnp.asarray(rng.standard_normal((1, 1, cfg.hidden_size)).astype(np.float32), dtype)
            start = jnp.asarray([S - 1], jnp.int32)
            row = {"context": S, "k": mla.topk_count(cfg, S), "K/V cache": jnp.dtype(kv).name,
                   "cache MB / layer": sum(v.size * v.dtype.itemsize for v in cache.values()) / 1e6}
            for gather in (True, False):
                f = jax.jit(lambda p, x, c, s, g=gather: mla.mla_attention(cfg, p, x, c, s, 0, None, gather=g)[0])
                r0 = _rss_mb()
                f(p, x, cache, start).block_until_ready()          # compile + warm-up
                ts = []
                for _ in range(reps):
                    t = time.perf_counter()
                    f(p, x, cache, start).block_until_ready()
                    ts.append(time.perf_counter() - t)
                ms = statistics.median(ts) * 1e3
                name = "sparse (gather top-k)" if gather else "dense (O(S) mask)"
                row[f"{name} ms"] = ms
                row[f"{name} x 78 layers tok/s"] = 1e3 / (78 * ms)
                row[f"{name} peak RSS growth MB"] = _rss_mb() - r0
            rows.append(row)
            del cache
    from tools.bench.tables import markdown
    cols = list(rows[0].keys())
    sp, dn = "sparse (gather top-k) ms", "dense (O(S) mask) ms"
    notes = []
    for kv in kv_dtypes:
        mine = [r for r in rows if r["K/V cache"] == jnp.dtype(kv).name]
        base = next((r for r in mine if r["context"] == 2048), mine[0])
        if mine[-1]["context"] >= 65536 and base["context"] == 2048:
            notes.append(f"64K / 2K step time, {jnp.dtype(kv).name} cache: sparse {mine[-1][sp] / base[sp]:.2f}x, "
                         f"dense {mine[-1][dn] / base[dn]:.2f}x")
    notes += [f"one MLA + DSA layer at GLM-5 widths, batch 1, one decode step, {jnp.dtype(dtype).name} compute, "
              f"median of {reps} after a warm-up, {jax.devices()[0].platform} ({jax.device_count()} device), peak RSS "
              "growth = ru_maxrss after the step minus before its compile (0 once an earlier, larger step set the "
              "maximum)"]
    return markdown(rows, cols) + "\n\n" + "\n".join(n for n in notes if n)

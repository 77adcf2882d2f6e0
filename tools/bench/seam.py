"""One MoE seam call (``kernels.moe``, jitted) per weight format: the native build against the portable one (the
scalar code a CPU without a SIMD build runs), in the same process, interleaved, medians.

    python -m tools.bench.seam [--formats=f32,bf16,int8_row,int4_g64] [--tokens=1,16] [--hidden=1536] [--inter=768]
                               [--experts=24] [--top_k=6] [--reps=20]

Every token routes to the same ``--top_k`` experts (the weights one decode step reads at batch 1); GB/s counts the
routed experts' weight bytes once per call.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from glm_jax import kernels
from glm_jax.kernels import formats as quant
from tools.bench.tables import markdown

FLAGS = flags.FLAGS


def _bank(fmt: str, E: int, H: int, I: int):
    rng = np.random.default_rng(0)
    gu = rng.normal(size=(E, 2 * I, H)).astype(np.float32) * 0.1
    dn = rng.normal(size=(E, H, I)).astype(np.float32) * 0.1
    return quant.bank_from_float(gu, dn, fmt, kernel="native")


def main(argv):
    kernels.load(required=True)
    portable = kernels.load_portable()
    E, H, I, K = FLAGS.experts, FLAGS.hidden, FLAGS.inter, FLAGS.top_k
    print(f"kernels.moe at H {H}, I {I}, {K} of {E} experts; native build: "
          f"{'AVX-512 VNNI' if kernels.has_vnni() else 'AVX2 or portable'}; median of {FLAGS.reps}, load average "
          f"{os.getloadavg()[0]:.2f}\n")
    cols = ["format", "tokens", "portable ms", "native ms", "native GB/s", "speed-up"]
    rows = []
    for fmt in FLAGS.formats.split(","):
        bank = _bank(fmt, E, H, I)
        per_expert = sum(int(np.asarray(a).nbytes) for a in (bank.gate_up, bank.gate_up_scale, bank.down,
                                                              bank.down_scale) if a is not None) / E
        for T in (int(t) for t in FLAGS.tokens.split(",")):
            slots = jnp.asarray(np.tile(np.arange(K, dtype=np.int32), (T, 1)))
            w = jnp.full((T, K), 1.0 / K, jnp.float32)
            x = jnp.asarray(np.random.default_rng(1).normal(size=(T, H)).astype(np.float32))
            fns = {v: jax.jit(lambda x, v=v: kernels.moe(
                x, slots, w, bank.gate_up, bank.gate_up_scale, bank.down, bank.down_scale, bank.fmt,
                bank.group("gate_up"), bank.group("down"), bank.dims[1], variant=v)) for v in ("", portable)}
            times = {v: [] for v in fns}
            for f in fns.values():
                f(x).block_until_ready()
            for _ in range(FLAGS.reps):
                for v, f in fns.items():
                    t = time.perf_counter()
                    f(x).block_until_ready()
                    times[v].append(time.perf_counter() - t)
            nat, por = (statistics.median(times[v]) for v in ("", portable))
            rows.append(dict(zip(cols, (fmt, T, f"{1e3 * por:.2f}", f"{1e3 * nat:.2f}",
                                        f"{K * per_expert / nat / 1e9:.1f}", f"{por / nat:.1f}x"))))
    print(markdown(rows, cols))
    return 0


def run():
    flags.DEFINE_string("formats", "f32,bf16,int8_row,int4_g64", "weight formats")
    flags.DEFINE_string("tokens", "1,16", "tokens per call")
    flags.DEFINE_integer("hidden", 1536, "hidden size")
    flags.DEFINE_integer("inter", 768, "expert intermediate size")
    flags.DEFINE_integer("experts", 24, "experts in the bank")
    flags.DEFINE_integer("top_k", 6, "experts per token")
    flags.DEFINE_integer("reps", 20, "interleaved repetitions")
    app.run(main)


if __name__ == "__main__":
    run()

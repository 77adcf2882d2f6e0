"""Benchmarks (never timed unit tests).  Every table compares against a baseline run in the same process.

    python tools/bench.py --mode=hf [--model=DIR] [--new_tokens=64] [--reps=3]
        decode tok/s of glm-jax vs transformers eager on the same model, batch 1, and the ratio (goal >= 5x).
    python tools/bench.py --mode=fetch [--model=DIR]
        the same model through fetch=resident | loop | callback (experts via the store for loop/callback).
    python tools/bench.py --mode=stream ...      -> tools/bench_stream.py (cold-cache streaming vs disk bandwidth)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

flags.DEFINE_enum("mode", "hf", ["hf", "fetch", "stream"], "Which benchmark.")
flags.DEFINE_string("model", "", "Model directory (default: tests/golden/glm4moe_full for hf, the default model "
                    "otherwise).")
flags.DEFINE_integer("new_tokens", 64, "Tokens to decode per run.")
flags.DEFINE_integer("reps", 3, "Repetitions per configuration (interleaved; the median is reported).")
flags.DEFINE_string("out", "", "Also write the markdown table here.")


def _md(rows, cols):
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def bench_hf(model_dir, n_new, reps):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import glm_jax

    torch.set_num_threads(os.cpu_count() or 1)
    eng = glm_jax.Engine.load(model_dir, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(range(3, 13))
    ids = torch.tensor([prompt])

    def hf_run(n):
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        return time.perf_counter() - t, out[0, len(prompt):].tolist()

    eng.generate(prompt, max_new_tokens=n_new, stop_on_eos=False)        # compile outside the timing
    hf_run(4)                                                           # warm up
    e_tps, h_tps = [], []
    same = True
    for _ in range(reps):                                               # interleaved A B A B
        r = eng.generate(prompt, max_new_tokens=n_new, stop_on_eos=False)
        e_tps.append(r.stats["decode_tok_s"])
        t1, _ = hf_run(1)
        tn, toks = hf_run(n_new)
        h_tps.append((n_new - 1) / max(tn - t1, 1e-9))
        same &= toks == r.tokens
    e, h = statistics.median(e_tps), statistics.median(h_tps)
    rows = [{"engine": "glm-jax (jit, donated cache)", "decode tok/s": e, "ratio": e / h},
            {"engine": "transformers eager (torch CPU)", "decode tok/s": h, "ratio": 1.0}]
    table = _md(rows, ["engine", "decode tok/s", "ratio"])
    note = (f"model {model_dir}, batch 1, {n_new} new tokens, median of {reps} interleaved reps, "
            f"{os.cpu_count()} CPU threads; greedy tokens identical: {same}")
    return table + "\n\n" + note


def bench_fetch(model_dir, n_new, reps):
    import glm_jax

    prompt_text = "ROMEO:\n"
    engines = {m: glm_jax.Engine.load(model_dir, fetch=m, cache_cap=0 if m == "resident" else 10 ** 6)
               for m in ("resident", "loop", "callback")}
    res = {m: [] for m in engines}
    toks = {}
    for m, e in engines.items():
        e.generate(prompt_text, max_new_tokens=n_new, stop_on_eos=False)     # compile
    for _ in range(reps):
        for m, e in engines.items():
            r = e.generate(prompt_text, max_new_tokens=n_new, stop_on_eos=False)
            res[m].append(r.stats["decode_tok_s"])
            toks[m] = r.tokens
    base = statistics.median(res["resident"])
    rows = [{"fetch": m, "decode tok/s": statistics.median(v), "vs resident": statistics.median(v) / base,
             "same tokens": toks[m] == toks["resident"]} for m, v in res.items()]
    return _md(rows, ["fetch", "decode tok/s", "vs resident", "same tokens"]) + \
        f"\n\nmodel {model_dir}, warm cache (cap = all experts), {n_new} new tokens, median of {reps}"


def main(argv):
    if FLAGS.mode == "stream":
        from glm_jax_tools import bench_stream

        return bench_stream.main(argv)
    if FLAGS.mode == "hf":
        model = FLAGS.model or os.path.join(ROOT, "tests", "golden", "glm4moe_full")
        out = bench_hf(model, FLAGS.new_tokens, FLAGS.reps)
    else:
        import glm_jax

        model = FLAGS.model or glm_jax.default_model_path()
        out = bench_fetch(model, FLAGS.new_tokens, FLAGS.reps)
    print(out)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(out + "\n")


if __name__ == "__main__":
    app.run(main)

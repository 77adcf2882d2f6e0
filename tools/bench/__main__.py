"""Benchmarks (never timed unit tests).  Every table compares against a baseline run in the same process.

    python -m tools.bench --mode=hf [--model=DIR] [--new_tokens=64] [--reps=3]
        decode tok/s of glm-jax vs transformers eager on the same model, batch 1, and the ratio (goal >= 5x).
    python -m tools.bench --mode=fetch [--model=DIR]
        the same model through fetch=resident | loop | callback (experts via the store for loop/callback).
    python -m tools.bench --mode=plugins [--model=CONTAINER] [--cache_cap=8]
        bytes read per token (store-measured) with and without each routing plugin, route agreement / KL.
    python -m tools.bench --mode=formats [--model=HF_DIR]
        quality of each expert storage format: the model converted to int4_g64 / int4_row / int8_row / bf16 experts
        (dense f32) vs the HF checkpoint run resident in f32, teacher forced: KL, top-1 agreement, max |dlogit|,
        perplexity (default: the shipped model's HF original on its held-out text; a golden fixture is compared
        with transformers' logits in expected.npz).
    python -m tools.bench --mode=stream ...      -> tools/bench/stream.py (cold-cache streaming vs disk bandwidth)
    python -m tools.bench --mode=cold --model=CONTAINER [--cache_cap=2] [--prefetch=0,1] [--fetches=loop,fused]
        cold streaming end to end vs read alone and compute alone (tools/bench/cold.py): max(read, compute) or sum?
    python -m tools.bench --mode=defaults [--model=CONTAINER]
        the tables behind the defaults: MTP / draft K, fetch mode, kernels (shipped model), I/O threads (a container
        streamed cold, when --model is given)
    python -m tools.bench --mode=peer --model=HF_DIR[,b,...] --llamacpp=PREFIX [--formats=f32,int8_row,int4_g64]
                          [--dense_formats=f32,int8,int8] [--new_tokens=64] [--prompt_tokens=16] [--reps=3] [--threads=2]
        model x format x engine: decode and prefill tok/s of glm-jax, llama.cpp and (f32) transformers, ratios to
        llama.cpp, same greedy tokens; interleaved rounds, medians, same pinned threads (tools/bench/peer.py).
        Without --dense_formats both conversions a user compares: glm-jax-convert's default and the GGUF's bits
        (one row where they are the same).
    python -m tools.bench --mode=lowram --model=HF_DIR|stream --llamacpp=PREFIX --limits=4000,1400,1000,700
        decode tok/s of llama.cpp (Q4_0 mmap, --repack 0 and 1) and glm-jax (int4_g64 container of the converter's
        defaults, run with no flags at all) in memory cgroups of each limit, cold file cache before every run
        (tools/bench/peer.py).
    python -m tools.bench --mode=slice --arch=glm45air|glm52 --layers=N [--llamacpp=PREFIX] [--boxes=0,128,64,24]
        a slice at the architecture's real widths (tools/fixtures/synth_slice.py), both engines cold in memory cgroups of what
        a 24 / 64 / 128 GB box leaves per layer, projected to the full model beside the disk-physics bound and
        colibri's points (tools/bench/slice.py); [--slice_reps=3] interleaved rounds per box, medians, ratios.
    python -m tools.bench --mode=dsa [--contexts=1024,2048,4096,16384,65536]
        one GLM-5 MLA + DSA attention layer at real widths, decode step time vs context: gathered top-k vs the
        dense O(S) mask (tools/bench/dsa.py).
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

from tools.bench.peer import cold_generate
from tools.bench.tables import markdown

FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

flags.DEFINE_enum("mode", "hf", ["hf", "fetch", "stream", "plugins", "formats", "cold", "defaults", "peer", "lowram",
                                  "slice", "dsa"],
                  "Which benchmark.")
flags.DEFINE_string("prefetch", "0,1", "--mode=cold: router-lookahead prefetch settings to run (comma list of 0/1).")
flags.DEFINE_bool("direct_io", False, "--mode=cold: O_DIRECT expert reads.")
flags.DEFINE_string("fetches", "loop,fused", "--mode=cold: the streamed fetch modes to run (comma list).")
flags.DEFINE_float("dispatch_ms", 50.0, "--mode=cold: the engines' --dispatch_ms (decode steps per compiled dispatch: "
                   "as many as fit in this many ms, 1 to 32).")
flags.DEFINE_integer("cache_cap", 8, "--mode=plugins: expert cache cap per layer.")
flags.DEFINE_string("model", "", "Model directory (default: tests/golden/glm4moe_full for hf, the default model "
                    "otherwise). --mode=peer: a comma-separated list of HF dirs, 'shipped' (models/tiny_shakespeare_hf, "
                    "the default) or 'b' (the b-shaped 335 M model, made in --workdir); --mode=lowram: an HF dir or "
                    "'stream' (the default: the synthetic streaming model, made in --workdir).")
flags.DEFINE_integer("new_tokens", 64, "Tokens to decode per run (--mode=lowram: 32 unless given).")
flags.DEFINE_integer("reps", 3, "Repetitions per configuration (interleaved; the median is reported; --mode=lowram: "
                     "1 unless given).")
flags.DEFINE_string("llamacpp", "", "--mode=peer|lowram: llama.cpp prefix (bin/llama-bench, llama-quantize, "
                    "llama-server, venv/ with the converter; tools/bench/build_llamacpp.sh PREFIX builds one). "
                    "Empty: glm-jax (and transformers) only.")
flags.DEFINE_string("formats", "f32,int8_row,int4_g64", "--mode=peer: glm-jax formats; each is compared with a GGUF "
                    "type: f32 (the HF dir resident, float32) <-> F32, int8_row <-> Q8_0, int4_g64 <-> Q4_0. --mode=formats: the "
                    "expert formats scored (default int4_g64,int4_row,int8_row,bf16).")
flags.DEFINE_string("dense_formats", "", "--mode=peer: glm-jax-convert --dense_format per entry of "
                    "--formats (one value: the same for all; the f32 row always runs the HF dir, f32; not given: "
                    "the converter's default and the GGUF's bits, one row where they agree). --mode=formats: every expert format is converted with each of "
                    "these (default f32).")
flags.DEFINE_integer("prompt_tokens", 16, "--mode=peer|lowram: prompt length in tokens.")
flags.DEFINE_integer("threads", 2, "--mode=peer|lowram: threads (CPUs) for every engine.")
flags.DEFINE_string("workdir", os.path.join(os.path.expanduser("~"), ".cache", "glm-jax-bench"),
                    "--mode=peer|lowram: converted models, GGUFs, generated checkpoints and logs (never the repo).")
flags.DEFINE_string("glmjax_options", "mtp=false", "--mode=peer|lowram: extra glm-jax engine options, name=value,... "
                    "(Engine.load keywords = glm-jax flags). Default: no MTP drafts (llama-bench decodes one token "
                    "per forward).")
flags.DEFINE_string("hf_python", "", "--mode=peer: Python with torch + transformers for the transformers rows "
                    "(default: PREFIX/venv/bin/python, then this Python; skipped with a note where neither has them).")
flags.DEFINE_string("limits", "4000,1400,1000,700", "--mode=lowram: memory limits in MB (1e6 bytes).")
flags.DEFINE_string("lowram_dense_format", "auto", "--mode=lowram: glm-jax-convert --dense_format of the container "
                    "(auto: the converter's default, no --dense_format).")
flags.DEFINE_float("runtime_mb", -1.0, "--mode=lowram: -1 (default): no --ram_gb, the engine sizes itself from the "
                   "memory cgroup's limit (its RAM budget is the whole process's); 0: --ram_gb = (limit - runtime - "
                   "margin) / 1000 with the runtime RSS measured in the run (unconstrained, --cache_cap=1); > 0: that "
                   "runtime in MB.")
flags.DEFINE_float("margin_mb", 100.0, "--mode=lowram: --ram_gb = (limit - runtime - margin) / 1000.")
flags.DEFINE_float("run_timeout", 1800.0, "--mode=lowram: seconds before one run is killed (reported as timeout).")
flags.DEFINE_enum("arch", "glm45air", ["glm45air", "glm52"], "--mode=slice: which model's real widths.")
flags.DEFINE_integer("layers", 2, "--mode=slice: layers of the slice (the first dense).", lower_bound=2)
flags.DEFINE_string("boxes", "0,128,64,24", "--mode=slice: box sizes in GB whose per-layer memory the cgroups give "
                    "the slice (0: no limit; it runs first and is every engine's compute time for the projection).")
flags.DEFINE_float("os_reserve_mb", 1500.0, "--mode=slice: MB of each box kept for the OS.", lower_bound=0.0)
flags.DEFINE_float("slice_runtime_mb", 1000.0, "--mode=slice: MB of each box (and of each limit) for the engine's "
                   "runtime; 0: glm-jax's, measured in the run (peak RSS with --cache_cap=1 minus its accounting).",
                   lower_bound=0.0)
flags.DEFINE_float("slice_nolimit_mb", 16000.0, "--mode=slice: the cgroup limit of box 0 (no limit).",
                   lower_bound=1.0)
flags.DEFINE_string("slice_dense_formats", "auto", "--mode=slice: glm-jax containers (int4_g64 experts) "
                    "by --dense_format (auto = the converter's default: int4_g64 dense, heads int8, as Q4_0 keeps them; bf16, int8_row: other rows).")
flags.DEFINE_string("slice_fracs", "0.7,0.45,0.3", "--mode=slice: memory limits as fractions of the model's "
                    "size (llama.cpp's Q4_0 GGUF, else the first glm-jax container), the same for every engine; empty: "
                    "none.")
flags.DEFINE_integer("slice_experts", 0, "--mode=slice: routed experts per layer of the slice (0: the "
                    "architecture's own; fewer when the disk can't hold a full layer: the rows then say so).",
                    lower_bound=0)
flags.DEFINE_enum("slice_dtype", "bfloat16", ["bfloat16", "fp8"], "--mode=slice: the random source checkpoint's "
                  "dtype (fp8: 128x128 block scales as in the FP8 releases, half the disk of bf16).")
flags.DEFINE_enum("slice_gguf_base", "bf16", ["bf16", "q8_0"], "--mode=slice: what llama.cpp's converter writes "
                  "before llama-quantize makes the Q4_0 (q8_0: a quarter of the disk of bf16, then requantized).")
flags.DEFINE_string("slice_engines", "llama,glm-jax", "--mode=slice: engines to run (llama: only where --llamacpp "
                    "has llama-bench).")
flags.DEFINE_float("slice_zipf", -1.0, "--mode=slice: the routers' skew both engines run with (tools/fixtures/reskew.py on "
                   "the container, tools/bench/gguf_reskew.py on the GGUF: the same experts, other biases); -1: the "
                   "slice's own 1.1, which hits ~100% in every box; 0.3 hits like colibri's published GLM-5.2 runs.",
                   lower_bound=-1.0)
flags.DEFINE_integer("slice_reps", 3, "--mode=slice: rounds per box; the engines take turns in each (the order "
                     "reversed every other round) and every row is the median round.", lower_bound=1, upper_bound=20)
flags.DEFINE_string("contexts", "1024,2048,4096,16384,65536", "--mode=dsa: context lengths (cache slots).")
flags.DEFINE_string("out", "", "Also write the markdown table here.")
flags.DEFINE_string("kernels", "native,xla", "--mode=formats: expert kernels to score (comma-separated).")


def bench_hf(model_dir, n_new, reps):
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
    table = markdown(rows, ["engine", "decode tok/s", "ratio"])
    note = (f"model {model_dir}, batch 1, {n_new} new tokens, median of {reps} interleaved reps, "
            f"{os.cpu_count()} CPU threads; greedy tokens identical: {same}")
    return table + "\n\n" + note


def bench_fetch(model_dir, n_new, reps):
    import glm_jax

    prompt_text = "ROMEO:\n"
    container = os.path.exists(os.path.join(model_dir, "manifest.json"))
    modes = ("loop", "callback") if container else ("resident", "loop", "callback")
    engines = {m: glm_jax.Engine.load(model_dir, fetch=m, cache_cap=0 if m == "resident" else 10 ** 6)
               for m in modes}
    res = {m: [] for m in engines}
    toks = {}
    for m, e in engines.items():
        e.generate(prompt_text, max_new_tokens=n_new, stop_on_eos=False)     # compile
    for _ in range(reps):
        for m, e in engines.items():
            r = e.generate(prompt_text, max_new_tokens=n_new, stop_on_eos=False)
            res[m].append(r.stats["decode_tok_s"])
            toks[m] = r.tokens
    first = modes[0]
    base = statistics.median(res[first])
    rows = [{"fetch": m, "decode tok/s": statistics.median(v), f"vs {first}": statistics.median(v) / base,
             "same tokens": toks[m] == toks[first]} for m, v in res.items()]
    return markdown(rows, ["fetch", "decode tok/s", f"vs {first}", "same tokens"]) + \
        f"\n\nmodel {model_dir}, warm cache (cap = all experts), {n_new} new tokens, median of {reps}"


def bench_plugins(model_dir, n_new, cap):
    """Bytes read per decoded token (measured by the store) with and without each routing plugin, cold start,
    cache cap ``cap``, MTP off, greedy; plus the routing-level cost (route agreement, routing KL)."""
    import glm_jax

    cfg = glm_jax.load_config(model_dir)
    K = cfg.num_experts_per_tok
    confs = {"baseline": {}, "topp0.7": dict(expert_topp=0.7),
             f"budget{K // 2}_union_cache": dict(expert_budget=K // 2),
             f"budget{K // 2}_position_none": dict(expert_budget=K // 2, budget_scope="position",
                                                   budget_residency="none"),
             "cache_route_maxrank": dict(cache_route="max_rank", route_j=max(1, K // 4), route_m=min(3 * K,
                                                                                                   cfg.n_routed_experts))}
    prompt = [1 + (7 * i) % (cfg.vocab_size - 1) for i in range(8)]
    rows = []
    for name, o in confs.items():
        e = glm_jax.Engine.load(model_dir, fetch="loop", cache_cap=cap, draft=0, **o)
        e.generate(prompt, max_new_tokens=2, stop_on_eos=False)          # compile
        e.store.drop_cache()
        r = e.generate(prompt, max_new_tokens=n_new, stop_on_eos=False)
        s = r.stats
        rows.append({"config": name, "MB read/token": s["bytes_read_per_token"] / 1e6, "hit rate": s["hit_rate"],
                     "union/layer": s.get("union_per_layer", 0.0), "dropped/token": s["experts_dropped"] /
                     max(s["decode_tokens"], 1), "route agreement": s.get("route_agreement", 1.0),
                     "routing KL": s.get("route_kl", 0.0), "decode tok/s": s["decode_tok_s"]})
        e.close()
    base = rows[0]["MB read/token"]
    for r in rows:
        r["bytes vs baseline"] = r["MB read/token"] / base if base else float("nan")
    cols = ["config", "MB read/token", "bytes vs baseline", "hit rate", "union/layer", "dropped/token",
            "route agreement", "routing KL", "decode tok/s"]
    return markdown(rows, cols) + (f"\n\nmodel {model_dir}, cold start, cache cap {cap}/layer, {n_new} greedy tokens, "
                              "MTP off; bytes counted by the store at the read")


def bench_formats(hf_dir, fmts=("int4_g64", "int4_row", "int8_row", "bf16"), n_windows=8, length=128,
                  dense_fmts=("f32",)):
    """Each expert format (x each glm-jax-convert --dense_format) vs the f32 resident reference on the same token
    windows (teacher forced)."""
    import tempfile

    import numpy as np

    import glm_jax
    from glm_jax import evaluate as ev
    from glm_jax.experts.convert import convert

    exp_path = os.path.join(hf_dir, "expected.npz")
    heldout = os.path.join(hf_dir, "heldout.txt")
    if not os.path.exists(heldout):
        heldout = os.path.join(glm_jax.default_model_path(), "heldout.txt")
    ref_eng = glm_jax.Engine.load(hf_dir, fetch="resident", dtype="float32")
    if os.path.exists(exp_path):            # a golden fixture: transformers' f32 logits are the reference
        exp = dict(np.load(exp_path))
        wins = [r.tolist() for r in exp["input_ids"]]
        refs = [exp["logits"][i].astype(np.float32) for i in range(len(wins))]
        ref_name = "transformers f32 (expected.npz)"
    else:
        wins = ev.make_windows(ref_eng.tokenizer, ev.read_plays(heldout), n_windows, length, 1234)
        refs = [ref_eng.logits(w) for w in wins]
        ref_name = "glm-jax resident f32 on the HF checkpoint"
    rows = []

    def score(name, eng, size_mb=None, dense="f32 (HF)", dense_mb=None):
        kls, agree, dmax, nll = [], [], [], []
        for w, r in zip(wins, refs):
            lg = eng.logits(w)
            kls.append(ev.kl_divergence(r, lg))
            agree.append(lg.argmax(-1) == r.argmax(-1))
            dmax.append(np.abs(lg - r).max())
            t = np.asarray(w[1:])
            nll.append(-ev.log_softmax(lg[:-1])[np.arange(len(t)), t])
        rows.append({"experts": name, "dense": dense, "expert MB (MTP int8)": size_mb, "dense MB": dense_mb, "KL(ref‖fmt)/token": float(np.concatenate(kls).mean()),
                     "top-1 agreement": float(np.concatenate(agree).mean()), "max |Δlogit|": float(max(dmax)),
                     "PPL": float(np.exp(np.concatenate(nll).mean()))})

    if not os.path.exists(exp_path):
        score("reference (" + ref_name + ")", ref_eng)
    with tempfile.TemporaryDirectory() as tmp:
        for f in fmts:
            for df in dense_fmts:
                d = os.path.join(tmp, f"{f}-{df}")
                man = convert(hf_dir, d, expert_format=f, dense_format=df, progress=False)
                mb = sum(e["length"] for e in man["experts"]) / 1e6
                for kern in FLAGS.kernels.split(","):
                    # native: int8 activations x quantized weights (VNNI); xla: f32 activations x dequantized weights
                    eng = glm_jax.Engine.load(d, fetch="loop", cache_cap=10 ** 6, dtype="float32", kernels=kern)
                    score(f"{f} ({kern})", eng, mb, man["dense"]["format"], man["dense"]["size"] / 1e6)
                    eng.close()
    cols = ["experts", "dense", "expert MB (MTP int8)", "dense MB", "KL(ref‖fmt)/token", "top-1 agreement",
            "max |Δlogit|", "PPL"]
    return markdown(rows, cols) + (f"\n\nmodel {hf_dir}; reference: {ref_name}; {len(wins)} windows of "
                                   f"{len(wins[0])} tokens, teacher forced; dense: glm-jax-convert --dense_format")


def _interleaved(engines: dict, prompt, n_new: int, reps: int, warm: int = 8) -> dict:
    """{name: (median decode tok/s, median prefill tok/s, last stats)} over interleaved reps."""
    for e in engines.values():
        e.generate(prompt, max_new_tokens=warm, stop_on_eos=False)
    res = {k: ([], []) for k in engines}
    last = {}
    for _ in range(reps):
        for k, e in engines.items():
            r = cold_generate(e, prompt, n_new)       # a cold prefill (no K/V reused from the previous rep)
            res[k][0].append(r.stats["decode_tok_s"])
            res[k][1].append(r.stats["prefill_tokens"] / max(r.stats["prefill_s"], 1e-9))
            last[k] = r
    return {k: (statistics.median(d), statistics.median(p), last[k]) for k, (d, p) in res.items()}


def bench_defaults(container, n_new, reps):
    """The measured tables behind the defaults: MTP and draft K, fetch mode, kernels, I/O threads."""
    import glm_jax

    out = []
    prompt = list(range(40, 56))
    # 1. speculative decoding (the shipped model has the only trained MTP head)
    engs = {"--nomtp (default)": glm_jax.Engine.load(None, mtp=False)}
    for k in (1, 2, 3, 4):
        engs[f"--mtp --draft={k}"] = glm_jax.Engine.load(None, mtp=True, draft=k)
    r = _interleaved(engs, prompt, n_new, reps)
    ref = r["--nomtp (default)"][2].tokens
    rows = [{"config": k, "decode tok/s": d, "x default": d / r["--nomtp (default)"][0],
             "MTP acceptance": v.stats.get("mtp_acceptance", float("nan")),
             "tokens / forward": v.stats.get("tokens_per_forward", 1.0), "same tokens": v.tokens == ref}
            for k, (d, p, v) in r.items()]
    out.append("### MTP and draft K (shipped model, experts resident)\n\n" + markdown(rows, list(rows[0])))
    for e in engs.values():
        e.close()
    # 2. fetch mode and kernels on the shipped container (every expert fits: auto = resident)
    engs = {"auto -> resident, native kernels (default)": glm_jax.Engine.load(None),
            "loop, native": glm_jax.Engine.load(None, fetch="loop"),
            "callback, native": glm_jax.Engine.load(None, fetch="callback"),
            "auto -> resident, xla kernels": glm_jax.Engine.load(None, kernels="xla")}
    r = _interleaved(engs, prompt, n_new, reps)
    d0 = r["auto -> resident, native kernels (default)"][0]
    rows = [{"config": k, "decode tok/s": d, "prefill tok/s": p, "x default": d / d0} for k, (d, p, v) in r.items()]
    out.append("### fetch mode and kernels (shipped int4 container, every expert in RAM)\n\n"
               + markdown(rows, list(rows[0])))
    for e in engs.values():
        e.close()
    # 3. I/O threads, cold streaming (a container larger than its cache)
    if container:
        engs = {t: glm_jax.Engine.load(container, fetch="loop", cache_cap=FLAGS.cache_cap, io_threads=t)
                for t in (1, 2, 4, 8)}
        res = {t: [] for t in engs}
        for _ in range(reps):
            for t, e in engs.items():
                e.store.drop_cache(page_cache=True)
                x = e.generate(prompt, max_new_tokens=min(n_new, 32), stop_on_eos=False)
                res[t].append(x.stats["decode_tok_s"])
        rows = [{"io_threads": t, "decode tok/s (cold, cap %d)" % FLAGS.cache_cap: statistics.median(v)}
                for t, v in res.items()]
        out.append(f"### I/O threads, cold streaming ({container})\n\n" + markdown(rows, list(rows[0])))
        for e in engs.values():
            e.close()
    return "\n\n".join(out) + (f"\n\n{n_new} greedy tokens after a {len(prompt)}-token prompt, medians of {reps} "
                                f"interleaved reps, {os.cpu_count()} CPU threads")


def peer_main(argv):
    import sys

    from tools.bench import peer as P

    try:
        if len(argv) > 1:
            raise P.BenchError(f"unexpected arguments: {' '.join(argv[1:])}")
        opts = P.parse_options(FLAGS.glmjax_options)
        if FLAGS.mode == "peer":
            out = P.run_peer(P.parse_list(FLAGS.model or "shipped", "model"), P.parse_list(FLAGS.formats, "formats"),
                             P.parse_list(FLAGS.dense_formats, "dense_formats") if FLAGS["dense_formats"].present
                             else None, FLAGS.llamacpp, FLAGS.workdir,
                             FLAGS.new_tokens, FLAGS.prompt_tokens, FLAGS.reps, FLAGS.threads, opts,
                             FLAGS.hf_python, log=lambda m: print(m, file=sys.stderr, flush=True))
        elif FLAGS.mode == "slice":
            from tools.bench import slice as bench_slice

            boxes = sorted(P.parse_list(FLAGS.boxes, "boxes", float), key=lambda b: (b != 0, -b))
            if any(b < 0 for b in boxes) or 0 not in boxes:
                raise P.BenchError(f"--boxes: sizes >= 0 GB with 0 (no limit) among them, got {FLAGS.boxes!r}")
            out = bench_slice.run_slice(FLAGS.arch, FLAGS.layers, FLAGS.llamacpp, FLAGS.workdir, FLAGS.threads,
                                        FLAGS.new_tokens if FLAGS["new_tokens"].present else 32,
                                        FLAGS.prompt_tokens if FLAGS["prompt_tokens"].present else 64, boxes,
                                        FLAGS.os_reserve_mb, FLAGS.slice_runtime_mb, FLAGS.slice_nolimit_mb,
                                        FLAGS.run_timeout, opts, P.parse_list(FLAGS.slice_dense_formats,
                                                                              "slice_dense_formats"),
                                        log=lambda m: print(m, file=sys.stderr, flush=True),
                                        engines_wanted=tuple(P.parse_list(FLAGS.slice_engines, "slice_engines")),
                                        fracs=tuple(P.parse_list(FLAGS.slice_fracs, "slice_fracs", float)
                                                    if FLAGS.slice_fracs else ()),
                                        experts=FLAGS.slice_experts, dtype=FLAGS.slice_dtype,
                                        gguf_base=FLAGS.slice_gguf_base.upper(), reps=FLAGS.slice_reps,
                                        zipf=None if FLAGS.slice_zipf < 0 else FLAGS.slice_zipf)
        else:
            limits = P.parse_list(FLAGS.limits, "limits", float)
            if any(L <= 0 for L in limits):
                raise P.BenchError(f"--limits: every limit must be > 0 MB, got {FLAGS.limits!r}")
            # no flags at all unless --glmjax_options is given (mtp is off by default in the engine too)
            out = P.run_lowram(FLAGS.model or "stream", limits, FLAGS.llamacpp, FLAGS.workdir, FLAGS.threads,
                               FLAGS.new_tokens if FLAGS["new_tokens"].present else 32, FLAGS.prompt_tokens,
                               FLAGS.reps if FLAGS["reps"].present else 1,
                               opts if FLAGS["glmjax_options"].present else {}, FLAGS.lowram_dense_format,
                               FLAGS.runtime_mb, FLAGS.margin_mb, FLAGS.run_timeout,
                               log=lambda m: print(m, file=sys.stderr, flush=True))
    except P.BenchError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    print(out)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(out + "\n")
    return 0


def main(argv):
    if FLAGS.mode in ("peer", "lowram", "slice"):
        return peer_main(argv)
    if FLAGS.mode == "stream":
        from tools.bench import stream as bench_stream

        return bench_stream.main(argv)
    import glm_jax

    hf_model = os.path.join(ROOT, "models", "tiny_shakespeare_hf")
    if FLAGS.mode == "formats":
        kw = {}
        if FLAGS["formats"].present:
            kw["fmts"] = tuple(FLAGS.formats.split(","))
        if FLAGS["dense_formats"].present:
            kw["dense_fmts"] = tuple(FLAGS.dense_formats.split(","))
        out = bench_formats(FLAGS.model or hf_model, **kw)
    elif FLAGS.mode == "plugins":
        out = bench_plugins(FLAGS.model or glm_jax.default_model_path(), FLAGS.new_tokens, FLAGS.cache_cap)
    elif FLAGS.mode == "defaults":
        out = bench_defaults(FLAGS.model, FLAGS.new_tokens, FLAGS.reps)
    elif FLAGS.mode == "cold":
        from tools.bench import cold as bench_cold

        if not FLAGS.model:
            raise app.UsageError("--mode=cold needs --model=CONTAINER (a converted model larger than its cache)")
        out = bench_cold.bench(FLAGS.model, cache_cap=FLAGS.cache_cap, new_tokens=FLAGS.new_tokens, reps=FLAGS.reps,
                               prefetch=tuple(int(x) for x in FLAGS.prefetch.split(",")), direct_io=FLAGS.direct_io,
                               fetches=tuple(FLAGS.fetches.split(",")), dispatch_ms=FLAGS.dispatch_ms)
    elif FLAGS.mode == "dsa":
        from tools.bench import dsa as bench_dsa

        out = bench_dsa.bench([int(c) for c in FLAGS.contexts.split(",")], reps=FLAGS.reps if FLAGS["reps"].present
                              else 5)
    elif FLAGS.mode == "hf":
        out = bench_hf(FLAGS.model or os.path.join(ROOT, "tests", "golden", "glm4moe_full"), FLAGS.new_tokens,
                       FLAGS.reps)
    else:
        out = bench_fetch(FLAGS.model or hf_model, FLAGS.new_tokens, FLAGS.reps)
    print(out)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(out + "\n")


if __name__ == "__main__":
    app.run(main)

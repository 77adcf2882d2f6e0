"""--mode=slice: a slice of GLM-4.5-Air or GLM-5.2 at its real widths (tools/fixtures/synth_slice.py), both engines cold in
memory cgroups sized to what a 24 / 64 / 128 GB box leaves the full model per MoE layer, and a projection of every
row to the full model.

    python -m tools.bench --mode=slice --arch=glm45air|glm52 --layers=N [--llamacpp=PREFIX] [--boxes=0,128,64,24]
                          [--new_tokens=32] [--prompt_tokens=64] [--slice_reps=3] [--out=docs/real-scale.md]

Every box runs --slice_reps rounds; in a round each engine runs once, the order reversed every other round, and a row
is the median round with every round's decode rate beside it and its ratio to llama.cpp (medians, and the range of
the round-by-round ratios): this VM's memory bandwidth drifts +-20% between minutes, so one run of each is not a
comparison.

How a box becomes a cgroup limit (per engine, from its own files):
    D_slice    = the engine's non-expert bytes in the slice (glm-jax: dense.safetensors; llama.cpp: GGUF size minus
                 the routed-expert tensors at Q4_0), D_full = D_slice x dense params of the full model / of the slice
    per_layer  = (box - os_reserve - runtime - D_full) / MoE layers of the full model   (what each layer may hold)
    limit      = runtime + D_slice + per_layer x MoE layers of the slice
A box whose D_full alone does not fit gets no run ("dense part does not fit").  Box 0 = no limit (a cgroup of
--slice_nolimit_mb, to read the peak); there llama.cpp also runs at its own defaults (repack), which never finish
under a limit, beside the --repack 0 row every limit uses.
Projection to the full model (per engine, with the same engine's no-limit row as its compute time t_c):
    t_full = t_c x active_full / active_slice + max(0, t - t_c) x MoE layers full / MoE layers slice
where active = the weight bytes one decode token touches (all dense matrices but the embedding table, top-k routed
experts per MoE layer): compute scales with the bytes touched, the waiting for misses with the MoE layer count.
Disk-physics bound: 1 / max(t_c, misses per token x expert record bytes / disk GB/s) (slice), and the same with the
full model's compute and MoE layers (full); the disk's GB/s is measured in the same run (cold, O_DIRECT and
buffered, 8 MiB reads of the container's expert file; the larger is used).
"""

from __future__ import annotations

import json
import mmap
import os
import time
from typing import Optional

from tools.bench import peer as bp
from tools.fixtures import reskew, synth_slice

# colibri's published GLM-5.2 points (github.com/JustVugg/colibri: README, #200, #254, #280): box GB -> (tok/s, setup)
COLIBRI = {24: (0.16, "24 GB laptop, cache 2 experts/layer, hit 10-31% (seed PR #254)"),
           64: (1.25, "9950X3D + 64 GB + 5090, Gen5 SSD 10.7 GB/s, hit 64-71% (#280)"),
           128: (1.8, "128 GB, CPU only, warm (README / #200)")}
Q4_0_BYTES_PER_PARAM = 18 / 32


def box_limit_mb(box_gb: float, d_slice: float, d_full: float, n_moe_slice: int, n_moe_full: int,
                 os_reserve_mb: float, runtime_mb: float) -> tuple:
    """(limit MB or None, per-layer MB) of a box for one engine (all sizes in MB = 1e6 bytes)."""
    per_layer = (box_gb * 1000 - os_reserve_mb - runtime_mb - d_full) / n_moe_full
    if per_layer <= 0:
        return None, per_layer
    return runtime_mb + d_slice + per_layer * n_moe_slice, per_layer


def active_bytes(dense_active_params: int, bpp_dense: float, n_moe: int, top_k: int, expert_bytes: float) -> float:
    return dense_active_params * bpp_dense + n_moe * top_k * expert_bytes


def project(t_tok: float, t_c: float, active_ratio: float, moe_ratio: float) -> float:
    """Seconds per token of the full model from a slice's seconds per token (see the module doc)."""
    return t_c * active_ratio + max(0.0, t_tok - t_c) * moe_ratio


def disk_bound_tok_s(t_c: float, misses_per_token: float, record_bytes: float, gbps: float) -> float:
    io = misses_per_token * record_bytes / (gbps * 1e9)
    return 1.0 / max(t_c, io, 1e-9)


def measure_disk_gbps(path: str, nbytes: int = 1 << 30, chunk: int = 8 << 20) -> dict:
    """Cold sequential read of the first nbytes of path: O_DIRECT into an aligned buffer, then buffered after
    evicting the pages again. GB/s of each (1e9 bytes)."""
    out = {}
    size = min(nbytes, os.path.getsize(path)) // chunk * chunk
    for mode in ("direct", "buffered"):
        bp.drop_caches([path])
        flags = os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0)
        fd = os.open(path, flags)
        buf = mmap.mmap(-1, chunk)
        try:
            t = time.perf_counter()
            off = 0
            while off < size:
                n = os.preadv(fd, [buf], off)
                if n <= 0:
                    break
                off += n
            out[mode] = off / (time.perf_counter() - t) / 1e9
        finally:
            os.close(fd)
            buf.close()
    bp.drop_caches([path])
    return out


def _dense_params(c: dict) -> tuple:
    """(dense params, dense params a decode token touches: all but the embedding table)."""
    ps = synth_slice.param_split(c)
    emb = c["vocab_size"] * c["hidden_size"]
    return ps["dense"], ps["dense"] - emb


TWIN_EXPERTS = 8


def slice_name(arch: str, layers: int, experts: int = 0, dtype: str = "bfloat16") -> str:
    """The directory name of a slice under workdir/slices (and of its models' workdir)."""
    return f"{arch}-L{layers}" + (f"-E{experts}" if experts else "") + ("" if dtype == "bfloat16" else f"-{dtype}")


def _expert_stack_bytes(c: dict) -> int:
    """One expert projection of a layer, all its experts stacked in f32: what llama.cpp's converter holds at once."""
    return c["n_routed_experts"] * c["hidden_size"] * c["moe_intermediate_size"] * 4


def widen_gguf(c: dict, ram_bytes: Optional[int] = None) -> bool:
    """Whether llama.cpp's converter would stack one expert projection of a layer in f32 past 40% of this machine's
    RAM (it does, with copies, and was OOM-killed at 24 GB on GLM-5.2's 256 experts): then the GGUF is written by
    tools/bench/gguf_widen.py from a twin with TWIN_EXPERTS experts instead."""
    if ram_bytes is None:
        ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return c["n_routed_experts"] > TWIN_EXPERTS and _expert_stack_bytes(c) > 0.4 * ram_bytes


def widen_note(c: dict) -> str:
    return (f"llama.cpp's GGUF: llama.cpp's converter + llama-quantize on a twin of this slice with {TWIN_EXPERTS} "
            f"routed experts (the same seeded tensors), its expert tensors then widened to all "
            f"{c['n_routed_experts']} by tools/bench/gguf_widen.py (gguf-py's reference quantizer, one expert at a "
            f"time; its experts 0-{TWIN_EXPERTS - 1} checked byte for byte against llama-quantize's): the converter "
            f"itself stacks a layer's experts in f32 ({_expert_stack_bytes(c) / 1e9:.1f} GB a projection) and does not "
            "fit this machine")


def ensure_wide_gguf(hf: str, mdir: str, arch: str, layers: int, dtype: str, llamacpp: str, workdir: str,
                     gguf_base: str, log=print) -> str:
    out = os.path.join(mdir, "gguf", "model-Q4_0.gguf")
    if os.path.exists(out):
        return out
    twin = os.path.join(workdir, "slices", slice_name(arch, layers, TWIN_EXPERTS, dtype), "hf")
    synth_slice.write_slice(twin, arch, layers, dtype=dtype, log=log, n_routed_experts=TWIN_EXPERTS)
    twin_gguf = bp.ensure_gguf(twin, bp.model_workdir(workdir, twin), "Q4_0", llamacpp, log, keep_f32=False,
                               base_type=gguf_base)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    log(f"widening {twin_gguf} to {hf}'s experts -> {out} (tools/bench/gguf_widen.py)")
    bp.run_logged([bp.llamacpp_paths(llamacpp)["python"], os.path.join(os.path.dirname(__file__), "gguf_widen.py"),
                   "--twin", twin_gguf, "--src", hf, "--out", out, "--base", gguf_base.lower()],
                  os.path.join(mdir, "gguf.log"), "gguf_widen.py")
    return out


def ensure_reskewed(container: str, zipf: float, log=print) -> str:
    """The container beside ``container`` with the routers' skew ``zipf`` (tools/fixtures/reskew.py; made once)."""
    out = f"{container}-zipf{zipf:g}"
    if not os.path.exists(out):
        log(f"reskewing {container} -> {out} (tools/fixtures/reskew.py --zipf={zipf:g})")
        reskew.reskew(container, out, zipf)
    return out


def ensure_reskewed_gguf(gguf: str, biases: str, zipf: float, llamacpp: str, mdir: str, log=print) -> str:
    """The GGUF beside ``gguf`` with the routers' biases of ``biases`` (tools/bench/gguf_reskew.py; made once)."""
    out = f"{gguf[:-len('.gguf')]}-zipf{zipf:g}.gguf"
    if not os.path.exists(out):
        log(f"reskewing {gguf} -> {out} (tools/bench/gguf_reskew.py)")
        bp.run_logged([bp.llamacpp_paths(llamacpp)["python"], os.path.join(os.path.dirname(__file__), "gguf_reskew.py"),
                       "--src", gguf, "--biases", biases, "--out", out], os.path.join(mdir, "gguf.log"),
                      "gguf_reskew.py")
    return out


def aggregate_runs(runs: list) -> dict:
    """One row from an engine's rounds in a box, each ``(verdict, out, res)``: the median decode rate and the run it
    came from (its prefill rate, store counters, read bytes: the lower middle of an even count), every round's
    decode rate in order ("-" for a round that failed), the peak over all rounds, and a result naming failures
    ("2 of 3 ok; OOM-killed (while loading) x1")."""
    ok = [(i, r) for i, r in enumerate(runs) if r[0] == "ok" and r[1] and r[1].get("decode_tok_s")]
    peak = max((r[2].get("peak") or 0 for r in runs), default=0)
    bad = {}
    for r in runs:
        if not (r[0] == "ok" and r[1] and r[1].get("decode_tok_s")):
            v = r[0] if r[0] != "ok" else "no result"
            bad[v] = bad.get(v, 0) + 1
    result = "; ".join(([f"{len(ok)} of {len(runs)} ok"] if ok else []) + [f"{v} x{n}" for v, n in bad.items()])
    if len(bad) == 1 and not ok and len(runs) == 1:
        result = next(iter(bad))
    base = dict(peak=peak, result=result, runs="/".join(
        f"{r[1]['decode_tok_s']:.3g}" if r[0] == "ok" and r[1] and r[1].get("decode_tok_s") else "-" for r in runs))
    if not ok:
        return dict(base, decode=None, prefill=None, out=None, res=runs[-1][2] if runs else {})
    by = sorted(ok, key=lambda ir: ir[1][1]["decode_tok_s"])
    i, (_, out, res) = by[(len(by) - 1) // 2]
    return dict(base, decode=out["decode_tok_s"], prefill=out.get("prefill_tok_s") or 0.0, out=out, res=res)


def pair_ratios(a: list, b: list) -> str:
    """Round by round, engine ``a``'s decode rate over engine ``b``'s (rounds where both ran): "min-max"."""
    rs = [x[1]["decode_tok_s"] / y[1]["decode_tok_s"] for x, y in zip(a, b)
          if x[0] == "ok" and y[0] == "ok" and x[1] and y[1] and x[1].get("decode_tok_s") and y[1].get("decode_tok_s")]
    if not rs:
        return "-"
    return f"{min(rs):.2f}" if len(rs) == 1 else f"{min(rs):.2f}-{max(rs):.2f}"


def _container_facts(container: str) -> dict:
    with open(os.path.join(container, "manifest.json")) as f:
        man = json.load(f)
    rl = next(iter(man["layers"].values()))["layout"]["record_len"]
    dense = sum(os.path.getsize(p) for p in bp.files_under(container) if "experts" not in os.path.relpath(p, container))
    files = bp.files_under(container)
    return dict(record_len=rl, dense_bytes=dense, total=sum(os.path.getsize(p) for p in files),
                expert_file=max((p for p in files if p.endswith(".bin")), key=os.path.getsize))


def _glmjax_run(cg, limit_mb, container, prompt, new_tokens, threads, opts, logp, timeout, tag):
    spec = dict(engine="glm-jax", model=container, options=opts, prompt=prompt, new_tokens=new_tokens + 1,
                warm_tokens=2)
    res = bp.run_in_cgroup(bp._worker_cmd(), cg, limit_mb, threads, tag, logp, timeout,
                           json.dumps(spec) + "\nrun\nquit\n")
    out, err, started = bp.worker_result(res)
    verdict = bp.classify_run(res["rc"], res["timed_out"], res["oom_kills"], err, started)
    if verdict != "ok":
        verdict += " (after loading)" if started else " (while loading)"
    return verdict, out, res


def _llama_run(cg, limit_mb, prefix, gguf, prompt_tokens, new_tokens, threads, logp, timeout, tag, repack=False):
    cmd = [os.path.join(prefix, "bin", "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(prompt_tokens),
           "-n", str(new_tokens), "-r", "1", "-o", "jsonl", "-lm", "mmap"] + ([] if repack else ["--repack", "0"])
    res = bp.run_in_cgroup(cmd, cg, limit_mb, threads, tag, logp, timeout)
    out, err = None, ""
    if res["rc"] == 0:
        try:
            rows = bp.parse_llama_bench(res["stdout"])
            out = dict(decode_tok_s=bp.bench_rate(rows, 0, new_tokens),
                       prefill_tok_s=bp.bench_rate(rows, prompt_tokens, 0))
        except (bp.BenchError, ValueError) as e:
            err = str(e)
    elif res["rc"] is not None and res["rc"] > 0:
        err = bp.tail(logp)
    verdict = bp.classify_run(res["rc"], res["timed_out"], res["oom_kills"], err, res["rc"] == 0)
    return verdict, out, res


def run_slice(arch: str, layers: int, llamacpp: str, workdir: str, threads: int, new_tokens: int,
              prompt_tokens: int, boxes: list, os_reserve_mb: float, runtime_mb: float, nolimit_mb: float,
              timeout: float, glmjax_options: dict, dense_formats: list, log=print,
              proc_cgroup: Optional[str] = None, engines_wanted: tuple = ("llama", "glm-jax"),
              fracs: tuple = (), experts: int = 0, dtype: str = "bfloat16", gguf_base: str = "BF16",
              reps: int = 1, zipf: Optional[float] = None) -> str:
    if proc_cgroup is None:
        with open("/proc/self/cgroup") as f:
            proc_cgroup = f.read()
    cg, why = bp.detect_cgroup(proc_cgroup)
    if cg is None:
        return f"--mode=slice skipped: {why}"
    load0 = os.getloadavg()[0]
    t_start = time.time()
    have_llama = bool(llamacpp) and os.path.exists(os.path.join(llamacpp, "bin", "llama-bench"))
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    over = dict(n_routed_experts=experts) if experts else {}
    hf = os.path.join(workdir, "slices", slice_name(arch, layers, experts, dtype), "hf")
    synth_slice.write_slice(hf, arch, layers, dtype=dtype, log=log, **over)
    mdir = bp.model_workdir(workdir, hf)
    with open(os.path.join(hf, "config.json")) as f:
        c_slice = json.load(f)
    c_full = synth_slice.full_config(arch)
    n_moe_s, n_moe_f = synth_slice.moe_layers(c_slice), synth_slice.moe_layers(c_full)
    top_k = c_slice["num_experts_per_tok"]
    e_params = synth_slice.param_split(c_slice)["expert"]
    dp_s, dpa_s = _dense_params(c_slice)
    dp_f, dpa_f = _dense_params(c_full)
    prompt = bp.prompt_ids(hf, prompt_tokens)
    engines = []          # (key, label, kind, path, facts)
    for df in (dense_formats if "glm-jax" in engines_wanted else []):
        t0 = time.time()
        cont = bp.ensure_container(hf, mdir, "int4_g64", df, log)
        if zipf is not None:
            cont = ensure_reskewed(cont, zipf, log)
        facts = _container_facts(cont)
        facts["convert_s"] = time.time() - t0
        label = "glm-jax defaults" if df == "auto" else f"glm-jax, dense {df}"
        engines.append((f"glmjax-{df}", label, "glm-jax", cont, facts))
    notes = []
    if have_llama and "llama" in engines_wanted:
        t0 = time.time()
        if widen_gguf(c_slice):
            gguf = ensure_wide_gguf(hf, mdir, arch, layers, dtype, llamacpp, workdir, gguf_base, log)
            notes.append(widen_note(c_slice))
        else:
            gguf = bp.ensure_gguf(hf, mdir, "Q4_0", llamacpp, log, keep_f32=False, base_type=gguf_base)
        if zipf is not None:        # the routers' biases of a reskewed container of the slice: both engines alike
            biases = ensure_reskewed(bp.ensure_container(hf, mdir, "int4_g64", "auto", log), zipf, log)
            gguf = ensure_reskewed_gguf(gguf, os.path.join(biases, "dense.safetensors"), zipf, llamacpp, mdir, log)
        g_size = os.path.getsize(gguf)
        dense = g_size - n_moe_s * c_slice["n_routed_experts"] * e_params * Q4_0_BYTES_PER_PARAM
        engines.insert(0, ("llama", "llama.cpp Q4_0 (mmap, --repack 0)", "llama", gguf,
                           dict(record_len=e_params * Q4_0_BYTES_PER_PARAM, dense_bytes=dense, total=g_size,
                                convert_s=time.time() - t0)))
    elif "llama" in engines_wanted:
        notes.append("llama.cpp: not run (no llama-bench under --llamacpp); glm-jax rows only")
    if not engines:
        return "--mode=slice: no engine to run (--slice_engines)"
    rt_note = f"runtime {runtime_mb:g} MB (--slice_runtime_mb)"
    if runtime_mb <= 0:
        gj = [e for e in engines if e[2] == "glm-jax"]
        if not gj:
            return "--mode=slice: --slice_runtime_mb=0 measures glm-jax's runtime: run a glm-jax engine too"
        log(f"measuring glm-jax's runtime RSS on {gj[-1][3]} (unconstrained, --cache_cap=1 --direct_io)")
        runtime_mb, peak, acc = bp.measure_runtime_mb(gj[-1][3], prompt, threads, os.path.join(logs, "slice-rt.log"),
                                                      glmjax_options)
        rt_note = (f"runtime {runtime_mb:.0f} MB measured in this run (peak RSS {peak:.0f} MB with --cache_cap=1 "
                   f"minus the engine's own accounting {acc:.0f} MB)")
    disk = measure_disk_gbps(engines[-1][4].get("expert_file") or engines[-1][3])
    gbps = max(disk.values())
    log(f"disk: O_DIRECT {disk['direct']:.2f} GB/s, buffered cold {disk['buffered']:.2f} GB/s")
    rows, t_c = [], {}
    run_no = 0
    # --slice_fracs: limits that are a fraction of the model's size as llama.cpp ships it (the Q4_0 GGUF; the first
    # glm-jax container without llama.cpp), the same limit for every engine
    model_mb = engines[0][4]["total"] / 1e6
    for box in list(boxes) + [("frac", f) for f in fracs]:
        # without a limit llama.cpp's own default (repack: its weights repacked into RAM) runs too, beside the
        # --repack 0 row every limit uses (repack never finishes under a limit: docs/real-scale.md)
        todo = list(engines)
        if box == 0 and engines[0][2] == "llama":
            todo.insert(0, ("llama-defaults", "llama.cpp Q4_0 defaults (mmap, repack)") + engines[0][2:])
        box_name = (f"{box[1]:g}x model" if isinstance(box, tuple) else f"{box:g} GB" if box else "none")
        limits, runs = {}, {key: [] for key, *_ in todo}
        for key, label, kind, path, facts in todo:
            d_s = facts["dense_bytes"] / 1e6
            if isinstance(box, tuple):
                limits[key] = (box[1] * model_mb, 0.0)
            elif box:
                limits[key] = box_limit_mb(box, d_s, d_s * dp_f / dp_s, n_moe_s, n_moe_f, os_reserve_mb, runtime_mb)
            else:
                limits[key] = (nolimit_mb, float("inf"))
        # --slice_reps: the engines take turns, the order reversed every other round (A B C, C B A, ...), so a
        # drift of the machine's speed during the box falls on all of them alike; each row is the median
        for rep in range(reps):
            for key, label, kind, path, facts in (todo if rep % 2 == 0 else todo[::-1]):
                limit = limits[key][0]
                if limit is None:
                    continue
                run_no += 1
                bp.drop_caches(bp.files_under(path))
                logp = os.path.join(logs, f"slice-{kind}.log")
                if kind == "llama":
                    got = _llama_run(cg, limit, llamacpp, path, prompt_tokens, new_tokens, threads, logp, timeout,
                                     str(run_no), repack=key == "llama-defaults")
                else:
                    got = _glmjax_run(cg, limit, path, prompt, new_tokens, threads, dict(glmjax_options), logp,
                                      timeout, str(run_no))
                runs[key].append(got)
                dec = (got[1] or {}).get("decode_tok_s")
                log(f"{box_name} {label}, round {rep + 1} of {reps}: {got[0]}" + (f", {dec:.3g} tok/s" if dec else ""))
        med = {key: aggregate_runs(r)["decode"] for key, r in runs.items() if r}
        for key, label, kind, path, facts in todo:
            limit, per_layer = limits[key]
            d_s = facts["dense_bytes"] / 1e6
            row = {"box": box_name, "engine": label,
                   "limit MB": f"{limit:.0f}" if limit else "-",
                   "per layer MB (experts)": ("all" if per_layer == float("inf") else
                                              "-" if isinstance(box, tuple) else
                                              f"{per_layer:.0f} ({per_layer * 1e6 / facts['record_len']:.0f})")}
            if limit is None:
                row["result"] = (f"dense part does not fit ({d_s * dp_f / dp_s / 1e3:.1f} GB of dense weights in a "
                                 f"{box_name} box)")
                rows.append(row)
                log(f"{row['box']} {label}: {row['result']}")
                continue
            agg = aggregate_runs(runs[key])
            res = agg["res"]
            row["peak MB"] = f"{agg['peak'] / 1e6:.0f}"
            row["read GB"] = f"{res['read_bytes'] / 1e9:.2f}"
            row["result"] = agg["result"]
            if agg["decode"] is None:
                rows.append(row)
                log(f"{row['box']} {label}: {agg['result']}")
                continue
            out = agg["out"]
            t = 1.0 / agg["decode"]
            if box == 0:
                t_c[key] = t
            row["decode tok/s"] = f"{agg['decode']:.3g}" + (f" ({agg['runs']})" if reps > 1 else "")
            row["prefill tok/s"] = f"{agg['prefill']:.3g}"
            if kind == "glm-jax":
                peers = [k for k in (("llama-defaults", "llama") if box == 0 else ("llama",)) if med.get(k)]
                row["x llama.cpp"] = " / ".join(
                    f"{agg['decode'] / med[k]:.2f}" + (f" ({pair_ratios(runs[key], runs[k])})" if reps > 1 else "")
                    for k in peers)
            st = out.get("store") or {}
            misses = None
            if kind == "glm-jax":
                ntok = max(out.get("decode_tokens") or 1, 1)
                row["hit rate"] = f"{st.get('hit_rate', 0):.2f}" if "hit_rate" in st else "-"
                row["MB read / token"] = f"{st.get('bytes_read_per_token', 0) / 1e6:.1f}"
                misses = st.get("decode_misses", 0) / ntok
                row["cache/layer"] = str(out.get("cache_cap"))
            else:
                row["hit rate"] = "-"
                row["MB read / token"] = "-"
            bpp = facts["dense_bytes"] / dp_s
            a_ratio = (active_bytes(dpa_f, bpp, n_moe_f, top_k, facts["record_len"])
                       / active_bytes(dpa_s, bpp, n_moe_s, top_k, facts["record_len"]))
            if key in t_c:
                tc = t_c[key]
                tf = project(t, tc, a_ratio, n_moe_f / n_moe_s)
                row["full model tok/s (projected)"] = f"{1 / tf:.3g}"
                if misses is not None:
                    row["disk bound tok/s slice / full"] = (
                        f"{disk_bound_tok_s(tc, misses, facts['record_len'], gbps):.3g} / "
                        f"{disk_bound_tok_s(tc * a_ratio, misses * n_moe_f / n_moe_s, facts['record_len'], gbps):.3g}")
            rows.append(row)
            log(f"{row['box']} {label}: {json.dumps(row)}")
    from tools.bench.tables import markdown
    cols = ["box", "engine", "limit MB", "per layer MB (experts)", "decode tok/s", "x llama.cpp", "prefill tok/s",
            "hit rate",
            "cache/layer", "MB read / token", "peak MB", "read GB", "full model tok/s (projected)",
            "disk bound tok/s slice / full", "result"]
    for r in rows:
        for k in cols:
            r.setdefault(k, "")
    sizes = "; ".join(f"{lbl}: {f['total'] / 1e9:.2f} GB ({f['dense_bytes'] / 1e9:.2f} GB non-expert, expert "
                      f"record {f['record_len'] / 1e6:.2f} MB, ready in {f['convert_s']:.0f} s: converted in this "
                      "run, or found)"
                      for _, lbl, _, _, f in engines)
    head = (f"{arch} slice, {layers} layers ({n_moe_s} MoE), vocab {c_slice['vocab_size']}, real widths" + (f", but {experts} routed experts per layer (the architecture has {c_full['n_routed_experts']})" if experts else "") + " "
            f"(tools/fixtures/synth_slice.py, random {'FP8 (128x128 block scales)' if dtype == 'fp8' else dtype} weights, Zipf-skewed router bias, {'scale 1.1' if zipf is None else f'scale {zipf:g} (--slice_zipf: reskewed copies of the container and the GGUF)'}); full model: {n_moe_f} MoE layers, "
            f"vocab {c_full['vocab_size']}, {dp_f / 1e9:.2f} B dense parameters (slice: {dp_s / 1e9:.3f} B). "
            f"Files: {sizes}. Decode: {new_tokens} tokens after a {prompt_tokens}-token prompt, {threads} threads, "
            f"batch 1, greedy, {reps} round(s) per box: the engines take turns, the order reversed every other round; "
            "a row is the median round (in brackets: every round's decode tok/s in order; 'x llama.cpp': the ratio "
            "of the medians to llama.cpp's defaults / --repack 0 rows, and the range of the round-by-round ratios). "
            "Each run a fresh process in a fresh memory cgroup (page cache charged), file cache "
            "dropped before it (llama-bench -p P -n N -r 1 -lm mmap --repack 0 with its warmup, and without --repack 0 "
            "in the no-limit row marked defaults; glm-jax: a 2-token "
            f"warm-up generation, a 2-token warm-up, then the median of 3 generations). Box -> limit: {rt_note} "
            f"and OS {os_reserve_mb:g} MB reserved of the box, then the engine's full dense part "
            "(its slice dense bytes scaled by dense parameters), the rest split over the full model's MoE layers; "
            "limit = runtime + slice dense + per-layer x slice MoE layers; an 'Nx model' row's limit is N x "
            f"{model_mb:.0f} MB ({engines[0][1]}'s files), for every engine. Projection and disk bound: see "
            f"tools/bench/slice.py; disk measured in this run: O_DIRECT {disk['direct']:.2f} GB/s, buffered cold "
            f"{disk['buffered']:.2f} GB/s (bound uses {gbps:.2f}). 'read GB' = the process's storage reads "
            "(getrusage), load included.")
    col = ["| box | colibri GLM-5.2 tok/s | setup | scaled to this disk |", "|---|---|---|---|"]
    for b, (v, setup) in COLIBRI.items():
        scaled = f"{v * gbps / 10.7:.3g} (x {gbps:.2f}/10.7 GB/s)" if b == 64 else "disk not published"
        col.append(f"| {b} GB | {v} | {setup} | {scaled} |")
    notes.append(f"load average (1 min) at the start / end: {load0:.2f} / {os.getloadavg()[0]:.2f} on "
                 f"{os.cpu_count()} CPUs (other work shares the cores); bench wall {time.time() - t_start:.0f} s")
    return "\n\n".join([markdown(rows, cols), head, "\n".join(col)] + notes)

"""Peer benchmarks: glm-jax next to llama.cpp (and transformers) measured in the same run.

    python -m tools.bench --mode=peer --model=HF_DIR[,b] --llamacpp=PREFIX [--formats=f32,int8_row,int4_g64]
                          [--dense_formats=f32,int8,int8] [--new_tokens=64] [--prompt_tokens=16] [--reps=3]
                          [--threads=2]
    python -m tools.bench --mode=lowram --model=HF_DIR|stream --llamacpp=PREFIX --limits=4000,1400,1000,700
    python -m tools.bench.peer --make_b=DIR         # the "b-shaped" checkpoint (335 M parameters)
    python -m tools.bench.peer --make_stream=DIR    # the streaming checkpoint (8 MoE layers x 64 experts)

Every engine runs in its own process, pinned to the first ``threads`` CPUs of this process (affinity, plus
OMP/MKL thread counts for torch; llama.cpp also gets ``-t``): glm-jax and transformers as persistent workers (this
file run as ``python bench_peer.py worker``, one JSON spec on stdin, one ``run`` line per measurement, results as
``@@RESULT {json}`` lines on stdout), llama.cpp as one ``llama-bench`` process per measurement. The glm-jax worker
imports whatever ``glm_jax`` the Python running this file has installed; the transformers worker runs in another
Python (llama.cpp's converter venv by default) and needs only torch + transformers.

This module imports only the standard library at the top: the transformers worker runs it in a venv without absl
or jax, and the tests import it for its pure functions (tables, format mapping, parsing, cgroup detection).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Optional

THIS_FILE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE)))
SHIPPED_HF = os.path.join(REPO_ROOT, "models", "tiny_shakespeare_hf")
DEFAULT_WORKDIR = os.path.join(os.path.expanduser("~"), ".cache", "glm-jax-bench")
RESULT_TAG = "@@RESULT "
PROMPT_TEXT = ("ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
               "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.\n")

# llama-bench -r per round (its samples' median is the round's number: one sample of a tiny model lasts a few ms)
LLAMA_REPS = 3
# the store counters a glm-jax worker reports back (generate()'s stats, the last run)
STORE_KEYS = ("bytes_read_per_token", "decode_bytes_read", "decode_misses", "decode_hits", "decode_expert_loads",
              "hit_rate", "read_gbps", "io_wait_s", "bytes_read", "misses", "prefill_tokens", "prefill_s")
# glm-jax expert format <-> the llama.cpp GGUF type it is compared with
GGUF_TYPE = {"f32": "F32", "int8_row": "Q8_0", "int4_g64": "Q4_0"}


class BenchError(Exception):
    """A one-line, user-facing error (bad flag value, missing tool, failed conversion)."""


# ----------------------------------------------------------------------------- pure helpers (tested)
def parse_list(s: str, what: str, conv=str) -> list:
    items = [x.strip() for x in (s or "").split(",") if x.strip()]
    if not items:
        raise BenchError(f"--{what}: empty list")
    try:
        return [conv(x) for x in items]
    except ValueError:
        raise BenchError(f"--{what}: cannot parse {s!r}") from None


def parse_options(s: str) -> dict:
    """'mtp=false,fetch=loop' -> {'mtp': 'false', 'fetch': 'loop'} (glm-jax Engine.load parses the values)."""
    out = {}
    for item in (s or "").split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise BenchError(f"--glmjax_options: expected name=value, got {item.strip()!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


SAME_BITS = {"int8_row": "int8", "int4_g64": "int4_g64"}    # glm-jax-convert --dense_format at the GGUF's bits


def format_plan(formats: list, dense_formats: Optional[list] = None, default_dense=None) -> list:
    """[(expert format, dense format, GGUF type)]: one dense format per expert format (a single one applies to all);
    None: both conversions a user compares -- the converter's default ("auto", no --dense_format) and the GGUF's own
    bits (SAME_BITS), one row when the default resolves to those bits (``default_dense(fmt)``: what auto becomes).
    The f32 row is the HF checkpoint run resident in float32, so its dense format is always f32."""
    for f in formats:
        if f not in GGUF_TYPE:
            raise BenchError(f"--formats: unknown format {f!r} (known: {', '.join(GGUF_TYPE)})")
    if not dense_formats:
        out = []
        for f in formats:
            if f == "f32":
                out.append((f, "f32", GGUF_TYPE[f]))
                continue
            out.append((f, "auto", GGUF_TYPE[f]))
            if default_dense is None or default_dense(f) != SAME_BITS[f]:
                out.append((f, SAME_BITS[f], GGUF_TYPE[f]))
        return out
    if len(dense_formats) == 1:
        dense_formats = dense_formats * len(formats)
    if len(dense_formats) != len(formats):
        raise BenchError(f"--dense_formats: {len(dense_formats)} entries for {len(formats)} formats "
                         f"({','.join(formats)}); give one per format or a single one")
    return [(f, "f32" if f == "f32" else d, GGUF_TYPE[f]) for f, d in zip(formats, dense_formats)]


def parse_llama_bench(text: str) -> list:
    """llama-bench ``-o jsonl`` (or ``-o json``) output -> [{n_prompt, n_gen, n_depth, avg_ts, samples_ts, ...}]."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    for r in rows:
        if "avg_ts" not in r:
            raise BenchError(f"llama-bench output without avg_ts: {json.dumps(r)[:200]}")
    return rows


def bench_rate(rows: list, n_prompt: int, n_gen: int) -> float:
    """tok/s of the llama-bench test with these n_prompt / n_gen: the median of its samples (of its -r reps)."""
    for r in rows:
        if int(r.get("n_prompt", -1)) == n_prompt and int(r.get("n_gen", -1)) == n_gen:
            s = r.get("samples_ts") or [r["avg_ts"]]
            return float(statistics.median(s))
    raise BenchError(f"llama-bench printed no test with n_prompt={n_prompt} n_gen={n_gen}")


def first_difference(a: list, b: list) -> Optional[int]:
    """The first index where two token lists differ (within the shorter one), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def same_tokens(a: Optional[list], b: Optional[list], n: int = 32) -> str:
    if a is None or b is None:
        return "–"
    a, b = list(a)[:n], list(b)[:n]
    i = first_difference(a, b)
    if i is not None:
        return f"no (first difference at token {i})"
    if len(a) != len(b):
        return f"no (only {min(len(a), len(b))} tokens)"
    return "yes"


def median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def peer_rows(cells: list, n_cmp: int = 32) -> list:
    """cells: dicts {model, fmt, engine, weights, decode: [tok/s], prefill: [tok/s], tokens, error} with engine in
    glm-jax | llama.cpp | transformers -> table rows (medians, ratios to the llama.cpp cell of the same model and
    format, greedy tokens compared with that cell's)."""
    ref = {(c["model"], c["fmt"]): c for c in cells if c["engine"] == "llama.cpp" and not c.get("error")}
    rows = []
    for c in cells:
        d, p = median_or_none(c.get("decode", [])), median_or_none(c.get("prefill", []))
        r = ref.get((c["model"], c["fmt"]))
        rd = median_or_none(r["decode"]) if r else None
        rp = median_or_none(r["prefill"]) if r else None
        row = {"model": c["model"], "format": c["fmt_label"], "engine": c["engine"], "weights": c["weights"],
               "decode tok/s": d, "prefill tok/s": p,
               "decode vs llama.cpp": (d / rd) if d and rd else None,
               "prefill vs llama.cpp": (p / rp) if p and rp else None}
        if c.get("error"):
            row["same greedy tokens (first %d)" % n_cmp] = "error: " + c["error"]
        elif c["engine"] == "llama.cpp":
            row["same greedy tokens (first %d)" % n_cmp] = "(reference)" if c.get("tokens") else "–"
        else:
            row["same greedy tokens (first %d)" % n_cmp] = same_tokens(c.get("tokens"), r.get("tokens") if r else None,
                                                                       n_cmp)
        rows.append(row)
    return rows


PEER_COLS = ["model", "format", "engine", "weights", "decode tok/s", "prefill tok/s", "decode vs llama.cpp",
             "prefill vs llama.cpp"]


def ram_gb_for_limit(limit_mb: float, runtime_mb: float, margin_mb: float) -> float:
    """glm-jax --ram_gb (GB = 1e9 bytes: dense + KV + buffers + expert cache) for a memory limit of limit_mb
    (MB = 1e6 bytes): what the limit leaves after the runtime (Python, jax/XLA, compiled programs: everything the
    engine's own RAM budget does not count) and a margin."""
    return round(max(0.0, limit_mb - runtime_mb - margin_mb) / 1000.0, 3)


def worker_result(res: dict) -> tuple:
    """(the decode result or None, the error text, whether the worker got as far as ready) from a glm-jax worker
    run's stdout (run_in_cgroup's result)."""
    err, out, started = "", None, False
    for line in res["stdout"].splitlines():
        if line.startswith(RESULT_TAG):
            o = json.loads(line[len(RESULT_TAG):])
            started = started or bool(o.get("ready"))
            if "error" in o:
                err = o["error"]
            elif "decode_tok_s" in o:
                out = o
    if res["rc"] == 0 and out is None and not err:
        err = "no result"
    return out, err, started


def classify_run(rc: Optional[int], timed_out: bool, oom_kills: int, error: str = "", started: bool = False) -> str:
    """A one-phrase verdict from a child's exit: rc < 0 is -signal (subprocess convention); ``started``: it had
    loaded and was measuring when it failed."""
    if timed_out:
        return "timeout"
    if rc == 0 and not error:
        return "ok"
    if rc is not None and rc < 0:
        sig = -rc
        if oom_kills > 0 or sig == signal.SIGKILL:
            return "OOM-killed" if oom_kills > 0 else "killed (SIGKILL)"
        return f"killed by signal {sig}"
    return ("failed: " if started else "cannot start: ") + (error or f"exit status {rc}")


@dataclasses.dataclass
class Cgroup:
    kind: str            # "v1" | "v2"
    parent: str          # directory the per-run cgroups are made in


def detect_cgroup(proc_cgroup: str, root: str = "/sys/fs/cgroup", euid: Optional[int] = None, probe: bool = True):
    """(Cgroup, "") where memory cgroups can be made, else (None, one-line reason).

    v1: the memory controller at ROOT/memory; per-run groups are made inside this process's own memory cgroup
    (from /proc/self/cgroup), so they stay under whatever already contains us. v2: ROOT/cgroup.controllers lists
    memory and ROOT/cgroup.subtree_control enables it; groups are made directly under ROOT."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return None, "memory cgroups need root (this process runs as uid %d)" % euid
    own_v1 = None
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            own_v1 = parts[2]
    mem_v1 = os.path.join(root, "memory")
    if os.path.exists(os.path.join(mem_v1, "memory.limit_in_bytes")):
        parent = os.path.join(mem_v1, (own_v1 or "/").lstrip("/"))
        if not os.path.isdir(parent):
            parent = mem_v1
        cg, why = Cgroup("v1", parent), ""
    else:
        ctl = os.path.join(root, "cgroup.controllers")
        if not os.path.exists(ctl):
            return None, f"no cgroup memory controller under {root} (neither v1 memory/ nor v2 cgroup.controllers)"
        with open(ctl) as f:
            if "memory" not in f.read().split():
                return None, f"cgroup v2 at {root} has no memory controller"
        sub = os.path.join(root, "cgroup.subtree_control")
        try:
            with open(sub) as f:
                has = "memory" in f.read().split()
        except OSError:
            has = False
        if not has:
            return None, f"cgroup v2: memory is not enabled in {sub}"
        cg, why = Cgroup("v2", root), ""
    if probe:
        d = os.path.join(cg.parent, f"glm-jax-bench-probe-{os.getpid()}")
        try:
            os.mkdir(d)
            os.rmdir(d)
        except OSError as e:
            return None, f"cannot create a memory cgroup in {cg.parent} ({e.strerror})"
    return cg, why


def lowram_rows(cells: dict, limits: list, engines: list) -> list:
    """cells[(limit, engine)] = {"tok_s": [...], "verdict", "note", "flags"} -> rows of the low-RAM table."""
    rows = []
    for L in limits:
        row = {"memory limit": f"{L:g} MB"}
        notes = []
        for key, label in engines:
            c = cells.get((L, key))
            if c is None:
                row[label] = "not run"
                continue
            t = median_or_none(c.get("tok_s", []))
            row[label] = f"{t:.3g}" if t is not None and c["verdict"] == "ok" else c["verdict"].split(":")[0]
            if c.get("flags"):
                row["glm-jax flags"] = c["flags"]
            if c.get("note"):
                notes.append(f"{label}: {c['note']}")
        row["notes"] = "; ".join(notes)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- models
def _shipped_tokenizer_files(src: str = SHIPPED_HF) -> list:
    return [os.path.join(src, f) for f in ("tokenizer.json", "tokenizer_config.json") if os.path.exists(
        os.path.join(src, f))]


def b_config(vocab: int = 2048) -> dict:
    """The "b-shaped" model of issue 16: H 1024, 32 routed experts of moe_intermediate 1024, top-8, 4 layers with
    the first dense (intermediate 2048), 1 shared expert, no MTP layer, the shipped model's vocabulary."""
    from tools.fixtures.synth_model import bench_config
    return _with_shipped_tokens(bench_config(hidden=1024, moe_inter=1024, experts=32, layers=4, top_k=8, vocab=vocab))


def b2_config(vocab: int = 2048) -> dict:
    """The second ~300 M shape (issue 21's own: "H 1536, 24 experts of I 768, top-6, 4 layers"): wider and with
    fewer, smaller experts than b, top-6; the first layer dense (intermediate 3072), 1 shared expert."""
    from tools.fixtures.synth_model import bench_config
    return _with_shipped_tokens(bench_config(hidden=1536, moe_inter=768, experts=24, layers=4, top_k=6, vocab=vocab))


def stream_config(vocab: int = 2048) -> dict:
    """The low-RAM table's model: H 1024, 64 routed experts of moe_intermediate 2048 (3.54 MB at int4_g64), top-8,
    9 layers (the first dense, so 8 MoE layers), the shipped model's vocabulary."""
    from tools.fixtures.synth_model import bench_config
    return _with_shipped_tokens(bench_config(hidden=1024, moe_inter=2048, experts=64, layers=9, top_k=8, vocab=vocab))


def _with_shipped_tokens(c: dict) -> dict:
    c.update(eos_token_id=0, pad_token_id=0, bos_token_id=None,
             rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"],
                              "partial_rotary_factor": c["partial_rotary_factor"]})
    return c


def make_model(out: str, config: dict, zipf: float = 0.0, seed: int = 0, log=print, dtype: str = "bfloat16") -> str:
    """Write a random glm4_moe / glm_moe_dsa / glm4_moe_lite HF checkpoint (bf16 unless dtype, hub per-expert keys, sharded) with the
    shipped model's tokenizer into out (skipped when out/config.json exists); llama.cpp's converter accepts it
    through hf_to_gguf.py."""
    from tools.fixtures.synth_model import write_hf_checkpoint
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    n_exp = config["n_routed_experts"] * (config["num_hidden_layers"] - config["first_k_dense_replace"])
    write_hf_checkpoint(tmp, config, seed=seed, dtype=dtype, zipf=zipf, keep_reference=False,
                        shards=max(1, n_exp // 64))
    for f in _shipped_tokenizer_files():
        shutil.copy(f, tmp)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(tmp, out)
    log(f"wrote {out}: {param_count(out) / 1e6:.0f} M parameters ({time.time() - t0:.0f} s)")
    return out


def param_count(hf_dir: str) -> int:
    """Parameters in a safetensors checkpoint (from the headers only)."""
    n = 0
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            with open(os.path.join(hf_dir, f), "rb") as fh:
                hlen = int.from_bytes(fh.read(8), "little")
                hdr = json.loads(fh.read(hlen))
            for k, v in hdr.items():
                if k != "__metadata__":
                    p = 1
                    for s in v["shape"]:
                        p *= s
                    n += p
    return n


def _fingerprint(hf_dir: str) -> dict:
    out = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith((".safetensors", ".json")) and not f.startswith("."):     # not the store's usage file
            st = os.stat(os.path.join(hf_dir, f))
            out[f] = [st.st_size, st.st_mtime_ns]
    return out


def model_workdir(workdir: str, hf_dir: str) -> str:
    """workdir/models/<name>: the converted copies of one HF dir, wiped when the HF dir changed."""
    import hashlib
    hf_dir = os.path.abspath(hf_dir)
    name = os.path.basename(hf_dir.rstrip("/")) or "model"
    if name == "hf":
        name = os.path.basename(os.path.dirname(hf_dir))
    d = os.path.join(workdir, "models", f"{name}-{hashlib.sha1(hf_dir.encode()).hexdigest()[:8]}")
    fp = _fingerprint(hf_dir)
    stamp = os.path.join(d, "source.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) != {"src": hf_dir, "files": fp}:
                shutil.rmtree(d)
    os.makedirs(d, exist_ok=True)
    if not os.path.exists(stamp):
        with open(stamp, "w") as f:
            json.dump({"src": hf_dir, "files": fp}, f)
    return d


def resolve_model(name: str, workdir: str, log=print) -> str:
    """'shipped' | 'b' | 'b2' | 'stream' | an HF directory -> an HF directory (b / b2 / stream are made in the
    workdir)."""
    if name == "shipped":
        return SHIPPED_HF
    if name == "b":
        return make_model(os.path.join(workdir, "models", "b", "hf"), b_config(), log=log)
    if name == "b2":
        return make_model(os.path.join(workdir, "models", "b2", "hf"), b2_config(), log=log)
    if name == "stream":
        return make_model(os.path.join(workdir, "models", "stream", "hf"), stream_config(), zipf=1.1, log=log)
    if not os.path.exists(os.path.join(name, "config.json")):
        raise BenchError(f"--model: {name}: no config.json (expected an HF checkpoint dir, 'shipped', 'b', "
                         "'b2' or 'stream')")
    return os.path.abspath(name)


def model_label(name: str, hf_dir: str) -> str:
    n = param_count(hf_dir)
    short = {"shipped": "shipped", "b": "b", "b2": "b2", "stream": "stream"}.get(name, os.path.basename(hf_dir.rstrip("/")))
    return f"{short} ({n / 1e6:.3g} M)"


def prompt_ids(hf_dir: str, n: int) -> list:
    with open(os.path.join(hf_dir, "config.json")) as f:
        V = json.load(f)["vocab_size"]
    ids = []
    tok = os.path.join(hf_dir, "tokenizer.json")
    if os.path.exists(tok):
        from tokenizers import Tokenizer
        ids = Tokenizer.from_file(tok).encode(PROMPT_TEXT, add_special_tokens=False).ids
    ids = [i for i in ids if 0 < i < V] or [3 + (7 * i) % (V - 3) for i in range(n)]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def run_logged(cmd: list, log_path: str, what: str, timeout: Optional[float] = None):
    with open(log_path, "a") as lf:
        lf.write("$ " + " ".join(cmd) + "\n")
        lf.flush()
        r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout)
    if r.returncode != 0:
        raise BenchError(f"{what} failed (exit {r.returncode}); see {log_path}")


def ensure_container(hf_dir: str, mdir: str, fmt: str, dense: str, log=print) -> str:
    dst = os.path.join(mdir, f"glm-jax-{fmt}-dense_{dense}")
    if os.path.exists(os.path.join(dst, "manifest.json")):
        from glm_jax.errors import GlmJaxError
        from glm_jax.experts.container import open_container
        from glm_jax.model.config import load_config

        try:                      # a container from an older converter is converted again (finished layers kept)
            open_container(dst, load_config(dst), verify="none").close()
            return dst
        except GlmJaxError as e:
            log(f"{dst}: {e}")
    log(f"converting {hf_dir} -> {dst} (glm-jax-convert --expert_format={fmt}"
        + (f" --dense_format={dense})" if dense != "auto" else ", its default dense format)"))
    run_logged([sys.executable, "-m", "glm_jax.experts.convert", f"--src={hf_dir}", f"--dst={dst}",
                f"--expert_format={fmt}", "--noprogress"] + ([f"--dense_format={dense}"] if dense != "auto" else []),
               os.path.join(mdir, "convert.log"), "glm-jax-convert")
    return dst


def llamacpp_paths(prefix: str) -> dict:
    p = {k: os.path.join(prefix, "bin", k) for k in ("llama-bench", "llama-quantize", "llama-server")}
    p["python"] = os.path.join(prefix, "venv", "bin", "python")
    missing = [v for k, v in p.items() if not os.path.exists(v)]
    if missing:
        raise BenchError(f"--llamacpp={prefix}: missing {', '.join(missing)} (build it with "
                         "../shared/tools/build-llamacpp.sh PREFIX)")
    return p


def hf_to_gguf_script() -> str:
    for c in (os.path.join(REPO_ROOT, "..", "shared", "tools", "hf_to_gguf.py"), "/work/shared/tools/hf_to_gguf.py"):
        if os.path.exists(c):
            return os.path.abspath(c)
    raise BenchError("hf_to_gguf.py not found (expected ../shared/tools/hf_to_gguf.py next to the repo)")


def ensure_gguf(hf_dir: str, mdir: str, qtype: str, prefix: str, log=print, keep_f32: bool = True,
                base_type: str = "BF16") -> str:
    """GGUF of hf_dir in qtype (F32 | Q8_0 | Q4_0): llama.cpp's own converter to F32 (or ``base_type`` when
    keep_f32 is False: BF16 is half the disk for a big model, Q8_0 a quarter -- then requantized, for a slice whose
    BF16 GGUF does not fit the disk), then llama-quantize."""
    lp = llamacpp_paths(prefix)
    gdir = os.path.join(mdir, "gguf")
    os.makedirs(gdir, exist_ok=True)
    out = os.path.join(gdir, f"model-{qtype}.gguf")
    if os.path.exists(out):
        return out
    have_f32 = os.path.exists(os.path.join(gdir, "model-F32.gguf"))
    base_t = "F32" if (keep_f32 or have_f32 or qtype == "F32") else base_type
    base = os.path.join(gdir, f"model-{base_t}.gguf")
    logf = os.path.join(mdir, "gguf.log")
    if not os.path.exists(base):
        log(f"converting {hf_dir} -> {base} (llama.cpp convert_hf_to_gguf.py via hf_to_gguf.py)")
        run_logged([lp["python"], hf_to_gguf_script(), "--src", hf_dir, "--out", base + ".tmp", "--outtype",
                    base_t.lower(), "--llamacpp", prefix], logf, "hf_to_gguf.py")
        os.replace(base + ".tmp", base)
    if qtype != base_t:
        log(f"quantizing {base} -> {out}")
        run_logged([lp["llama-quantize"]] + (["--allow-requantize"] if base_t == "Q8_0" else [])
                   + [base, out + ".tmp", qtype], logf, "llama-quantize")
        os.replace(out + ".tmp", out)
        if base_t != "F32":
            os.remove(base)
    return out


# ----------------------------------------------------------------------------- processes
def pinned_cpus(threads: int) -> list:
    cpus = sorted(os.sched_getaffinity(0))
    if threads < 1 or threads > len(cpus):
        raise BenchError(f"--threads={threads}: this process may run on {len(cpus)} CPUs")
    return cpus[:threads]


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(threads)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _preexec(cpus: list, cgroup_procs: Optional[str] = None):
    def f():
        if cgroup_procs:      # join the memory cgroup before exec: everything the child maps is charged there
            with open(cgroup_procs, "w") as fh:
                fh.write(str(os.getpid()))
        os.sched_setaffinity(0, cpus)
    return f


class Worker:
    """A persistent glm-jax / transformers process (this file's ``worker`` entry)."""

    def __init__(self, python: str, spec: dict, threads: int, log_path: str, cgroup_procs: Optional[str] = None,
                 timeout: float = 1800.0):
        self.log_path = log_path
        self.timeout = timeout
        self.log = open(log_path, "a")
        self.p = subprocess.Popen([python, THIS_FILE, "worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, env=thread_env(threads), start_new_session=True,
                                  preexec_fn=_preexec(pinned_cpus(threads), cgroup_procs))
        self.p.stdin.write(json.dumps(spec) + "\n")
        self.p.stdin.flush()
        self.info = self._read()

    def _read(self) -> dict:
        timer = threading.Timer(self.timeout, self.kill)
        timer.start()
        try:
            for line in self.p.stdout:
                if line.startswith(RESULT_TAG):
                    r = json.loads(line[len(RESULT_TAG):])
                    if "error" in r:
                        raise BenchError(r["error"])
                    return r
        finally:
            timer.cancel()
        raise BenchError(f"worker exited ({self.p.wait()}): {tail(self.log_path)}")

    def run(self) -> dict:
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        return self._read()

    def kill(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
            self.p.wait(timeout=60)
        except Exception:
            self.kill()
            self.p.wait()
        self.log.close()


def tail(path: str, n: int = 1) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        return " | ".join(lines[-n:])[-400:]
    except OSError:
        return ""


def _run_llama_bench(prefix: str, gguf: str, threads: int, p: int, n: int, d: int, extra=(), log_path: str = "",
                     timeout: float = 1800.0, reps: int = 1) -> subprocess.CompletedProcess:
    cmd = [os.path.join(prefix, "bin", "llama-bench"), "-m", gguf, "-t", str(threads), "-p", str(p), "-n", str(n),
           "-d", str(d), "-r", str(reps), "-o", "jsonl", *extra]
    with open(log_path or os.devnull, "a") as lf:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=lf, text=True, timeout=timeout,
                              preexec_fn=_preexec(pinned_cpus(threads)))


def llama_bench(prefix: str, gguf: str, threads: int, p: int, n: int, d: int, extra=(), log_path: str = "",
                timeout: float = 1800.0, reps: int = 1) -> list:
    r = _run_llama_bench(prefix, gguf, threads, p, n, d, extra, log_path, timeout, reps)
    if r.returncode != 0:
        raise BenchError(f"llama-bench exit {r.returncode}: {tail(log_path)}")
    return parse_llama_bench(r.stdout)


def llama_defaults_crash(prefix: str, gguf: str, threads: int, log_path: str) -> str:
    """'' where llama-bench runs the GGUF with its defaults; else how it died (a signal, or its exit status)."""
    r = _run_llama_bench(prefix, gguf, threads, 4, 2, 0, log_path=log_path, timeout=600)
    if r.returncode == 0 and r.stdout.strip():
        return ""
    if r.returncode < 0:
        return f"llama-bench killed by {signal.Signals(-r.returncode).name}"
    return f"llama-bench exit {r.returncode}" + ("" if r.stdout.strip() else ", no result")


def wait_healthy(url: str, srv, log_path: str, name: str, timeout: float = 300.0):
    """Until ``url``/health answers 200; BenchError when the server ``srv`` (a Popen) exits or ``timeout`` passes."""
    t0 = time.time()
    while True:
        if srv.poll() is not None:
            raise BenchError(f"{name} exited {srv.returncode}: {tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() - t0 > timeout:
            raise BenchError(f"{name} did not become healthy in {timeout:.0f} s")
        time.sleep(0.3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_greedy_tokens(prefix: str, gguf: str, prompt: list, n: int, threads: int, log_path: str,
                        extra=()) -> list:
    """llama.cpp's greedy continuation of the prompt ids: llama-server on 127.0.0.1, POST /completion with the
    prompt as token ids, temperature 0, top_k 1, ignore_eos, return_tokens; the server is stopped after."""
    port = free_port()
    cmd = [os.path.join(prefix, "bin", "llama-server"), "-m", gguf, "-t", str(threads), "--host", "127.0.0.1",
           "--port", str(port), "-c", str(len(prompt) + n + 16), "-np", "1", *extra]
    lf = open(log_path, "a")
    srv = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                           preexec_fn=_preexec(pinned_cpus(threads)))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, srv, log_path, "llama-server")
        body = json.dumps({"prompt": list(map(int, prompt)), "n_predict": n, "temperature": 0.0, "top_k": 1,
                           "samplers": ["top_k"], "ignore_eos": True, "return_tokens": True,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        if int(out.get("tokens_evaluated", len(prompt))) != len(prompt):
            raise BenchError(f"llama-server evaluated {out.get('tokens_evaluated')} prompt tokens, not {len(prompt)} "
                             "(a BOS token added?)")
        return list(out["tokens"])
    finally:
        if srv.poll() is None:           # (a server that died at start has no process group left to signal)
            try:
                os.killpg(srv.pid, signal.SIGTERM)
                srv.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(srv.pid, signal.SIGKILL)
                srv.wait()
            except ProcessLookupError:
                srv.wait()
        lf.close()


def read_through(path: str, chunk: int = 8 << 20):
    """Read a file once (cheap when it is already in the page cache)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass


def python_has(python: str, modules: str) -> bool:
    try:
        return subprocess.run([python, "-c", f"import {modules}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def glm_jax_version() -> str:
    r = subprocess.run([sys.executable, "-c", "import glm_jax, os; print(os.path.dirname(glm_jax.__file__))"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    d = r.stdout.strip()
    g = subprocess.run(["git", "-C", d, "describe", "--always", "--dirty"], stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, text=True) if d else None
    return f"glm_jax from {d}" + (f" (git {g.stdout.strip()})" if g is not None and g.returncode == 0 else "")


def llamacpp_version(prefix: str) -> str:
    r = subprocess.run([os.path.join(prefix, "bin", "llama-bench"), "--version"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    v = " ".join(r.stdout.split())
    return v[:120] or "unknown"


# ----------------------------------------------------------------------------- --mode=peer
def run_peer(models: list, formats: list, dense_formats: list, llamacpp: str, workdir: str, new_tokens: int,
             prompt_tokens: int, reps: int, threads: int, glmjax_options: dict, hf_python: str = "",
             log=print) -> str:
    from glm_jax.experts.convert import auto_dense_format

    plan = format_plan(formats, dense_formats, auto_dense_format)
    load0 = os.getloadavg()[0]
    if new_tokens < 2 or prompt_tokens < 1 or reps < 1:
        raise BenchError("--new_tokens >= 2, --prompt_tokens >= 1 and --reps >= 1 are needed")
    pinned_cpus(threads)
    if llamacpp:
        llamacpp_paths(llamacpp)
    os.makedirs(workdir, exist_ok=True)
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    notes = []
    if not llamacpp:
        notes.append("llama.cpp: skipped (no --llamacpp=PREFIX); no ratios")
    hf_py = None
    if any(f == "f32" for f, _, _ in plan):
        cands = [hf_python] if hf_python else ([os.path.join(llamacpp, "venv", "bin", "python")] if llamacpp
                                               else []) + [sys.executable]
        hf_py = next((c for c in cands if c and os.path.exists(c) and python_has(c, "torch, transformers")), None)
        if hf_py is None:
            notes.append(f"transformers: skipped (torch + transformers not importable in {', '.join(cands)})")
    n_cmp = min(32, new_tokens)
    cells = []
    for name in models:
        hf = resolve_model(name, workdir, log)
        label = model_label(name, hf)
        mdir = model_workdir(workdir, hf)
        prompt = prompt_ids(hf, prompt_tokens)
        confs = []      # (cell, runner) in the order of the rounds
        workers = []
        try:
            for fmt, dense, qt in plan:
                fl = f"{fmt} ↔ {qt}"
                if llamacpp:
                    g = ensure_gguf(hf, mdir, qt, llamacpp, log)
                    c = dict(model=label, fmt=fmt, fmt_label=fl, engine="llama.cpp", decode=[], prefill=[],
                             weights=f"GGUF {qt}, llama.cpp defaults (mmap, repack)")
                    cells.append(c)
                    lp = os.path.join(logs, "llamacpp.log")
                    # llama.cpp's defaults first; where they crash (its weight repacking died of SIGSEGV / SIGILL
                    # on an AMX Xeon VM, 2026-12-02), the row is --repack 0, the flag such a user falls back to
                    crash = llama_defaults_crash(llamacpp, g, threads, lp)
                    if crash:
                        c["weights"] = f"GGUF {qt}, llama.cpp --repack 0 (its defaults crashed here: {crash})"
                        notes.append(f"llama.cpp defaults ({label}, {qt}): {crash}; measured with --repack 0")
                    rp = ("--repack", "0") if crash else ()
                    try:
                        c["tokens"] = llama_greedy_tokens(llamacpp, g, prompt, n_cmp, threads, lp,
                                                          ("--no-repack",) if crash else ())
                    except BenchError as e:
                        c["tokens"] = None
                        notes.append(f"llama.cpp greedy tokens ({label}, {qt}): {e}")

                    def lrun(c=c, g=g, lp=lp, rp=rp):
                        read_through(g)         # the GGUF in the page cache (F32 is mmap'd, never repacked)
                        pp = llama_bench(llamacpp, g, threads, prompt_tokens, 0, 0, rp, log_path=lp,
                                         reps=LLAMA_REPS)
                        tg = llama_bench(llamacpp, g, threads, 0, new_tokens, prompt_tokens, rp, log_path=lp,
                                         reps=LLAMA_REPS)
                        c["prefill"].append(bench_rate(pp, prompt_tokens, 0))
                        c["decode"].append(bench_rate(tg, 0, new_tokens))
                    confs.append((c, lrun))
                if fmt == "f32":
                    src, opts = hf, {"dtype": "float32", "fetch": "resident"}
                    wl = "HF checkpoint resident, float32"
                else:
                    src = ensure_container(hf, mdir, fmt, dense, log)
                    opts = {"cache_cap": 1 << 20}
                    shown = dense
                    if dense == "auto":
                        with open(os.path.join(src, "manifest.json")) as f:
                            shown = (f"{json.load(f)['dense']['format']} (glm-jax-convert's default"
                                     + (", = the GGUF's bits)" if dense_formats is None else ")"))
                    wl = f"container: experts {fmt}, dense {shown}, every expert cached"
                opts.update(glmjax_options)
                c = dict(model=label, fmt=fmt, fmt_label=fl, engine="glm-jax", decode=[], prefill=[], weights=wl)
                cells.append(c)
                try:
                    # new_tokens + 1: glm-jax's first new token comes from the prefill forward, so this makes
                    # new_tokens decode forwards, like llama-bench's tg
                    w = Worker(sys.executable, dict(engine="glm-jax", model=src, options=opts, prompt=prompt,
                                                    new_tokens=new_tokens + 1, warm_tokens=new_tokens + 1),
                               threads, os.path.join(logs, "glm-jax.log"))
                    workers.append(w)
                    c["weights"] += f" (fetch {w.info.get('fetch')}, {w.info.get('dtype')})"

                    def grun(c=c, w=w):
                        r = w.run()
                        c["decode"].append(r["decode_tok_s"])
                        c["prefill"].append(r["prefill_tok_s"])
                        c.setdefault("tokens", r["tokens"])
                        if r["tokens"] != c["tokens"]:
                            c["varied"] = True
                        if r.get("hit_rate") is not None:
                            c["hit_rates"] = c.get("hit_rates", []) + [r["hit_rate"]]
                    confs.append((c, grun))
                except BenchError as e:
                    c["error"] = str(e)
                if fmt == "f32" and hf_py:
                    c = dict(model=label, fmt=fmt, fmt_label=fl, engine="transformers", decode=[], prefill=[],
                             weights="HF checkpoint, torch float32 eager")
                    cells.append(c)
                    try:
                        w = Worker(hf_py, dict(engine="transformers", model=hf, prompt=prompt, threads=threads,
                                               new_tokens=new_tokens + 1), threads,
                                   os.path.join(logs, "transformers.log"))
                        workers.append(w)

                        def trun(c=c, w=w):
                            r = w.run()
                            c["decode"].append(r["decode_tok_s"])
                            c["prefill"].append(r["prefill_tok_s"])
                            c.setdefault("tokens", r["tokens"])
                        confs.append((c, trun))
                    except BenchError as e:
                        c["error"] = str(e)
            # interleaved rounds; the order rotates so no configuration always runs first
            for r in range(reps):
                k = r % max(1, len(confs))
                for c, fn in confs[k:] + confs[:k]:
                    if c.get("error"):
                        continue
                    try:
                        fn()
                    except (BenchError, subprocess.TimeoutExpired) as e:
                        c["error"] = str(e)
                log(f"{label}: round {r + 1}/{reps} done")
        finally:
            for w in workers:
                w.close()
    # table order: per model and format, llama.cpp, glm-jax, transformers (cells are made in that order)
    uniq = cells
    for c in uniq:
        if c.get("hit_rates"):
            c["weights"] += f", hit rate {min(c['hit_rates']):.3g}"
        if c.get("varied"):
            notes.append(f"{c['model']} {c['fmt']} glm-jax: greedy tokens differed between reps")
    from tools.bench.tables import markdown
    tcol = f"same greedy tokens (first {n_cmp})"
    table = markdown(peer_rows(uniq, n_cmp), PEER_COLS + [tcol])
    head = (f"batch 1, greedy, prompt {prompt_tokens} tokens, {new_tokens} decode forwards per run (glm-jax: "
            f"{new_tokens + 1} new tokens, the first from the prefill; llama-bench: -p {prompt_tokens} -n 0 for "
            f"prefill and -p 0 -n {new_tokens} -d {prompt_tokens} for decode, -r {LLAMA_REPS} per round (the median "
            "of its samples), its own warmup; glm-jax the same: a 2-token warmup run, then "
            f"{LLAMA_REPS} runs per round, the median of each rate; transformers: one run per round), "
            f"{threads} threads (every process pinned to the same {threads} CPUs), median of {reps} interleaved "
            "rounds; every weight in RAM (glm-jax: warmed up, all experts cached; llama.cpp: mmap'd file in the page "
            "cache). Greedy tokens: each engine's first tokens after the same prompt ids vs llama.cpp's of the same "
            "format (llama-server /completion, temperature 0, top_k 1). glm-jax options: "
            f"{json.dumps(glmjax_options)}. {glm_jax_version()}; llama.cpp {llamacpp_version(llamacpp) if llamacpp else '-'}.")
    notes.append(f"load average (1 min) at the start / end: {load0:.2f} / {os.getloadavg()[0]:.2f} on "
                 f"{os.cpu_count()} CPUs (other work on the machine shares the cores)")
    return "\n\n".join([table, head] + notes)


# ----------------------------------------------------------------------------- --mode=lowram
def drop_caches(files: list) -> str:
    """Cold file cache: sync + drop_caches (root), then posix_fadvise(DONTNEED) on every file; '' or a note."""
    note = ""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        note = f"drop_caches failed ({e.strerror}); only posix_fadvise(DONTNEED) on the model files"
    from glm_jax.memory import evict_page_cache  # here, not at import: the workers stay stdlib-only

    evict_page_cache(files)
    return note


def files_under(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    out = []
    for dp, _, fs in os.walk(path):
        out += [os.path.join(dp, f) for f in fs]
    return out


def swap_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemCgroup:
    """One memory cgroup for one run: made, limited, joined by the child before exec, read, removed."""

    def __init__(self, cg: Cgroup, limit_bytes: int, tag: str):
        self.cg = cg
        self.dir = os.path.join(cg.parent, f"glm-jax-bench-{os.getpid()}-{tag}")
        self.memsw = False
        os.mkdir(self.dir)
        if cg.kind == "v1":
            self._w("memory.limit_in_bytes", limit_bytes)
            # memory + swap too, only where there is swap: on this kernel a memsw limit also stops memory.failcnt
            # from counting (measured), and without swap it limits nothing more
            if swap_total() > 0 and os.path.exists(os.path.join(self.dir, "memory.memsw.limit_in_bytes")):
                self._w("memory.memsw.limit_in_bytes", limit_bytes)
                self.memsw = True
        else:
            self._w("memory.max", limit_bytes)
            if os.path.exists(os.path.join(self.dir, "memory.swap.max")):
                self._w("memory.swap.max", 0)

    def _w(self, name, v):
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(str(v))

    def _r(self, name) -> str:
        try:
            with open(os.path.join(self.dir, name)) as f:
                return f.read()
        except OSError:
            return ""

    @property
    def procs(self) -> str:
        return os.path.join(self.dir, "cgroup.procs")

    def stats(self) -> dict:
        if self.cg.kind == "v1":
            oc = dict(ln.split() for ln in self._r("memory.oom_control").splitlines() if len(ln.split()) == 2)
            return dict(peak=int(self._r("memory.max_usage_in_bytes") or 0),
                        failcnt=max(int(self._r("memory.failcnt") or 0), int(self._r("memory.memsw.failcnt") or 0)),
                        oom_kills=int(oc.get("oom_kill", 0)))
        ev = dict(ln.split() for ln in self._r("memory.events").splitlines() if len(ln.split()) == 2)
        return dict(peak=int(self._r("memory.peak") or 0), failcnt=int(ev.get("max", 0)),
                    oom_kills=int(ev.get("oom_kill", 0)))

    def remove(self):
        for _ in range(50):
            try:
                os.rmdir(self.dir)
                return
            except OSError:
                time.sleep(0.1)


def run_in_cgroup(cmd: list, cg: Cgroup, limit_mb: float, threads: int, tag: str, log_path: str, timeout: float,
                  stdin_text: str = "") -> dict:
    """Run cmd in a fresh memory cgroup of limit_mb (MB = 1e6 bytes), pinned to `threads` CPUs. Returns rc (negative
    = signal), stdout, timed_out, the cgroup's peak / failcnt / oom kills, the child's peak RSS and bytes it read
    from storage (getrusage: ru_maxrss, ru_inblock)."""
    mc = MemCgroup(cg, int(limit_mb * 1e6), tag)
    try:
        with open(log_path, "a") as lf:
            lf.write(f"$ [cgroup {limit_mb:g} MB] " + " ".join(cmd) + "\n")
            lf.flush()
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=lf, text=True,
                                 env=thread_env(threads), start_new_session=True,
                                 preexec_fn=_preexec(pinned_cpus(threads), mc.procs))
            timed_out = [False]

            def kill():
                timed_out[0] = True
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                if stdin_text:
                    try:
                        p.stdin.write(stdin_text)
                        p.stdin.flush()
                    except BrokenPipeError:
                        pass
                try:
                    p.stdin.close()
                except BrokenPipeError:
                    pass
                out = p.stdout.read()
                _, status, ru = os.wait4(p.pid, 0)
            finally:
                timer.cancel()
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            p.returncode = rc
        return dict(rc=rc, stdout=out, timed_out=timed_out[0], maxrss_mb=ru.ru_maxrss / 1000.0,
                    read_bytes=ru.ru_inblock * 512, **mc.stats())
    finally:
        mc.remove()


def _worker_cmd() -> list:
    return [sys.executable, THIS_FILE, "worker"]


def measure_runtime_mb(container: str, prompt: list, threads: int, log_path: str, glmjax_options: dict) -> tuple:
    """RSS the engine's RAM budget does not count: peak RSS of one unconstrained run with --cache_cap=1
    --direct_io minus its own accounting (dense + KV + buffers + pinned + one expert per layer)."""
    opts = {"cache_cap": 1, "direct_io": True}
    opts.update(glmjax_options)
    w = Worker(sys.executable, dict(engine="glm-jax", model=container, options=opts, prompt=prompt, new_tokens=9,
                                    warm_tokens=2), threads, log_path)
    try:
        r = w.run()
    finally:
        w.close()
    sz = w.info.get("sizing") or {}
    accounted = (sz.get("dense_bytes", 0) + sz.get("kv_bytes", 0) + sz.get("buffer_bytes", 0) + sz.get("pin_bytes", 0)
                 + sz.get("per_cap_bytes", 0) * (w.info.get("cache_cap") or 1))
    return r["peak_rss_mb"] - accounted / 1e6, r["peak_rss_mb"], accounted / 1e6


def run_lowram(model: str, limits: list, llamacpp: str, workdir: str, threads: int, new_tokens: int,
               prompt_tokens: int, reps: int, glmjax_options: dict, dense_format: str, runtime_mb: float,
               margin_mb: float, timeout: float, log=print, proc_cgroup: Optional[str] = None) -> str:
    if proc_cgroup is None:
        with open("/proc/self/cgroup") as f:
            proc_cgroup = f.read()
    cg, why = detect_cgroup(proc_cgroup)
    if cg is None:
        return f"--mode=lowram skipped: {why}"
    load0 = os.getloadavg()[0]
    if llamacpp:
        llamacpp_paths(llamacpp)
    pinned_cpus(threads)
    os.makedirs(workdir, exist_ok=True)
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    hf = resolve_model(model, workdir, log)
    mdir = model_workdir(workdir, hf)
    container = ensure_container(hf, mdir, "int4_g64", dense_format, log)
    gguf = ensure_gguf(hf, mdir, "Q4_0", llamacpp, log, keep_f32=False) if llamacpp else None
    cont_mb = sum(os.path.getsize(p) for p in files_under(container)) / 1e6
    gguf_mb = os.path.getsize(gguf) / 1e6 if gguf else 0.0
    prompt = prompt_ids(hf, prompt_tokens)
    notes = []
    if runtime_mb < 0:
        rt_note = ("glm-jax is given no --ram_gb: its default budget is 0.9 x the memory cgroup's limit, and that "
                   "budget covers the whole process (runtime, dense weights, KV, compile workspace, expert cache)")
    elif runtime_mb == 0:
        log("measuring glm-jax's runtime RSS (unconstrained, --cache_cap=1)")
        runtime_mb, peak, acc = measure_runtime_mb(container, prompt, threads, os.path.join(logs, "lowram-glm-jax.log"),
                                                   glmjax_options)
        rt_note = (f"runtime {runtime_mb:.0f} MB measured in this run (peak RSS {peak:.0f} MB with --cache_cap=1 "
                   f"minus the engine's own accounting {acc:.0f} MB)")
    else:
        rt_note = f"runtime {runtime_mb:.0f} MB (--runtime_mb)"
    engines = []
    if llamacpp:
        engines += [("llama0", "llama.cpp Q4_0 (mmap, --repack 0)"), ("llama1", "llama.cpp Q4_0 (mmap, repack)")]
    engines += [("glmjax", "glm-jax int4_g64")]
    cells = {}
    run_no = 0
    for r in range(reps):
        for L in limits:
            for key, label in engines:
                run_no += 1
                files = files_under(container) if key == "glmjax" else [gguf]
                dn = drop_caches(files)
                if dn and dn not in notes:
                    notes.append(dn)
                c = cells.setdefault((L, key), {"tok_s": [], "verdict": "ok", "note": ""})
                if key == "glmjax":
                    opts = {}           # no flags: the engine fits itself to the limit (glm_jax/fit.py)
                    if runtime_mb >= 0:
                        opts["ram_gb"] = ram_gb_for_limit(L, runtime_mb, margin_mb)
                    opts.update(glmjax_options)
                    c["flags"] = " ".join(f"--{k}={v}" if v is not True else f"--{k}"
                                          for k, v in opts.items()) or "(none)"
                    spec = dict(engine="glm-jax", model=container, options=opts, prompt=prompt,
                                new_tokens=new_tokens + 1, warm_tokens=2)
                    res = run_in_cgroup(_worker_cmd(), cg, L, threads, f"{run_no}", os.path.join(
                        logs, "lowram-glm-jax.log"), timeout, json.dumps(spec) + "\nrun\nquit\n")
                    out, err, started = worker_result(res)
                    tok_s = out["decode_tok_s"] if out else None
                    if out:
                        extra = f"hit rate {out.get('hit_rate', 0):.2f}, cache {out.get('cache_cap')}/layer"
                    else:
                        extra = ""
                else:
                    rp = "0" if key == "llama0" else "1"
                    cmd = [os.path.join(llamacpp, "bin", "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "0",
                           "-n", str(new_tokens), "-d", str(prompt_tokens), "-r", "1", "-o", "jsonl",
                           "-lm", "mmap", "--repack", rp]
                    res = run_in_cgroup(cmd, cg, L, threads, f"{run_no}", os.path.join(logs, "lowram-llamacpp.log"),
                                        timeout)
                    err, tok_s, extra, started = "", None, "", False
                    try:
                        tok_s = bench_rate(parse_llama_bench(res["stdout"]), 0, new_tokens) if res["rc"] == 0 else None
                    except (BenchError, ValueError) as e:
                        err = str(e)
                    if res["rc"] not in (0, None) and res["rc"] > 0:
                        err = tail(os.path.join(logs, "lowram-llamacpp.log"))
                verdict = classify_run(res["rc"], res["timed_out"], res["oom_kills"], err, started)
                if verdict == "ok" and tok_s is None:
                    verdict = "cannot start: no tok/s reported"
                model_mb = cont_mb if key == "glmjax" else gguf_mb
                facts = [f"peak {res['peak'] / 1e6:.0f} MB", f"read {res['read_bytes'] / 1e9:.2f} GB"
                         f" ({res['read_bytes'] / 1e6 / model_mb:.2f}x the model)"]
                if res["failcnt"]:
                    facts.append(f"failcnt {res['failcnt']}")
                if verdict == "ok" and res["read_bytes"] / 1e6 > 1.5 * model_mb:
                    facts.insert(0, "thrashing")
                if extra:
                    facts.append(extra)
                if verdict != "ok":
                    facts.insert(0, verdict)
                if verdict == "ok":
                    c["tok_s"].append(tok_s)
                else:
                    c["verdict"] = verdict
                c["note"] = ", ".join(facts)
                log(f"{L:g} MB {label}: {tok_s if tok_s is not None else verdict} ({c['note']})")
    notes.append(f"load average (1 min) at the start / end: {load0:.2f} / {os.getloadavg()[0]:.2f} on "
                 f"{os.cpu_count()} CPUs (other work on the machine shares the cores)")
    from tools.bench.tables import markdown
    rows = lowram_rows(cells, limits, engines)
    cols = ["memory limit"] + [lbl for _, lbl in engines] + ["glm-jax flags", "notes"]
    head = (f"decode tok/s, {new_tokens} tokens after a {prompt_tokens}-token prompt (llama-bench -p 0 -n {new_tokens} "
            f"-d {prompt_tokens} -r 1 with its warmup; glm-jax: a 2-token warmup generation, then {new_tokens + 1} "
            f"new tokens), {threads} threads, batch 1, greedy; median of {reps}; each run a fresh process in a fresh "
            f"memory cgroup ({cg.kind}, limit = {'memory.limit_in_bytes' if cg.kind == 'v1' else 'memory.max'}"
            f"{' (+ memsw / swap.max: there is swap)' if swap_total() else ' (no swap on this machine)'}, MB = "
            "1e6 bytes; page cache is charged too), file cache dropped before every run (sync + drop_caches + "
            f"posix_fadvise DONTNEED). Model {hf}: glm-jax container {cont_mb:.0f} MB (int4_g64 experts, dense "
            f"{dense_format}), GGUF Q4_0 {gguf_mb:.0f} MB. "
            + (f"glm-jax --ram_gb = (limit - runtime - {margin_mb:g} MB margin) / 1000, " if runtime_mb >= 0 else "")
            + f"{rt_note}. Notes: peak = the cgroup's max usage; read = bytes the process read from "
            "storage (getrusage ru_inblock: model, libraries and code pages, re-reads included); 'thrashing' = it "
            "read more than 1.5x its model file; failcnt = times the cgroup hit its limit.")
    return "\n\n".join([markdown(rows, cols), head] + notes)


# ----------------------------------------------------------------------------- the worker
def _emit(obj):
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _vmhwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return 0.0


def _serve(one):
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "run":
            _emit(one())
        elif cmd == "quit":
            break


def cold_generate(eng, prompt, max_new_tokens: int):
    """eng.generate with a cold prefill, as llama-bench's: the scheduler's prefix cache would otherwise find the
    prompt's K/V from the previous run still in its row and prefill one token (every glm-jax prefill rate the benches
    printed from f742171, 2026-12-01 09:37, until that was fixed)."""
    eng.scheduler.forget()
    r = eng.generate(prompt, max_new_tokens=max_new_tokens, stop_on_eos=False)
    if r.stats.get("cached_tokens", 0):
        raise BenchError(f"the prefill reused {r.stats['cached_tokens']} cached prompt tokens")
    return r


def _glmjax_worker(spec: dict):
    import glm_jax
    prompt, n = spec["prompt"], spec["new_tokens"]
    eng = glm_jax.Engine.load(spec["model"], **spec.get("options", {}))
    if spec.get("warm_tokens"):
        eng.generate(prompt, max_new_tokens=spec["warm_tokens"], stop_on_eos=False)
    st = eng.store
    _emit({"ready": True, "dtype": str(getattr(eng.dtype, "name", eng.dtype)), "fetch": eng.opts["fetch"],
           "sizing": getattr(st, "sizing", None), "cache_cap": getattr(st, "cache_cap", None)})

    def one():
        # like llama-bench in the same round: a warmup run, then LLAMA_REPS runs, the median of each rate
        # (a single run right after the other engines' turns measures this process's caches refilling)
        cold_generate(eng, prompt, 2)
        rs = [cold_generate(eng, prompt, n) for _ in range(LLAMA_REPS)]
        dec = sorted(x.stats["decode_tok_s"] for x in rs)
        pre = sorted(x.stats["prefill_tokens"] / max(x.stats["prefill_s"], 1e-9) for x in rs)
        r, s = rs[-1], rs[-1].stats
        return {"decode_tok_s": dec[len(dec) // 2], "prefill_tok_s": pre[len(pre) // 2],
                "tokens": r.tokens, "hit_rate": s.get("hit_rate"), "cache_cap": getattr(st, "cache_cap", None),
                "peak_rss_mb": _vmhwm_mb(), "decode_tokens": s.get("decode_tokens", n - 1),
                "store": {k: s[k] for k in STORE_KEYS if k in s}}
    _serve(one)
    eng.close()


def _hf_worker(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(int(spec["threads"]))
    m = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    prompt, n = spec["prompt"], spec["new_tokens"]
    ids = torch.tensor([prompt])

    def gen(k):
        t = time.perf_counter()
        with torch.no_grad():
            out = m.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        return time.perf_counter() - t, out[0, len(prompt):].tolist()

    gen(4)
    _emit({"ready": True})

    def one():
        t1, _ = gen(1)          # prefill + one sample
        tn, toks = gen(n)
        return {"decode_tok_s": (n - 1) / max(tn - t1, 1e-9), "prefill_tok_s": len(prompt) / t1, "tokens": toks}
    _serve(one)


def worker_main():
    spec = json.loads(sys.stdin.readline())
    try:
        if spec["engine"] == "transformers":
            _hf_worker(spec)
        else:
            _glmjax_worker(spec)
    except Exception as e:      # one line back to the parent; the traceback goes to the log (stderr)
        import traceback
        traceback.print_exc()
        _emit({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})
        sys.exit(3)


# ----------------------------------------------------------------------------- model makers (CLI)
def main(argv):
    from absl import flags
    F = flags.FLAGS
    if len(argv) > 1:
        print(f"bench_peer: error: unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    if not (F.make_b or F.make_stream):
        print("bench_peer: error: give --make_b=DIR and/or --make_stream=DIR (the benches run from tools.bench "
              "--mode=peer|lowram)", file=sys.stderr)
        return 2
    if F.make_b:
        make_model(F.make_b, b_config())
    if F.make_stream:
        make_model(F.make_stream, stream_config(), zipf=1.1)
    return 0


def run():
    from absl import app, flags
    flags.DEFINE_string("make_b", "", "Write the b-shaped random checkpoint (H 1024, 32 experts of I 1024, top-8, "
                        "4 layers, first dense, 335 M parameters, the shipped tokenizer) to this directory.")
    flags.DEFINE_string("make_stream", "", "Write the low-RAM table's random checkpoint (H 1024, 8 MoE layers x 64 "
                        "experts of I 2048, top-8, skewed popularity, the shipped tokenizer) to this directory.")
    app.run(main)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        # run as a script: tools/ is sys.path[0], and its module names (tables, evaluate, ...) must not shadow
        # third-party packages in the worker
        if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(THIS_FILE):
            sys.path.pop(0)
        worker_main()
    else:
        run()

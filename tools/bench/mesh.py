"""Benchmarks of the NNX model and the device mesh (never timed tests; every table has its baseline from the same run).

    python -m tools.bench.mesh --mode=nnx [--models=shipped,b] [--reps=5] [--new_tokens=128]
        single-device decode tok/s of this tree (NNX model, jit over split state) against the code before it
        (--base_rev, extracted with git archive into a temp dir), each in its own long-lived process, interleaved
        rounds, medians; same greedy tokens checked.
    python -m tools.bench.mesh --mode=mesh [--model=shipped] [--devices=8]
        per mesh shape on simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count, set for the
        worker process only): decode and prefill tok/s, bytes per device (dense weights, experts, KV cache), the
        max |dlogit| to one device and whether the greedy tokens are the same.  The devices share this machine's
        CPUs: the figures that mean something are the bytes and the correctness, not the speed.
    python -m tools.bench.mesh --mode=comm [--model=shipped]
        the MoE seam's two mesh communication schemes (psum = all-gather + psum, all_to_all), decode and prefill
        tok/s on the simulated devices, same run, interleaved.
    python -m tools.bench.mesh --mode=orbax [--model=b]
        orbax-checkpoint against what glm-jax does without it: restoring the dense weights (the loader reading
        safetensors and packing vs an orbax restore of the packed state) and a KV-cache snapshot (save + restore)
        vs numpy files.  Needs orbax-checkpoint (pip install -e '.[bench]').

Models: ``shipped`` (the embedded default model: a container, experts preloaded, resident), ``b`` (the b-shaped
333 M glm4_moe HF checkpoint made by tools.bench.peer in --workdir), ``golden`` (tests/golden/glm4moe_full)
or a directory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from tools.bench.tables import markdown

FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))

flags.DEFINE_enum("mode", "nnx", ["nnx", "mesh", "comm", "orbax"], "Which benchmark.")
flags.DEFINE_string("models", "shipped,b", "--mode=nnx: models (comma-separated).")
flags.DEFINE_string("model", "shipped", "--mode=mesh|comm|orbax: the model.")
flags.DEFINE_string("base_rev", "22e9be6", "--mode=nnx: the git revision to compare against (before the NNX model).")
flags.DEFINE_integer("reps", 5, "Interleaved repetitions (medians).")
flags.DEFINE_integer("new_tokens", 128, "Tokens to decode per run.")
flags.DEFINE_integer("prompt_tokens", 64, "--mode=mesh|comm: prompt length (prefill tok/s).")
flags.DEFINE_integer("devices", 8, "--mode=mesh|comm: simulated CPU devices.")
flags.DEFINE_string("shapes", "expert:1,model:1;expert:2,model:1;expert:4,model:2;expert:8,model:1;expert:1,model:8",
                    "--mode=mesh: mesh shapes, ';'-separated.")
flags.DEFINE_string("workdir", os.path.join(os.path.expanduser("~"), ".cache", "glm-jax-bench"),
                    "Where the b model lives (bench_peer --make_b).")
flags.DEFINE_string("worker", "", "internal: run as a worker process (JSON commands on stdin).")


def model_path(name: str) -> str:
    if name == "shipped":
        from glm_jax.engine import default_model_path

        return default_model_path()
    if name == "golden":
        return os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "golden", "glm4moe_full")
    if name == "b":
        p = os.path.join(FLAGS.workdir, "models", "b", "hf")
        if not os.path.exists(os.path.join(p, "config.json")):
            from tools.bench import peer as bench_peer

            bench_peer.make_model(p, bench_peer.b_config())
        return p
    return os.path.abspath(name)


# ----------------------------------------------------------------------------- worker processes
class Worker:
    """A long-lived process answering JSON commands (one per line) with one JSON line."""

    def __init__(self, env_extra: dict = None, pythonpath: str = ""):
        env = dict(os.environ, **(env_extra or {}))
        root = os.path.dirname(os.path.dirname(HERE))          # the repo root: `-m tools.bench.mesh` from anywhere
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, root, env.get("PYTHONPATH", "")) if p)
        self.p = subprocess.Popen([sys.executable, "-m", "tools.bench.mesh", "--worker=1"], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())

    def __call__(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker died (exit {self.p.wait()})")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError("bench worker: " + out["error"])
        return out

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(timeout=60)
        except Exception:       # noqa: BLE001
            self.p.kill()


def worker_main():
    import traceback

    import numpy as np

    engines = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            out = _worker_op(cmd, engines, np)
        except Exception as e:      # noqa: BLE001
            out = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def _worker_op(cmd, engines, np):
    import jax

    import glm_jax

    op = cmd["op"]
    if op == "info":
        return {"glm_jax": glm_jax.__file__, "devices": len(jax.devices())}
    if op == "load":
        t = time.perf_counter()
        engines[cmd["key"]] = glm_jax.Engine.load(cmd["path"], **cmd.get("options", {}))
        return {"load_s": time.perf_counter() - t}
    eng = engines[cmd["key"]]
    if op == "generate":
        r = eng.generate(cmd["prompt"], max_new_tokens=cmd["n"], stop_on_eos=False)
        return {"tokens": r.tokens, "decode_tok_s": r.stats["decode_tok_s"], "prefill_s": r.stats["prefill_s"],
                "prefill_tokens": r.stats["prefill_tokens"]}
    if op == "forwards":        # one host dispatch per token (the MTP / n-gram / streaming paths): forwards/s
        eng._ensure_cache(1, cmd["n"] + 8)
        tok = np.zeros((1, 4), np.int32)
        one = np.ones(1, np.int32)
        eng.forward(tok, np.zeros(1, np.int32), one)
        t = time.perf_counter()
        for p in range(cmd["n"]):
            lg, _ = eng.forward(tok, np.array([p], np.int32), one)
        np.asarray(lg)
        return {"forwards_s": cmd["n"] / (time.perf_counter() - t)}
    if op == "prefill":         # prefill tok/s: a forward of the prompt (compiled by a first call)
        ids = cmd["prompt"]
        eng.logits(ids)
        t = time.perf_counter()
        for _ in range(cmd.get("n", 3)):
            eng.logits(ids)
        return {"prefill_tok_s": len(ids) * cmd.get("n", 3) / (time.perf_counter() - t)}
    if op == "logits":
        return {"logits": np.asarray(eng.logits(cmd["prompt"]), np.float32).tolist()}
    if op == "bytes":
        from glm_jax.runtime import mesh as MESH

        view = eng.step_params()
        params = view.params() if hasattr(view, "params") else view
        experts = [lp.get("experts") for lp in params["layers"]]
        if params.get("mtp") is not None:
            experts.append(params["mtp"]["layer"].get("experts"))
        dense = {k: v for k, v in params.items() if k != "layers"}
        dense["layers"] = [{k: v for k, v in lp.items() if k != "experts"} for lp in params["layers"]]
        if dense.get("mtp") is not None:
            dense["mtp"] = dict(dense["mtp"], layer={k: v for k, v in dense["mtp"]["layer"].items() if k != "experts"})
        eng._ensure_cache(1, cmd.get("tokens", 4096))
        per = lambda t: max(MESH.device_bytes(t).values() or [0])            # noqa: E731
        return {"dense": per(dense), "experts": per([e for e in experts if e is not None]), "kv": per(eng._cache),
                "devices": len(MESH.device_bytes(params))}
    if op == "close":
        eng.close()
        del engines[cmd["key"]]
        return {}
    raise ValueError(f"unknown op {op}")


# ----------------------------------------------------------------------------- --mode=nnx
def _base_tree(rev: str) -> str:
    """glm_jax and glm_jax_plugins of ``rev`` (git archive) in a temp dir, importable by PYTHONPATH."""
    root = os.path.dirname(os.path.dirname(HERE))
    d = tempfile.mkdtemp(prefix="glm-jax-base-")
    tar = subprocess.run(["git", "-C", root, "archive", rev, "glm_jax", "plugins"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", d], input=tar.stdout, check=True)
    os.rename(os.path.join(d, "plugins"), os.path.join(d, "glm_jax_plugins"))
    return d


def bench_nnx():
    base = _base_tree(FLAGS.base_rev)
    sides = {f"before ({FLAGS.base_rev})": Worker(pythonpath=base), "after (NNX, this tree)": Worker()}
    infos = {k: w(op="info")["glm_jax"] for k, w in sides.items()}
    assert infos[next(iter(sides))].startswith(base), infos
    rows = []
    prompt = list(range(3, 19))
    for name in FLAGS.models.split(","):
        path = model_path(name)
        toks, tps, fps = {}, {k: [] for k in sides}, {k: [] for k in sides}
        for k, w in sides.items():
            w(op="load", key=name, path=path, options={"dtype": "float32"})
            toks[k] = w(op="generate", key=name, prompt=prompt, n=FLAGS.new_tokens)["tokens"]      # compile
        for _ in range(FLAGS.reps):
            for k, w in sides.items():
                tps[k].append(w(op="generate", key=name, prompt=prompt, n=FLAGS.new_tokens)["decode_tok_s"])
                fps[k].append(w(op="forwards", key=name, n=FLAGS.new_tokens)["forwards_s"])
        same = len({tuple(t) for t in toks.values()}) == 1
        b = statistics.median(tps[next(iter(sides))])
        bf = statistics.median(fps[next(iter(sides))])
        for k in sides:
            m, f = statistics.median(tps[k]), statistics.median(fps[k])
            rows.append({"model": name, "code": k, "decode tok/s": m, "vs before": m / b,
                         "range": f"{min(tps[k]):.0f}-{max(tps[k]):.0f}", "forwards/s (1 per dispatch)": f,
                         "forwards vs before": f / bf, "same greedy tokens": same})
        for w in sides.values():
            w(op="close", key=name)
    for w in sides.values():
        w.close()
    return (markdown(rows, ["model", "code", "decode tok/s", "vs before", "range", "forwards/s (1 per dispatch)",
                            "forwards vs before", "same greedy tokens"])
            + f"\n\none device, float32, {FLAGS.new_tokens} greedy tokens after a {len(prompt)}-token prompt (decode: "
              f"the fused loop, 32 tokens per dispatch; forwards/s: Engine.forward of one token at the decode width, "
              f"one host dispatch each, as MTP / n-gram drafting and the streaming loop do), median of {FLAGS.reps} "
              f"interleaved reps, each side in its own process, {os.cpu_count()} CPUs")


# ----------------------------------------------------------------------------- --mode=mesh / comm
def _sim_worker():
    return Worker({"XLA_FLAGS": f"--xla_force_host_platform_device_count={FLAGS.devices}"})


def bench_mesh():
    import numpy as np

    path = model_path(FLAGS.model)
    w = _sim_worker()
    prompt = [3 + (i * 7) % 200 for i in range(FLAGS.prompt_tokens)]
    rows, ref_lg, ref_tok = [], None, None
    for shape in FLAGS.shapes.split(";"):
        w(op="load", key=shape, path=path, options={"dtype": "float32", "mesh": shape})
        lg = np.asarray(w(op="logits", key=shape, prompt=prompt[:16])["logits"], np.float32)
        g = w(op="generate", key=shape, prompt=prompt, n=FLAGS.new_tokens)          # compile
        dec = [w(op="generate", key=shape, prompt=prompt, n=FLAGS.new_tokens)["decode_tok_s"]
               for _ in range(FLAGS.reps)]
        pre = w(op="prefill", key=shape, prompt=prompt, n=FLAGS.reps)["prefill_tok_s"]
        by = w(op="bytes", key=shape)
        if ref_lg is None:
            ref_lg, ref_tok = lg, g["tokens"]
        rows.append({"mesh": shape, "devices": by["devices"], "decode tok/s": statistics.median(dec),
                     "prefill tok/s": pre, "dense MB/device": by["dense"] / 1e6,
                     "experts MB/device": by["experts"] / 1e6, "KV MB/device (4096 tok)": by["kv"] / 1e6,
                     "max dlogit vs 1": float(np.abs(lg - ref_lg).max()), "same greedy": g["tokens"] == ref_tok})
        w(op="close", key=shape)
    w.close()
    cols = ["mesh", "devices", "decode tok/s", "prefill tok/s", "dense MB/device", "experts MB/device",
            "KV MB/device (4096 tok)", "max dlogit vs 1", "same greedy"]
    return (markdown(rows, cols) + f"\n\nmodel {FLAGS.model} ({path}), float32, {FLAGS.devices} simulated CPU devices "
            f"sharing {os.cpu_count()} CPUs (speed is not the point here), {FLAGS.prompt_tokens}-token prompt, "
            f"{FLAGS.new_tokens} greedy tokens, medians of {FLAGS.reps}; the first row (one device) is the reference")


def bench_comm():
    path = model_path(FLAGS.model)
    w = _sim_worker()
    prompt = [3 + (i * 7) % 200 for i in range(FLAGS.prompt_tokens)]
    rows = []
    for shape in ("expert:8,model:1", "expert:4,model:2"):
        keys = {c: f"{shape}/{c}" for c in ("psum", "all_to_all")}
        toks = {}
        for c, k in keys.items():
            w(op="load", key=k, path=path, options={"dtype": "float32", "mesh": shape, "expert_comm": c})
            toks[c] = w(op="generate", key=k, prompt=prompt, n=FLAGS.new_tokens)["tokens"]
            w(op="prefill", key=k, prompt=prompt, n=1)
        dec, pre = {c: [] for c in keys}, {c: [] for c in keys}
        for _ in range(FLAGS.reps):
            for c, k in keys.items():
                dec[c].append(w(op="generate", key=k, prompt=prompt, n=FLAGS.new_tokens)["decode_tok_s"])
                pre[c].append(w(op="prefill", key=k, prompt=prompt, n=2)["prefill_tok_s"])
        for c, k in keys.items():
            rows.append({"mesh": shape, "expert_comm": c, "decode tok/s": statistics.median(dec[c]),
                         "prefill tok/s": statistics.median(pre[c]),
                         "decode vs psum": statistics.median(dec[c]) / statistics.median(dec["psum"]),
                         "prefill vs psum": statistics.median(pre[c]) / statistics.median(pre["psum"]),
                         "same greedy": toks[c] == toks["psum"]})
            w(op="close", key=k)
    w.close()
    cols = ["mesh", "expert_comm", "decode tok/s", "prefill tok/s", "decode vs psum", "prefill vs psum", "same greedy"]
    return (markdown(rows, cols) + f"\n\nmodel {FLAGS.model}, {FLAGS.devices} simulated CPU devices on "
            f"{os.cpu_count()} CPUs, {FLAGS.prompt_tokens}-token prompt, {FLAGS.new_tokens} greedy tokens, medians "
            f"of {FLAGS.reps} interleaved reps")


# ----------------------------------------------------------------------------- --mode=orbax
def bench_orbax():
    import shutil

    import jax
    import numpy as np

    import glm_jax
    from glm_jax import model as M
    from glm_jax.experts import weights as W

    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return "orbax-checkpoint is not installed (pip install -e '.[bench]'): nothing to compare"
    path = model_path(FLAGS.model)
    eng = glm_jax.Engine.load(path, dtype="float32")
    cfg = eng.cfg
    from flax import nnx

    dense = nnx.state(eng.model)        # every Param: the packed dense weights (and resident experts)
    pure = jax.tree.map(lambda a: a, nnx.to_pure_dict(dense))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(pure))
    tmp = tempfile.mkdtemp(prefix="glm-jax-orbax-")
    ck = ocp.StandardCheckpointer()
    target = os.path.join(tmp, "state")

    def t(f, reps=FLAGS.reps):
        out = []
        for _ in range(reps):
            s = time.perf_counter()
            f()
            out.append(time.perf_counter() - s)
        return statistics.median(out)

    def save_orbax():
        if os.path.exists(target):
            shutil.rmtree(target)
        ck.save(target, pure)
        ck.wait_until_finished()

    def restore_orbax():
        r = ck.restore(target, jax.tree.map(ocp.utils.to_shape_dtype_struct, pure))
        jax.block_until_ready(r)

    def load_glmjax():
        p = W.load_params(path, cfg, dtype=eng.dtype, expert_fmt=eng.opts["expert_format"], kernel=eng.kernel,
                          dense_fmt=eng.opts["dense_format"]) if eng.store is None else \
            W.load_dense_params(path, cfg, dtype=eng.dtype, kernel=eng.kernel, dense_fmt=eng.opts["dense_format"])
        jax.block_until_ready(p)

    save_s = t(save_orbax, 1)
    rows = [{"what": "weights: glm-jax loader (safetensors -> pack -> device)", "MB": nbytes / 1e6,
             "seconds": t(load_glmjax)},
            {"what": "weights: orbax restore of the packed state", "MB": nbytes / 1e6, "seconds": t(restore_orbax)},
            {"what": "weights: orbax save (once)", "MB": nbytes / 1e6, "seconds": save_s}]
    cache = M.init_cache(cfg, 1, 4096, eng.kv_dtype, with_mtp=eng.params.get("mtp") is not None)
    cache = jax.tree.map(lambda a: a + 1, cache)
    kv_mb = sum(a.nbytes for a in jax.tree.leaves(cache)) / 1e6
    kv_dir = os.path.join(tmp, "kv")
    npz = os.path.join(tmp, "kv.npz")

    def kv_orbax():
        if os.path.exists(kv_dir):
            shutil.rmtree(kv_dir)
        ck.save(kv_dir, cache)
        ck.wait_until_finished()
        jax.block_until_ready(ck.restore(kv_dir, jax.tree.map(ocp.utils.to_shape_dtype_struct, cache)))

    def kv_numpy():
        leaves, tdef = jax.tree.flatten(cache)
        np.savez(npz, *[np.asarray(a) for a in leaves])
        with np.load(npz) as z:
            back = jax.tree.unflatten(tdef, [jax.device_put(z[f"arr_{i}"]) for i in range(len(leaves))])
        jax.block_until_ready(back)

    rows += [{"what": "KV snapshot save+restore: orbax", "MB": kv_mb, "seconds": t(kv_orbax)},
             {"what": "KV snapshot save+restore: numpy .npz", "MB": kv_mb, "seconds": t(kv_numpy)}]
    shutil.rmtree(tmp, ignore_errors=True)
    eng.close()
    return (markdown(rows, ["what", "MB", "seconds"]) + f"\n\nmodel {FLAGS.model} ({path}), one device, medians of "
            f"{FLAGS.reps}; the KV cache: 4096 positions, every layer; page cache warm")


def main(argv):
    if FLAGS.worker:
        worker_main()
        return
    print({"nnx": bench_nnx, "mesh": bench_mesh, "comm": bench_comm, "orbax": bench_orbax}[FLAGS.mode]())


if __name__ == "__main__":
    app.run(main)

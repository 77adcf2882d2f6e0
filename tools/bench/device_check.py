"""The accelerator check behind tools/device_check.sh: peer-free benches on whatever jax.devices() is, one table.

    python -m tools.bench.device_check [--parity_log=FILE] [--budget_s=200]

Rows: the device; golden parity (the summary line of the pytest run the shell script made, passed in as a log);
resident decode tok/s (the shipped model, a synthetic mid-size glm4_moe checkpoint made in a temp dir); the MoE
seam's throughput (``model.moe_routed`` on a bf16 and an int4_g64 bank of 64 experts of 2048 x 1024: GMAC/s at a
decode-sized and a prefill-sized batch); streaming experts from host RAM (an expert store over a converted
container whose files sit in the page cache: every fetch a miss, GB/s of records landed on the device); a mesh
over every local device when there are several.  Each bench has a time box; a bench that fails prints its error in
its row instead of stopping the table.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time

from absl import app, flags

from tools.bench.tables import markdown

FLAGS = flags.FLAGS
flags.DEFINE_string("parity_log", "", "The pytest log of the golden parity run (its summary line goes in the table).")
flags.DEFINE_float("budget_s", 200.0, "Stop starting new benches after this many seconds.")
flags.DEFINE_integer("new_tokens", 128, "Decode tokens per run.")

ROWS: list = []


def row(check, value, unit="", note=""):
    ROWS.append({"check": check, "value": value, "unit": unit, "note": note})
    print(f"  {check}: {value} {unit} {note}", flush=True)


def _bench(name, fn, t0):
    if time.perf_counter() - t0 > FLAGS.budget_s:
        row(name, "skipped", "", f"time box of {FLAGS.budget_s:.0f} s reached")
        return
    try:
        fn()
    except Exception as e:          # noqa: BLE001  (one row says what went wrong; the table still prints)
        row(name, "error", "", " ".join(f"{type(e).__name__}: {e}".split())[:200])


def device_row():
    import jax

    d = jax.devices()
    row("device", f"{len(d)} x {d[0].device_kind}", "", f"backend {jax.default_backend()}, jax {jax.__version__}")


def parity_row():
    if not FLAGS.parity_log or not os.path.exists(FLAGS.parity_log):
        row("golden parity (pytest)", "not run")
        return
    text = open(FLAGS.parity_log).read()
    m = re.findall(r"(\d+ (?:passed|failed|error)[^\n]*?) in ([\d.]+)s", text)
    row("golden parity (pytest)", m[-1][0] if m else "no summary", "", f"{m[-1][1]} s" if m else text[-200:])


def _decode(path, label, reps=3, **opts):
    import glm_jax

    eng = glm_jax.Engine.load(path, **opts)
    prompt = list(range(3, 19))
    t = time.perf_counter()
    eng.generate(prompt, max_new_tokens=FLAGS.new_tokens, stop_on_eos=False)           # compile
    c = time.perf_counter() - t
    tps = [eng.generate(prompt, max_new_tokens=FLAGS.new_tokens, stop_on_eos=False).stats["decode_tok_s"]
           for _ in range(reps)]
    r = eng.generate(prompt, max_new_tokens=4, stop_on_eos=False)
    row(f"resident decode: {label}", round(statistics.median(tps), 1), "tok/s",
        f"median of {reps}, {FLAGS.new_tokens} tokens, {r.stats['dtype']}, {r.stats['kernels']} kernels, "
        f"first run (compile) {c:.1f} s")
    eng.close()


def synth_dir(tmp):
    """A mid-size glm4_moe checkpoint (H 1024, 32 experts of I 512, top-8, 4 layers; bf16, 0.3 GB) and its int4
    container."""
    from glm_jax.experts.convert import convert
    from tools.fixtures import synth_model as SM

    hf = os.path.join(tmp, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        c = SM.bench_config(hidden=1024, moe_inter=512, experts=32, layers=4, top_k=8, vocab=4096)
        SM.write_hf_checkpoint(hf, c, seed=0, dtype="bfloat16", keep_reference=False)
    cont = os.path.join(tmp, "int4")
    if not os.path.exists(os.path.join(cont, "manifest.json")):
        convert(hf, cont, expert_format="int4_g64", dense_format="bf16", progress=False)
    return hf, cont


def seam_rows():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from glm_jax import model as M
    from glm_jax.kernels import formats as quant

    E, H, I, K = 64, 2048, 1024, 8
    rng = np.random.default_rng(0)
    gu = (rng.standard_normal((E, 2 * I, H), np.float32) * 0.02)
    dn = (rng.standard_normal((E, H, I), np.float32) * 0.02)
    kern = "native" if jax.default_backend() == "cpu" else "xla"
    for fmt in ("bf16", "int4_g64"):
        bank = jax.device_put(quant.bank_from_float(gu, dn, fmt, kern))
        f = jax.jit(M.moe_routed)
        for T in (1, 256):
            x = jnp.asarray(rng.standard_normal((T, H), np.float32))
            ids = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32)
            w = jnp.full((T, K), 1.0 / K, jnp.float32)
            v = jnp.ones((T, K), bool)
            f(x, ids, w, v, bank).block_until_ready()
            n = 20 if T == 1 else 5
            t = time.perf_counter()
            for _ in range(n):
                y = f(x, ids, w, v, bank)
            y.block_until_ready()
            dt = (time.perf_counter() - t) / n
            row(f"expert seam {fmt}, T={T}", round(T * K * 3 * H * I / dt / 1e9, 1), "GMAC/s",
                f"{E} experts {H}x{I}, top-{K}, {kern} kernels, {dt * 1e3:.2f} ms/call")
    del gu, dn


def stream_row(cont):
    import jax
    import numpy as np

    import glm_jax
    from glm_jax.experts import store as S

    cfg = glm_jax.load_config(cont)
    st = S.ExpertStore.open(cont, cfg, cache_cap=8, io_threads=8, ram_gb=64, state_dir="off")
    try:
        for L in st.layers:                       # the files into the page cache
            for e in range(cfg.n_routed_experts):
                st.fetch(L, [e])
        st.drop_cache(page_cache=False)
        st.reset_stats()
        rng = np.random.default_rng(0)
        t = time.perf_counter()
        n = 0
        while time.perf_counter() - t < 5.0:
            for L in st.layers:
                union = rng.choice(cfg.n_routed_experts, 8, replace=False)
                bank, _ = st.fetch(L, union)
                jax.block_until_ready(bank.gate_up)
                st.drop_cache(page_cache=False)
                n += 1
        dt = time.perf_counter() - t
        s = st.stats()
        row("experts from host RAM to the device", round(s["bytes_read"] / dt / 1e9, 2), "GB/s",
            f"{s['expert_loads']} loads of {s['bytes_read'] / max(1, s['expert_loads']) / 1e6:.2f} MB over {n} "
            f"fetches, page cache warm, aliased={s['aliased']} (not aliased: host staging + a donated scatter to the device)")
    finally:
        st.close(save_usage=False)


def mesh_row(hf):
    import jax

    import glm_jax

    n = len(jax.devices())
    if n < 2:
        row("mesh over every device", "skipped", "", "one device")
        return
    one = glm_jax.Engine.load(hf, mesh="expert:1,model:1")
    eng = glm_jax.Engine.load(hf)                 # default mesh: every device on expert
    prompt = list(range(3, 19))
    a = one.generate(prompt, max_new_tokens=32, stop_on_eos=False)
    eng.generate(prompt, max_new_tokens=FLAGS.new_tokens, stop_on_eos=False)
    r = eng.generate(prompt, max_new_tokens=FLAGS.new_tokens, stop_on_eos=False)
    b = eng.generate(prompt, max_new_tokens=32, stop_on_eos=False)
    row(f"mesh {eng.plan.describe()} decode", round(r.stats["decode_tok_s"], 1), "tok/s",
        f"greedy tokens same as one device: {a.tokens == b.tokens}")


def main(argv):
    t0 = time.perf_counter()
    import glm_jax

    tmp = os.environ.get("GLM_JAX_DEVICE_CHECK_DIR") or tempfile.mkdtemp(prefix="glm-jax-device-check-")
    device_row()
    parity_row()
    _bench("resident decode: shipped model", lambda: _decode(glm_jax.default_model_path(), "shipped model"), t0)
    dirs = {}

    def make():
        dirs["hf"], dirs["int4"] = synth_dir(tmp)
        row("synthetic model", "ok", "", f"{dirs['hf']} (+ int4 container), made in "
            f"{time.perf_counter() - t_make:.0f} s")

    t_make = time.perf_counter()
    _bench("synthetic model", make, t0)
    if "hf" in dirs:
        _bench("resident decode: synthetic bf16", lambda: _decode(dirs["hf"], "synthetic 4L H1024 32x(512) bf16"), t0)
        _bench("resident decode: synthetic int4 container",
               lambda: _decode(dirs["int4"], "synthetic int4 container (experts preloaded)"), t0)
    _bench("expert seam", seam_rows, t0)
    if "int4" in dirs:
        _bench("experts from host RAM", lambda: stream_row(dirs["int4"]), t0)
        _bench("mesh", lambda: mesh_row(dirs["hf"]), t0)
    print()
    print(markdown(ROWS, ["check", "value", "unit", "note"]))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s (+ the parity run)")


if __name__ == "__main__":
    app.run(main)

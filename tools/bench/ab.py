"""A/B bench: every lossy knob's speed next to its quality, on a trained model, in the same process.

    python -m tools.bench.ab [--model=DIR] [--reps=3] [--new_tokens=64] [--out=bench_out/ab]

Configurations (baseline; TOPP; EXPERT_BUDGET per scope and residency; CACHE_ROUTE; MTP on/off) run interleaved
A B A B ... (rep-major, so drift cancels) in two corners:

* ``cold``: the seed's low-RAM corner: expert cache cap ``--cold_cap`` experts/layer, the store made cold before
  every rep (cache forgotten, expert files dropped from the page cache), plus ``--sim_disk_gbps``: each loaded
  expert also costs the time of reading ``--sim_expert_mb`` MB at that bandwidth (the shipped model's experts are
  tiny; this projects GLM-5.2-sized experts; reported apart, real bytes stay real).
* ``warm``: every expert cached (cap = E), cache kept across reps, no simulated disk.

Speed columns: decode tok/s (median), prefill s, decode s, hit rate, bytes read per decoded token (measured by the
store), experts dropped, MTP acceptance, tokens per forward.  Quality columns come from glm-jax-eval's evaluate()
with the same engine (same corner, same cache state semantics): PPL, ppl delta vs the reference, KL(ref||config),
top-1 agreement, next-line MC accuracy.  Output: a markdown table and a PNG speed-vs-quality plot.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from absl import app, flags

from tools.bench.tables import markdown

FLAGS = flags.FLAGS


def define_flags():
    """This tool's flags (on demand, so tools/bench/sweep.py can import the corner machinery; each defined once: a flag of
    the same name another command defined is reused)."""
    from glm_jax.options import define_once as once

    once(flags.DEFINE_string, "model", "", "Converted model directory (default: the embedded default model).")
    once(flags.DEFINE_integer, "reps", 3, "Interleaved repetitions per configuration.", lower_bound=1)
    once(flags.DEFINE_integer, "new_tokens", 48, "Tokens per generation.")
    once(flags.DEFINE_string, "prompt", "ROMEO:\n", "Prompt.")
    once(flags.DEFINE_integer, "cold_cap", 1, "Cache cap (experts/layer) of the cold low-RAM corner.")
    once(flags.DEFINE_float, "sim_disk_gbps", 1.5, "Simulated disk bandwidth for the cold corner (0 = real reads "
         "only).")
    once(flags.DEFINE_float, "sim_expert_mb", 19.0, "Simulated expert size (GLM-5.2 int4 ~19 MB).")
    once(flags.DEFINE_integer, "items", 200, "Multiple-choice items per quality eval.")
    once(flags.DEFINE_integer, "windows", 4, "Perplexity windows per quality eval.")
    once(flags.DEFINE_list, "configs", [], "Subset of configuration names (default: all).")
    once(flags.DEFINE_list, "corners", ["warm", "cold"], "Corners to run (warm first: routing-only quality is "
         "measured there once and reused).")
    once(flags.DEFINE_bool, "quality", True, "Also measure quality (glm-jax-eval) per configuration.")
    once(flags.DEFINE_string, "out", "bench_out/ab", "Output prefix (.md, .json, .png).")


NO_MTP = dict(mtp=False, draft=0)
MTP = dict(mtp=True, draft=3)


def configs(n_experts: int, top_k: int) -> dict:
    b_lo, b_hi = max(1, top_k // 2), max(2, top_k - 1)
    return {
        "baseline": dict(NO_MTP),
        "baseline+mtp": dict(MTP),
        "topp0.7": dict(NO_MTP, expert_topp=0.7),
        f"budget{b_lo}_union_cache": dict(NO_MTP, expert_budget=b_lo, budget_scope="union", budget_residency="cache"),
        f"budget{b_hi}_union_cache": dict(NO_MTP, expert_budget=b_hi, budget_scope="union", budget_residency="cache"),
        f"budget{b_lo}_position_none": dict(NO_MTP, expert_budget=b_lo, budget_scope="position",
                                            budget_residency="none"),
        f"budget{b_hi}_position_none": dict(NO_MTP, expert_budget=b_hi, budget_scope="position",
                                            budget_residency="none"),
        f"budget{b_lo}_position_pinned": dict(NO_MTP, expert_budget=b_lo, budget_scope="position",
                                              budget_residency="pinned"),
        f"budget{b_lo}_union_cache+mtp": dict(MTP, expert_budget=b_lo, budget_scope="union",
                                              budget_residency="cache"),
        f"budget{b_lo}_position_none+mtp": dict(MTP, expert_budget=b_lo, budget_scope="position",
                                                budget_residency="none"),
        "cache_route_maxrank": dict(NO_MTP, cache_route="max_rank", route_j=max(1, top_k // 2),
                                    route_m=min(n_experts, 3 * top_k)),
    }


def corner_opts(corner: str, E: int, pin_gb: float) -> dict:
    if corner == "cold":
        return dict(fetch="loop", cache_cap=FLAGS.cold_cap, sim_disk_gbps=FLAGS.sim_disk_gbps,
                    sim_expert_mb=FLAGS.sim_expert_mb, pin="auto", pin_gb=pin_gb)
    return dict(fetch="loop", cache_cap=E, pin="auto", pin_gb=pin_gb)


def _needs_pin(cfg: dict) -> bool:
    return cfg.get("budget_residency") == "pinned"


def depends_on_cache(cfg: dict) -> bool:
    """Whether a configuration's routing reads the expert cache (its quality then differs between corners)."""
    return cfg.get("budget_residency") == "cache" and cfg.get("expert_budget", 0) > 0 or "cache_route" in cfg


def prepare(model: str, prompt: str, new_tokens: int):
    """Probe the model: (ModelConfig, pin_gb).  One baseline generation leaves a usage history for --pin=auto (saved
    by the store at close); pin_gb holds about 2 experts per layer."""
    import glm_jax
    from glm_jax.experts.container import open_container

    probe = glm_jax.Engine.load(model, fetch="loop", cache_cap=1)
    cfg = probe.cfg
    probe.generate(prompt, max_new_tokens=new_tokens, stop_on_eos=False)
    rec = open_container(model, cfg).layout(cfg.moe_layers[0]).record_len
    probe.close()
    return cfg, 2 * len(cfg.moe_layers) * rec / 1e9


def corner_engine(model: str, cfg: dict, corner: str, E: int, pin_gb: float):
    """An engine for configuration ``cfg`` (engine options) in ``corner``."""
    import glm_jax

    return glm_jax.Engine.load(model, **dict(cfg, **corner_opts(corner, E, pin_gb if _needs_pin(cfg) else 0.0)))


def interleaved_runs(engines: dict, corner: str, reps: int, new_tokens: int, prompt: str) -> dict:
    """Decode runs of every engine, interleaved rep-major (A B A B ...: drift hits all alike), after one short
    compile run each; cold: the store made cold before every run.  Returns {name: [stats, ...]}."""
    runs = {n: [] for n in engines}
    for e in engines.values():        # compile outside the timing
        e.generate(prompt, max_new_tokens=4, stop_on_eos=False)
    for _ in range(reps):
        for n, e in engines.items():
            if corner == "cold":
                e.store.drop_cache()
            runs[n].append(e.generate(prompt, max_new_tokens=new_tokens, stop_on_eos=False).stats)
    return runs


def speed_row(corner: str, name: str, st: list) -> dict:
    """Median speed numbers of one configuration's runs in one corner."""
    med = lambda k: statistics.median(s.get(k, 0.0) for s in st)  # noqa: E731
    return {"corner": corner, "config": name, "tok/s": med("decode_tok_s"), "prefill s": med("prefill_s"),
            "decode s": med("decode_s"),
            "hit rate": med("decode_hits") / max(med("decode_hits") + med("decode_misses"), 1),
            "MB read/tok": med("bytes_read_per_token") / 1e6,
            "sim GB/tok": (med("decode_sim_bytes") / 1e9 / max(med("decode_tokens"), 1)) if corner == "cold" else 0.0,
            "dropped/tok": med("experts_dropped") / max(med("decode_tokens"), 1),
            "MTP acc": med("mtp_acceptance") if "mtp_acceptance" in st[0] else float("nan"),
            "tok/fwd": med("tokens_per_forward")}


def main(argv):
    import glm_jax
    from glm_jax import evaluate as ev

    model = FLAGS.model or glm_jax.default_model_path()
    cfg, pin_gb = prepare(model, FLAGS.prompt, FLAGS.new_tokens)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    plays = ev.read_plays(os.path.join(model, "heldout.txt"))
    allc = configs(E, K)
    qmemo = {}

    def quality(name, c, corner, e, ref):
        """Quality of a configuration.  MTP never changes what is scored (scoring is teacher forced), and a routing
        that is a pure function of the router (no cache residency in it) is the same in both corners: reuse."""
        base = name.replace("+mtp", "")
        lossy = any(k in c for k in ("expert_topp", "expert_budget", "cache_route", "plugins"))
        key = (base, corner if depends_on_cache(c) else "any")
        if not FLAGS.quality:
            return None
        if key not in qmemo:
            if lossy:
                if corner == "cold":
                    e.store.drop_cache()
                # quality does not depend on the disk: no simulated read time while scoring
                sim, e.store.sim_disk_gbps = e.store.sim_disk_gbps, 0.0
                r = ev.evaluate(e, ref, plays, n_items=FLAGS.items, n_windows=FLAGS.windows, chunk=4)
                e.store.sim_disk_gbps = sim
                qmemo["ref"] = {"PPL": r["ppl_ref"], "PPL Δ%": 0.0, "KL": 0.0, "top-1": 1.0,
                                "MC acc": r["mc_acc_pmi_ref"], "MC ref": r["mc_acc_pmi_ref"]}
                qmemo[key] = {"PPL": r["ppl"], "PPL Δ%": r["ppl_delta_pct"], "KL": r["kl"],
                              "top-1": r["top1_agree"], "MC acc": r["mc_acc_pmi"], "MC ref": r["mc_acc_pmi_ref"]}
            else:
                return None          # filled from the reference after the first lossy evaluation
        return qmemo[key]

    names = FLAGS.configs or list(allc)
    rows = []
    # the reference (no lossy plugin) does not depend on the cache: one warm engine serves every corner, and its
    # multiple-choice scores are memoised on it (computed once per run)
    ref = glm_jax.Engine.load(model, **dict(NO_MTP, **corner_opts("warm", E, 0.0))) if FLAGS.quality else None
    for corner in FLAGS.corners:
        engines = {n: corner_engine(model, allc[n], corner, E, pin_gb) for n in names}
        runs = interleaved_runs(engines, corner, FLAGS.reps, FLAGS.new_tokens, FLAGS.prompt)
        for n, e in engines.items():
            q = quality(n, allc[n], corner, e, ref)
            row = dict(speed_row(corner, n, runs[n]), **(q or {"PPL": None}))
            rows.append(row)
            print(json.dumps(row), flush=True)
        for e in engines.values():
            e.close()
    if ref is not None:
        ref.close()
    for r in rows:
        if r.get("PPL") is None:
            r.update(qmemo.get("ref", {}))
            r.pop(None, None)
    base = {r["corner"]: r["tok/s"] for r in rows if r["config"] == "baseline"}
    for r in rows:
        r["speedup"] = r["tok/s"] / base[r["corner"]] if base.get(r["corner"]) else float("nan")
    cols = ["corner", "config", "tok/s", "speedup", "prefill s", "decode s", "hit rate", "MB read/tok", "sim GB/tok",
            "dropped/tok", "MTP acc", "tok/fwd", "PPL", "PPL Δ%", "KL", "top-1", "MC acc"]

    head = (f"model {model}; {FLAGS.new_tokens} new tokens, median of {FLAGS.reps} interleaved reps; cold = cap "
            f"{FLAGS.cold_cap}/layer, store dropped before each rep, simulated {FLAGS.sim_expert_mb} MB experts at "
            f"{FLAGS.sim_disk_gbps} GB/s; warm = cap {E}/layer; quality: {FLAGS.items} next-line MC items scored by PMI (reference "
            f"acc {qmemo.get('ref', {}).get('MC ref', float('nan')):.3f}, chance 0.25), {FLAGS.windows}x128-token PPL windows, score chunk 4")
    md = head + "\n\n" + markdown(rows, cols)
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".md", "w") as f:
        f.write(md + "\n")
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    _plot(rows, FLAGS.out + ".png")
    print(md)


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install '.[bench]')", file=sys.stderr)
        return
    rows = [r for r in rows if r.get("PPL Δ%") is not None]      # --noquality: nothing to plot against
    if not rows:
        print("no quality columns (--noquality): no speed-vs-quality plot", file=sys.stderr)
        return
    corners = sorted({r["corner"] for r in rows})
    fig, axes = plt.subplots(1, len(corners), figsize=(7 * len(corners), 5), squeeze=False)
    for ax, c in zip(axes[0], corners):
        for r in (r for r in rows if r["corner"] == c):
            ax.scatter(r["speedup"], r["PPL Δ%"], s=30)
            ax.annotate(r["config"], (r["speedup"], r["PPL Δ%"]), fontsize=7)
        ax.axhline(2.0, ls="--", lw=0.8, color="gray")
        ax.set_xlabel("decode speed vs baseline (x)")
        ax.set_ylabel("perplexity change vs no lossy plugin (%)")
        ax.set_title(f"{c} corner")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    define_flags()
    app.run(main)

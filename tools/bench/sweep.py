"""A Pareto sweep of routing-plugin configurations: quality (glm-jax-eval's evaluate(), in-process) next to bytes read
per token and decode speed in bench_ab's cold and warm corners, one markdown table and one PNG.

    PYTHONPATH=examples python -m tools.bench.sweep [--model=DIR] [--grid_file=examples/sweep_grid.json] [--reps=3]
                                              [--new_tokens=32] [--windows=64] [--items=0] [--out=bench_out/sweep]

The grid (:func:`grid`): the baseline; TOPP 0.5-0.9; EXPERT_BUDGET 1..K-1 of top-K per position (routing-only) and
2..K-1 in the seed's union/cache form; hybrids TOPP-then-budget; per-layer budget schedules (the example plugin
glm_jax_plugins.layer_budget); gate-weight floors (glm_jax_plugins.weight_floor); plus any configurations of
``--grid_file`` (JSON ``{"name": {engine options...}}``; user plugins as ``"plugins": [["module:factory", {kwargs}]]``,
imported from PYTHONPATH).

Per configuration:

* quality: evaluate() against the same model with no lossy plugin (teacher forced through the KV cache, 4 positions
  per forward), in the warm corner -- or in the cold corner when the composed plugin is cache-dependent
  (glm_jax_plugins.contract.classify), where its quality differs;
* speed, per corner: bench_ab's corner machinery (``corner_engine``, ``interleaved_runs``, ``speed_row``), the
  configuration interleaved with a baseline engine in the same run (A B A B), so every cached result carries its own
  same-run baseline and its speedup stays honest when a sweep is resumed later.

Results are cached per configuration in ``--cache_dir`` (one JSON per configuration, named by a hash of the
configuration and the model (its manifest / config bytes)); inside, the quality and the speed results each carry the
settings they were measured with, so a rerun measures only what is missing or was measured otherwise (more PPL windows
remeasure quality, not speed), an interrupted sweep resumes, ``--refresh`` remeasures.  Output: ``OUT.md`` (the table), ``OUT.json``, ``OUT.png`` (PPL
increase against cold bytes read per token and against cold speedup, the Pareto frontier marked, the <= 2% window
shaded); the best configuration inside the window by cold speedup is named at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys

from absl import app, flags

from tools.bench import ab
from tools.bench.tables import markdown

FLAGS = flags.FLAGS


def define_flags():
    """bench_ab's flags (same meaning; other defaults, for a grid of ~30 configurations) and this tool's."""
    from glm_jax.options import define_once as once

    ab.define_flags()
    once(flags.DEFINE_string, "grid_file", "", "JSON {name: {engine options}} of more configurations (user plugins "
         "as \"plugins\": [[\"module:factory\", {kwargs}]]).")
    once(flags.DEFINE_string, "cache_dir", "bench_out/sweep.cache", "Per-configuration result cache (one JSON per "
         "configuration and model; shared by every --out).")
    once(flags.DEFINE_bool, "refresh", False, "Remeasure configurations that have a cached result.")
    once(flags.DEFINE_float, "window_pct", 2.0, "The PPL-increase window (%) the best setting is picked from.")
    once(flags.DEFINE_integer, "window_len", 128, "Tokens per perplexity window.")
    # 64 PPL windows: the 2% call of EXPERT_BUDGET=2 flipped between 16 windows (+1.80%) and 64 (+2.23%)
    for name, default in (("out", "bench_out/sweep"), ("reps", 3), ("new_tokens", 32), ("windows", 64),
                          ("items", 0)):
        FLAGS.set_default(name, default)


TOPPS = (0.5, 0.6, 0.7, 0.8, 0.9)
FLOORS = (0.1, 0.15, 0.2, 0.25)
WARM, COLD = "warm", "cold"


def _budget(n, scope="position", residency="none"):
    return dict(expert_budget=n, budget_scope=scope, budget_residency=residency)


def _plugin(spec, **kw):
    return [spec, kw]


def grid(moe_layers, top_k: int) -> dict:
    """The built-in grid: {name: engine options} (MTP off: speculation is measured elsewhere)."""
    g = {"baseline": {}}
    for p in TOPPS:
        g[f"topp{p}"] = dict(expert_topp=p)
    for n in range(1, top_k):
        g[f"budget{n}_position"] = _budget(n)
    for n in range(2, top_k):
        g[f"budget{n}_union_cache"] = _budget(n, "union", "cache")
    for p, n in ((0.7, top_k - 1), (0.8, top_k - 1), (0.9, top_k - 1), (0.8, max(1, top_k - 2)),
                 (0.9, max(1, top_k - 2))):
        g[f"topp{p}+budget{n}_position"] = dict(expert_topp=p, **_budget(n))
    L = max(moe_layers) + 1
    half = sorted(moe_layers)[len(moe_layers) // 2:]
    scheds = {
        "late_half": {l: top_k // 2 for l in half},                               # budget K/2 on the last half
        "late_half_k-1": {l: top_k - 1 for l in half},
        "last_layer1": {max(moe_layers): 1},
        "last_layer2": {max(moe_layers): top_k // 2},
        "first_layer2": {min(moe_layers): top_k // 2},
        "decreasing": {l: max(1, top_k - 1 - i) for i, l in enumerate(sorted(moe_layers))},
        "increasing": {l: min(top_k - 1, 1 + i) for i, l in enumerate(sorted(moe_layers))},
    }
    for name, sched in scheds.items():
        budgets = [sched.get(l, 0) for l in range(L)]
        g[f"sched_{name}({'/'.join(map(str, budgets))})"] = dict(
            plugins=[_plugin("glm_jax_plugins.layer_budget:layer_budget", budgets=budgets)])
    for m in FLOORS:
        g[f"floor{m}"] = dict(plugins=[_plugin("glm_jax_plugins.weight_floor:weight_floor", min_share=m)])
    g[f"topp0.9+floor{FLOORS[1]}"] = dict(
        expert_topp=0.9, plugins=[_plugin("glm_jax_plugins.weight_floor:weight_floor", min_share=FLOORS[1])])
    return g


# ----------------------------------------------------------------------------- the result cache
def canonical(cfg: dict) -> str:
    """A configuration as canonical JSON (sorted keys; plugin specs as [spec, {kwargs}] lists)."""
    def norm(v):
        if isinstance(v, dict):
            return {str(k): norm(x) for k, x in sorted(v.items())}
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, (str, int, float, bool)) or v is None:
            return v
        raise TypeError(f"sweep configurations must be JSON data (plugins as 'module:factory' specs), got {v!r}")
    return json.dumps(norm(cfg), sort_keys=True, separators=(",", ":"))


def model_fingerprint(model: str) -> str:
    """sha256 over the model's manifest.json (a container) or config.json: a new conversion is a new model."""
    h = hashlib.sha256()
    for f in ("manifest.json", "config.json"):
        p = os.path.join(model, f)
        if os.path.exists(p):
            with open(p, "rb") as fh:
                h.update(f.encode() + b"\0" + fh.read())
    return h.hexdigest()


def config_key(cfg: dict, fingerprint: str) -> str:
    """The cache file's key: sha256 of the configuration and the model."""
    blob = json.dumps({"config": json.loads(canonical(cfg)), "model": fingerprint}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_path(cache_dir: str, name: str, key: str) -> str:
    return os.path.join(cache_dir, f"{re.sub(r'[^A-Za-z0-9_.+-]+', '_', name)}-{key[:16]}.json")


PARTS = ("quality", "speed")


def run_grid(configs: dict, fingerprint: str, settings: dict, cache_dir: str, measure, refresh: bool = False,
             log=print) -> list:
    """Each configuration's result, cached in one JSON per configuration (``cache_path``: keyed by a hash of the
    configuration and the model).  The file holds the result of each part ("quality", "speed") with the measurement
    settings it was made with (``settings[part]``); a part is measured again only when it is missing, was made with
    other settings, or ``refresh``: ``measure(name, cfg, parts)`` returns {part: result dict}.  The file is written
    after every configuration (an interrupted sweep resumes).  Returns the rows in grid order: name, config, key,
    cached (the parts that came from the cache) and every part's results."""
    os.makedirs(cache_dir, exist_ok=True)
    out = []
    for name, cfg in configs.items():
        key = config_key(cfg, fingerprint)
        path = cache_path(cache_dir, name, key)
        stored = {}
        if os.path.exists(path):
            with open(path) as f:
                stored = json.load(f).get("parts", {})
        want = json.loads(canonical(settings))
        todo = [p for p in PARTS if p in want and (refresh or stored.get(p, {}).get("settings") != want[p])]
        if todo:
            log(f"[sweep] {name}: measuring {', '.join(todo)}")
            got = measure(name, cfg, set(todo))
            for p in todo:
                stored[p] = {"settings": want[p], "result": got[p]}
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"name": name, "key": key, "config": json.loads(canonical(cfg)), "parts": stored}, f,
                          indent=1)
            os.replace(tmp, path)
        else:
            log(f"[sweep] {name}: cached ({path})")
        row = {"name": name, "key": key, "config": json.loads(canonical(cfg)),
               "cached": [p for p in PARTS if p in want and p not in todo]}
        for p in PARTS:
            if p in want:
                row.update(stored[p]["result"])
        out.append(row)
    return out


# ----------------------------------------------------------------------------- the frontier
def pareto(points, maximize_y: bool = False) -> list:
    """Indices of the Pareto-optimal points of [(x, y)]: x (PPL increase) is minimised, y minimised (bytes read) or
    maximised (speed).  A point is dominated by one at least as good in both and better in one; NaN points never
    count."""
    pts = [(x, -y if maximize_y else y) for x, y in points]
    ok = [i for i, (x, y) in enumerate(pts) if x == x and y == y]
    front = []
    for i in ok:
        xi, yi = pts[i]
        if not any(pts[j][0] <= xi and pts[j][1] <= yi and (pts[j][0] < xi or pts[j][1] < yi) for j in ok if j != i):
            front.append(i)
    return sorted(front, key=lambda i: pts[i][0])


def best_in_window(rows, window_pct: float, key: str = "cold speedup"):
    """The lossy configuration with the highest ``key`` whose PPL increase is <= window_pct (None if none)."""
    inside = [r for r in rows if r["name"] != "baseline" and r.get("PPL Δ%") is not None
              and r["PPL Δ%"] <= window_pct and r.get(key) == r.get(key) and r.get(key) is not None]
    return max(inside, key=lambda r: r[key]) if inside else None


def mark_frontiers(rows):
    """Adds "frontier (bytes)" / "frontier (speed)" marks: on the PPL-increase vs cold MB/token (min, min) and PPL
    increase vs cold speedup (min, max) frontiers."""
    for col, y, mx in (("frontier (bytes)", "cold MB/tok", False), ("frontier (speed)", "cold speedup", True)):
        idx = set(pareto([(r.get("PPL Δ%", float("nan")), r.get(y, float("nan"))) for r in rows], maximize_y=mx))
        for i, r in enumerate(rows):
            r[col] = "*" if i in idx else ""
    return rows


COLUMNS = ["name", "kind", "PPL", "PPL Δ%", "KL", "top-1", "cold MB/tok", "cold sim GB/tok", "cold hit rate",
           "dropped/tok", "cold tok/s", "cold base tok/s", "cold speedup", "warm tok/s", "warm speedup",
           "frontier (bytes)", "frontier (speed)"]


def table(rows, window_pct: float) -> str:
    best = best_in_window(rows, window_pct)
    md = markdown(rows, [c for c in COLUMNS if any(c in r for r in rows)])
    if best is None:
        verdict = f"No lossy configuration stays within +{window_pct:g}% perplexity."
    else:
        verdict = (f"Best inside the <= {window_pct:g}% PPL window by cold speedup: **{best['name']}** "
                   f"({best['cold speedup']:.2f}x cold, PPL {best['PPL Δ%']:+.2f}%, "
                   f"{best['cold MB/tok']:.3f} MB read per token)")
        verdict += "." if best["cold speedup"] >= 1.3 else "; none reaches 1.3x there."
    return md + "\n\n" + verdict


def plot(rows, path: str, window_pct: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install '.[bench]')", file=sys.stderr)
        return False
    rows = [r for r in rows if r.get("PPL Δ%") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5))
    for ax, y, mx, label in ((axes[0], "cold MB/tok", False, "cold corner: MB read per decoded token (store)"),
                             (axes[1], "cold speedup", True, "cold corner: decode speed vs same-run baseline (x)")):
        xs = [r["PPL Δ%"] for r in rows]
        ys = [r.get(y, float("nan")) for r in rows]
        lo = min(min(xs), 0.0) - 0.3
        ax.axvspan(lo, window_pct, color="tab:green", alpha=0.08, label=f"PPL increase <= {window_pct:g}%")
        ax.scatter(xs, ys, s=22, color="tab:blue", zorder=3)
        front = pareto(list(zip(xs, ys)), maximize_y=mx)
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "-o", color="tab:red", ms=8, mfc="none", zorder=4,
                label="Pareto frontier")
        for i, r in enumerate(rows):
            on = i in front
            ax.annotate(r["name"], (xs[i], ys[i]), fontsize=6.5 if on else 5.5, xytext=(3, 2),
                        textcoords="offset points", color="tab:red" if on else "dimgray")
        ax.set_xlim(left=lo)
        ax.set_xlabel("perplexity increase vs no lossy plugin (%)")
        ax.set_ylabel(label)
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ----------------------------------------------------------------------------- measuring one configuration
class Measurer:
    """Engines shared by the whole sweep (the quality reference, one baseline engine per corner) and the
    measurement of one configuration."""

    def __init__(self, model, cfg, pin_gb, plays, corners):
        self.model, self.cfg, self.pin_gb, self.plays, self.corners = model, cfg, pin_gb, plays, list(corners)
        self.E = cfg.n_routed_experts
        self._ref = None
        self._base = {}

    def ref(self):
        if self._ref is None:
            self._ref = ab.corner_engine(self.model, ab.NO_MTP, WARM, self.E, 0.0)
        return self._ref

    def base(self, corner):
        if corner not in self._base:
            self._base[corner] = ab.corner_engine(self.model, ab.NO_MTP, corner, self.E, 0.0)
        return self._base[corner]

    def __call__(self, name, cfg, parts=PARTS):
        import glm_jax_plugins as P
        from glm_jax import evaluate as ev

        c = dict(ab.NO_MTP, **cfg)
        res = {p: {} for p in parts}
        engines = {}
        probe = ab.corner_engine(self.model, c, WARM, self.E, self.pin_gb)
        engines[WARM] = probe
        if "quality" in parts:
            q = res["quality"]
            kind = None
            if probe.plugin is not None:
                k = ev.effective_kind(P.contract.classify(
                    probe.plugin, self.cfg.num_experts_per_tok, self.E, list(self.cfg.moe_layers),
                    self.cfg.norm_topk_prob, self.cfg.routed_scaling_factor, self.cfg.num_hidden_layers, seeds=2),
                    probe)
                kind = ("cache-dependent" if k["cache_dependent"] else "routing-only") + \
                    ("" if k["row_independent"] else ", cross-row")
                q["kind"] = kind
            # the lossy engine scored against the reference (the baseline configuration is the reference itself);
            # a cache-dependent configuration in the cold corner, where its quality differs
            qcorner = COLD if kind and kind.startswith("cache") and COLD in self.corners else WARM
            e = engines.get(qcorner) or engines.setdefault(qcorner, ab.corner_engine(self.model, c, qcorner, self.E,
                                                                                     self.pin_gb))
            if qcorner == COLD:
                e.store.drop_cache()
            sim, e.store.sim_disk_gbps = e.store.sim_disk_gbps, 0.0
            r = ev.evaluate(e, self.ref(), self.plays, n_items=FLAGS.items, n_windows=FLAGS.windows,
                            window_len=FLAGS.window_len, chunk=4)
            e.store.sim_disk_gbps = sim
            q.update({"PPL": r["ppl"], "PPL ref": r["ppl_ref"], "PPL Δ%": r["ppl_delta_pct"], "KL": r["kl"],
                      "top-1": r["top1_agree"], "quality corner": qcorner})
            if r.get("mc_items"):
                q.update({"MC acc (PMI)": r["mc_acc_pmi"], "MC ref": r["mc_acc_pmi_ref"]})
        if "speed" in parts:
            sp = res["speed"]
            for corner in self.corners:
                e = engines.get(corner) or engines.setdefault(corner, ab.corner_engine(self.model, c, corner, self.E,
                                                                                       self.pin_gb))
                runs = ab.interleaved_runs({"baseline": self.base(corner), name: e}, corner, FLAGS.reps,
                                           FLAGS.new_tokens, FLAGS.prompt)
                me, bl = ab.speed_row(corner, name, runs[name]), ab.speed_row(corner, "baseline", runs["baseline"])
                sp.update({f"{corner} tok/s": me["tok/s"], f"{corner} base tok/s": bl["tok/s"],
                           f"{corner} speedup": me["tok/s"] / bl["tok/s"] if bl["tok/s"] else float("nan"),
                           f"{corner} MB/tok": me["MB read/tok"], f"{corner} hit rate": me["hit rate"],
                           f"{corner} dropped/tok": me["dropped/tok"]})
                if corner == COLD:
                    sp["cold sim GB/tok"] = me["sim GB/tok"]
            sp["dropped/tok"] = sp.get("cold dropped/tok", sp.get("warm dropped/tok"))
        for e in engines.values():
            e.close()
        return res

    def close(self):
        for e in [self._ref, *self._base.values()]:
            if e is not None:
                e.close()


def main(argv):
    import glm_jax
    from glm_jax import evaluate as ev
    from glm_jax.model.config import load_config

    model = FLAGS.model or glm_jax.default_model_path()
    cfg = load_config(model)
    configs = grid(cfg.moe_layers, cfg.num_experts_per_tok)
    if FLAGS.grid_file:
        with open(FLAGS.grid_file) as f:
            configs.update(json.load(f))
    if FLAGS.configs:
        unknown = [n for n in FLAGS.configs if n not in configs]
        if unknown:
            print(f"sweep: error: flag --configs: unknown {unknown} (known: {', '.join(configs)})", file=sys.stderr)
            return 2
        configs = {n: configs[n] for n in FLAGS.configs}
    _, pin_gb = ab.prepare(model, FLAGS.prompt, FLAGS.new_tokens)
    settings = {"quality": {"windows": FLAGS.windows, "window_len": FLAGS.window_len, "items": FLAGS.items,
                            "cold_corner": "cold" in FLAGS.corners},
                "speed": {"reps": FLAGS.reps, "new_tokens": FLAGS.new_tokens, "prompt": FLAGS.prompt,
                          "cold_cap": FLAGS.cold_cap, "sim_disk_gbps": FLAGS.sim_disk_gbps,
                          "sim_expert_mb": FLAGS.sim_expert_mb, "corners": sorted(FLAGS.corners)}}
    plays = ev.read_plays(os.path.join(model, "heldout.txt"))
    measurer = Measurer(model, cfg, pin_gb, plays, FLAGS.corners)
    rows = run_grid(configs, model_fingerprint(model), settings, FLAGS.cache_dir, measurer, FLAGS.refresh)
    measurer.close()
    mark_frontiers(rows)
    head = (f"model {model}; quality: {FLAGS.windows}x{FLAGS.window_len}-token PPL windows of the held-out plays, "
            f"teacher forced 4 positions per forward, warm corner (cache-dependent configurations: cold corner); "
            f"speed: {FLAGS.new_tokens} new tokens, greedy, median of {FLAGS.reps} reps interleaved with a baseline "
            f"in the same run; cold = cap {FLAGS.cold_cap}/layer, store dropped before each rep, simulated "
            f"{FLAGS.sim_expert_mb} MB experts at {FLAGS.sim_disk_gbps} GB/s; warm = every expert cached")
    md = head + "\n\n" + table(rows, FLAGS.window_pct)
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".md", "w") as f:
        f.write(md + "\n")
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    if plot(rows, FLAGS.out + ".png", FLAGS.window_pct):
        md += f"\n\nplot: {FLAGS.out}.png"
    print(md)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)

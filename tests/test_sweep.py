"""tools/bench/sweep.py's logic on fake results: the per-configuration cache (keys, resume, refresh), the Pareto frontier,
the best setting inside the window, the grid.  The sweep itself (minutes of measuring) never runs in the suite."""
import json
import os

import pytest

from glm_jax import options as O
from tools.bench import sweep as S

SETTINGS = {"quality": {"windows": 16}, "speed": {"reps": 2, "new_tokens": 32}}


def test_config_key_is_canonical_and_covers_the_model():
    a = {"expert_topp": 0.7, "plugins": [["m:f", {"b": 1, "a": 2}]]}
    b = {"plugins": [["m:f", {"a": 2, "b": 1}]], "expert_topp": 0.7}
    k = S.config_key(a, "fp")
    assert k == S.config_key(b, "fp")                                        # key order does not matter
    assert k != S.config_key(a, "fp2")                                       # another model
    assert k != S.config_key(dict(a, expert_topp=0.8), "fp")
    with pytest.raises(TypeError, match="JSON data"):
        S.canonical({"plugins": [lambda s: s]})


def test_model_fingerprint_reads_the_model_files(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    f1 = S.model_fingerprint(str(tmp_path))
    (tmp_path / "manifest.json").write_text('{"v": 1}')
    assert S.model_fingerprint(str(tmp_path)) != f1


def test_run_grid_caches_each_configuration_and_resumes(tmp_path):
    calls = []

    def measure(name, cfg, parts):
        calls.append((name, tuple(sorted(parts))))
        if name == "boom" and len(calls) < 4:
            raise RuntimeError("interrupted")
        return {"quality": {"PPL Δ%": cfg.get("expert_topp", 1.0)}, "speed": {"cold speedup": 1.0 + len(calls)}}

    both = ("quality", "speed")
    grid = {"baseline": {}, "topp0.7": {"expert_topp": 0.7}, "boom": {"expert_topp": 0.5}}
    run = lambda **kw: S.run_grid(kw.pop("g", grid), "fp", kw.pop("settings", SETTINGS), str(tmp_path), measure,  # noqa
                                  log=lambda m: None, **kw)
    with pytest.raises(RuntimeError):                                        # interrupted at the third config
        run()
    assert calls == [("baseline", both), ("topp0.7", both), ("boom", both)] and len(os.listdir(tmp_path)) == 2
    rows = run()
    assert calls[3:] == [("boom", both)]                                     # resumed: only the missing one
    assert [r["cached"] for r in rows] == [list(both), list(both), []] and [r["name"] for r in rows] == list(grid)
    assert rows[1]["PPL Δ%"] == 0.7 and rows[1]["cold speedup"] == 3.0 and rows[1]["config"] == {"expert_topp": 0.7}
    run()
    assert len(calls) == 4                                                   # everything cached
    # more PPL windows: quality is measured again, speed comes from the cache
    rows = run(settings=dict(SETTINGS, quality={"windows": 64}))
    assert calls[4:] == [(n, ("quality",)) for n in grid] and rows[1]["cold speedup"] == 3.0
    run(g={"baseline": {}}, settings=dict(SETTINGS, quality={"windows": 64}), refresh=True)
    assert calls[7:] == [("baseline", both)]
    with open(S.cache_path(str(tmp_path), "topp0.7", S.config_key({"expert_topp": 0.7}, "fp"))) as f:
        d = json.load(f)
    assert d["name"] == "topp0.7" and d["parts"]["quality"]["settings"] == {"windows": 64}


def test_pareto_frontier():
    #        A: (0, 10)  B: (1, 5)  C: (2, 6) dominated by B   D: (3, 1)   E: nan
    pts = [(0.0, 10.0), (1.0, 5.0), (2.0, 6.0), (3.0, 1.0), (float("nan"), 0.0), (1.0, 5.0)]
    assert S.pareto(pts) == [0, 1, 5, 3]                                     # ties are both optimal
    # speed is maximised: B (1, 5) beats C (2, 6)? no: C is faster, so both stay; D is slowest and worst quality
    assert S.pareto([(0.0, 1.0), (1.0, 5.0), (2.0, 6.0), (3.0, 2.0)], maximize_y=True) == [0, 1, 2]


def _rows():
    return [{"name": "baseline", "PPL Δ%": 0.0, "cold speedup": 1.0, "cold MB/tok": 0.34},
            {"name": "a", "PPL Δ%": 0.8, "cold speedup": 1.46, "cold MB/tok": 0.22},
            {"name": "b", "PPL Δ%": 1.9, "cold speedup": 1.7, "cold MB/tok": 0.2},
            {"name": "c", "PPL Δ%": 2.1, "cold speedup": 2.1, "cold MB/tok": 0.14},
            {"name": "d", "PPL Δ%": 1.0, "cold speedup": 1.2, "cold MB/tok": 0.3}]


def test_best_in_window_frontier_marks_and_verdict():
    rows = S.mark_frontiers(_rows())
    assert S.best_in_window(rows, 2.0)["name"] == "b"
    assert [r["name"] for r in rows if r["frontier (speed)"]] == ["baseline", "a", "b", "c"]
    assert [r["name"] for r in rows if r["frontier (bytes)"]] == ["baseline", "a", "b", "c"]
    md = S.table(rows, 2.0)
    assert "**b** (1.70x cold, PPL +1.90%" in md and "none reaches" not in md
    slow = [dict(r, **{"cold speedup": min(r["cold speedup"], 1.25)}) for r in _rows()]
    assert "none reaches 1.3x there" in S.table(slow, 2.0)
    assert "No lossy configuration stays within +0.5%" in S.table(_rows(), 0.5)


def test_grid_covers_the_issue_and_every_entry_resolves():
    g = S.grid([1, 2, 3], 4)
    for n in (1, 2, 3):
        assert g[f"budget{n}_position"]["expert_budget"] == n
    assert [g[f"topp{p}"]["expert_topp"] for p in S.TOPPS] == [0.5, 0.6, 0.7, 0.8, 0.9]
    assert "topp0.7+budget3_position" in g and "budget2_union_cache" in g
    sched = [c for n, c in g.items() if n.startswith("sched_")]
    assert len(sched) >= 5 and all(len(c["plugins"][0][1]["budgets"]) == 4 for c in sched)
    assert any(n.startswith("floor") for n in g)
    for name, cfg in g.items():                    # every configuration is valid engine options, plugins importable
        opts = O.resolve(json.loads(S.canonical(cfg)))
        O.load_plugins(opts["plugins"])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "s.png"
    assert S.plot(S.mark_frontiers(_rows()), str(p), 2.0) and p.stat().st_size > 1000

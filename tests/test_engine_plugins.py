"""Routing plugins inside the engine (flags, Python API), measured by the store's own counters."""

import json
import os
import subprocess
import sys

import numpy as np

import glm_jax

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "glm4moe_full")
PROMPT = [7, 8, 9, 10, 11]


def _run(**kw):
    kw.setdefault("mtp", False)           # one decoded token per forward: per-forward numbers stay comparable
    eng = glm_jax.Engine.load(GOLDEN, **kw)
    r = eng.generate(PROMPT, max_new_tokens=12, stop_on_eos=False)
    return eng, r


def test_no_plugin_is_exactly_the_plain_engine():
    _, a = _run()
    _, b = _run(expert_topp=1.0, expert_budget=0, cache_route="off")
    assert a.tokens == b.tokens and b.stats["experts_dropped"] == 0


def test_budget_caps_what_the_store_loads_per_layer():
    """Streaming, cap 1, union budget N=1 with residency none: every fetch asks for <= 1 expert per layer (+ rescues)."""
    eng, r = _run(fetch="loop", cache_cap=1, expert_budget=1, budget_residency="none", budget_max_positions=0)
    s = r.stats
    assert s["experts_dropped"] > 0
    assert s["union_per_layer"] <= 1.0 + s["rescued"] / max(1, s["forwards"])
    base_eng, base = _run(fetch="loop", cache_cap=1)
    assert base.stats["union_per_layer"] > s["union_per_layer"]
    # bytes are counted where they are read: fewer distinct experts -> fewer bytes read per decoded token
    assert s["bytes_read_per_token"] < base.stats["bytes_read_per_token"]


def test_budget_guard_skips_prefill_sized_forwards():
    eng = glm_jax.Engine.load(GOLDEN, expert_budget=1, budget_max_positions=4)
    eng.logits(list(range(10, 26)))                      # 16 real positions > 4: untouched
    assert eng._route_acc.get("dropped", 0) == 0
    ref = glm_jax.Engine.load(GOLDEN)
    ids = list(range(10, 26))
    assert np.array_equal(eng.logits(ids), ref.logits(ids))


def test_topp_and_cache_route_report_their_effect():
    _, t = _run(expert_topp=0.5)
    assert t.stats["experts_dropped"] > 0 and t.stats["route_agreement"] < 1.0
    _, c = _run(fetch="loop", cache_cap=2, cache_route="max_rank", route_j=1, route_m=8)
    assert c.stats["experts_dropped"] == 0            # re-selection keeps K experts
    assert "substitutions" in c.stats and 0.0 < c.stats["route_agreement"] <= 1.0


def test_position_scope_none_residency_is_batch_invariant_in_the_engine():
    eng = glm_jax.Engine.load(GOLDEN, expert_budget=1, budget_scope="position", budget_residency="none",
                              budget_max_positions=0)
    a, b = [3, 4, 5, 6, 7, 8], [20, 21, 22, 23]
    ba, bb = eng.batch_logits([a, b])
    assert np.abs(ba - eng.logits(a)).max() < 1e-5
    assert np.abs(bb - eng.logits(b)).max() < 1e-5


def test_cli_flags_env_alias_and_output_json(tmp_path, monkeypatch, capsys):
    from cli_inprocess import run

    out = tmp_path / "o.json"
    monkeypatch.setenv("EXPERT_BUDGET", "1")
    rc, _, err = run(["glm-jax", f"--model={GOLDEN}", "--prompt_ids=7,8,9", "--max_new_tokens=5", "--ignore_eos",
                      "--budget_max_positions=0", "--nomtp", "--colibri_env", f"--output_json={out}"], capsys)
    assert rc == 0, err
    d = json.loads(out.read_text())
    assert len(d["tokens"]) == 5 and d["stats"]["experts_dropped"] > 0     # the env alias took effect
    assert "prefill 3 tokens" in err and "tok/s" in err
    # a flag given on the command line wins over the alias
    rc, _, err = run(["glm-jax", f"--model={GOLDEN}", "--prompt_ids=7,8,9", "--max_new_tokens=5", "--ignore_eos",
                      "--expert_budget=0", "--nomtp", f"--output_json={out}"], capsys)
    assert rc == 0, err
    assert json.loads(out.read_text())["stats"]["experts_dropped"] == 0


def test_cli_bad_flag_value_is_one_line_error():
    p = subprocess.run([sys.executable, "-m", "glm_jax.cli", f"--model={GOLDEN}", "--budget_scope=galaxy"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "budget_scope" in p.stderr
    p = subprocess.run([sys.executable, "-m", "glm_jax.cli", "--model=/nonexistent/dir"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "/nonexistent/dir: model directory not found" in p.stderr

"""fetch=fused (streaming.fused_forward): the streamed forward as one compiled program, and the scheduler's
multi-step decode loop with the store called from inside it.  Against fetch=loop on the same container with a small
cache (real misses and evictions): bitwise the same logits and tokens, the same bytes read and store counters; a
row's output independent of its neighbours and of what the cache held before; the banks read in place."""

import json
import os
import re

import numpy as np

import glm_jax
from glm_jax.runtime import streaming

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
SRC = os.path.join(GOLDEN, "glm4moe_full")
COUNTERS = ("bytes_read", "expert_loads", "hits", "misses", "evictions", "requested", "fetch_calls")


def _load(d, fetch, **kw):
    kw = {"cache_cap": 3, "draft": 0, "prefix_cache": False, **kw}
    return glm_jax.Engine.load(d, fetch=fetch, **kw)


def _decode_logits(eng, ids, P=6):
    """A prefill of ids[:P] (16 positions: beyond one fetch, the loop's chunked path in both modes), then one-token
    decode forwards at the decode width: their logits [len(ids) - P, V]."""
    eng._ensure_cache(1, 64)
    t = np.zeros((1, 16), np.int32)
    t[0, :P] = ids[:P]
    eng.forward(t, np.zeros(1, np.int32), np.array([P], np.int32))
    out = []
    for pos in range(P, len(ids)):
        t = np.zeros((1, 4), np.int32)
        t[0, 0] = ids[pos]
        lg, _ = eng.forward(t, np.array([pos], np.int32), np.array([1], np.int32))
        out.append(np.asarray(lg)[0, 0])
    return np.stack(out)


def test_fused_is_bitwise_loop_with_misses_and_evictions(int4_dir, exp):
    """Logits of decode forwards, greedy tokens of a multi-step decode, and every store counter: identical."""
    ids = (exp["greedy_prompt"].tolist() + exp["greedy_tokens"].tolist())[:20]
    runs = {}
    for fetch in ("loop", "fused"):
        eng = _load(int4_dir, fetch)
        eng.store.reset_stats()
        lg = _decode_logits(eng, ids)
        g = eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=40, stop_on_eos=False)
        runs[fetch] = (lg, g.tokens, {k: eng.store.stats()[k] for k in COUNTERS})
        if fetch == "fused":
            assert any(k[0] == "fused_step" for k in eng._jits)         # the one-forward program ran
            assert any(k[0] == "fused_decode" for k in eng._jits)       # and the multi-step decode loop
            assert eng.scheduler.counters["decode_steps"] > eng.scheduler.counters["dispatches"]
            assert eng.scheduler.counters["optimistic_misses"] > 0       # steps rolled back at a miss, re-run
        eng.close()
    (la, ta, sa), (lb, tb, sb) = runs["loop"], runs["fused"]
    assert np.array_equal(la, lb), np.abs(la - lb).max()
    assert ta == tb
    assert sa == sb
    assert sa["misses"] > 0 and sa["evictions"] > 0 and sa["hits"] > 0        # a real mix, not all hits


def test_fused_hit_layers_skip_the_host_and_replay_its_bookkeeping(int4_dir, exp, monkeypatch):
    """With every expert cached no layer calls the host, and the store still counts each layer's call (hits,
    requested, fetch_calls: the loop's numbers)."""
    calls = []
    real = streaming._fused_host
    monkeypatch.setattr(streaming, "_fused_host", lambda *a: calls.append(a[1]) or real(*a))
    stats = {}
    for fetch in ("loop", "fused"):
        eng = _load(int4_dir, fetch, cache_cap=8)
        eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=8, stop_on_eos=False)   # warms every expert used
        eng.generate(list(range(3, 10)), max_new_tokens=8, stop_on_eos=False)
        calls.clear()
        eng.store.reset_stats()
        eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=8, stop_on_eos=False)
        stats[fetch] = {k: eng.store.stats()[k] for k in COUNTERS}
        eng.close()
    assert stats["fused"] == stats["loop"]
    assert stats["fused"]["misses"] == 0 and stats["fused"]["fetch_calls"] > 0
    assert calls == []


def test_fused_prefetch_trace_and_cache_dependent_plugin_match_loop(int4_dir, exp, tmp_path):
    """--prefetch (a host call per layer: recall, background loads), --route_trace and a plugin that reads the
    live cache (--cache_route): the same tokens, counters, prefetch numbers and trace lines as fetch=loop."""
    out = {}
    for fetch in ("loop", "fused"):
        for kw in ({"prefetch": True, "cache_cap": 1}, {"cache_route": "max_rank", "cache_cap": 2}):
            trace = str(tmp_path / f"{fetch}-{list(kw)[0]}.jsonl")
            eng = _load(int4_dir, fetch, route_trace=trace, **kw)
            g = eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=24, stop_on_eos=False)
            s = g.stats
            keys = COUNTERS + ("prefetch_loads", "prefetch_hits", "prefetch_unused", "prefetch_recall")
            with open(trace) as f:
                lines = [json.loads(x) for x in f]
            out[fetch, list(kw)[0]] = (g.tokens, {k: s.get(k) for k in keys}, lines)
            eng.close()
    for k in ("prefetch", "cache_route"):
        assert out["loop", k] == out["fused", k], k
    assert out["fused", "prefetch"][1]["prefetch_hits"] > 0


def test_fused_rows_are_independent_of_neighbours_and_cache_history(int4_dir, exp):
    """A row's greedy output is the same alone and beside another request (max_batch 2: one program, the union of
    both rows' experts), and the same after a different earlier prompt moved other experts into the cache; and it
    is fetch=loop's."""
    a, b = exp["greedy_prompt"].tolist(), list(range(7, 15))
    ref = _load(int4_dir, "loop").generate(a, max_new_tokens=24, stop_on_eos=False).tokens
    eng = _load(int4_dir, "fused", max_batch=2)
    alone = eng.generate(a, max_new_tokens=24, stop_on_eos=False).tokens
    both = eng.generate([a, b], max_new_tokens=24, stop_on_eos=False)
    eng.generate(b[::-1], max_new_tokens=16, stop_on_eos=False)            # another history
    after = eng.generate(a, max_new_tokens=24, stop_on_eos=False).tokens
    assert alone == both[0].tokens == after == ref
    assert any(k[0] == "fused_decode" and k[1] == 2 for k in eng._jits)
    eng.close()


def test_fused_program_reads_the_banks_in_place(int4_dir, exp):
    """The compiled decode program takes each layer's bank (aliasing the store's arena) as an argument and copies
    none of it: no instruction produces an array of a bank's shape but the parameters and their pass-throughs."""
    import jax
    import jax.numpy as jnp

    eng = _load(int4_dir, "fused")
    assert eng.store.aliased
    eng._ensure_cache(1, 64)
    f = jax.jit(streaming.fused_forward(eng, 1, 4, 1))
    args = (eng.params, streaming.fused_banks(eng), eng._cache, jnp.zeros((1, 4), jnp.int32), jnp.zeros(1, jnp.int32),
            jnp.ones(1, jnp.int32), streaming.fused_state(eng, 1, 1, 4))
    hlo = f.lower(*args).compile().as_text()
    bank = streaming.fused_banks(eng)[0]
    dims = ",".join(str(d) for d in bank.gate_up.shape)
    made = []
    for ln in hlo.splitlines():     # "%name = TYPE op(...)"; tuples (while, conditional) have no single TYPE
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) ([\w-]+)\(", ln)
        if m and f"[{dims}]" in m.group(1) and m.group(2) not in ("parameter", "get-tuple-element", "opt-barrier",
                                                                    "bitcast"):
            made.append(ln.strip()[:200])
    assert hlo.count(f"[{dims}]") >= 1 and not made, made[:3]
    eng.close()


def test_fused_mtp_speculation_matches_loop(int4_dir, exp):
    """MTP drafting (its layer's experts fetched the loop's way) with fused verify forwards: the loop's tokens and
    store counters."""
    out = {}
    for fetch in ("loop", "fused"):
        eng = _load(int4_dir, fetch, cache_cap=2, mtp=True, draft=2)
        g = eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=16, stop_on_eos=False)
        out[fetch] = (g.tokens, {k: eng.store.stats()[k] for k in COUNTERS})
        if fetch == "fused":
            assert any(k[0] == "fused_step" for k in eng._jits)
        eng.close()
    assert out["loop"] == out["fused"]


def test_streamed_default_is_fused_and_its_all_cached_decode_has_no_host_call(int4_dir, exp, monkeypatch):
    """A container whose experts stream runs fetch=fused by default; with every expert it meets cached, its decode
    loop is the optimistic program: no host callback traced into it (the one that made each dispatch take JAX's
    Python path) and no dispatch ended at a miss.  Before, auto streamed with fetch=loop, and fused's decode loop
    held an io_callback per MoE layer."""
    eng = glm_jax.Engine.load(int4_dir, cache_cap=3, draft=0)          # 3 of 8 experts per layer
    assert eng.opts["fetch"] == "fused"
    eng.close()
    ref = _load(int4_dir, "loop", cache_cap=8).generate(exp["greedy_prompt"].tolist(), max_new_tokens=16,
                                                         stop_on_eos=False).tokens
    eng = _load(int4_dir, "fused", cache_cap=8)
    eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=16, stop_on_eos=False)   # caches what it meets
    for k in [k for k in eng._jits if k[0] == "fused_decode"]:
        del eng._jits[k]
    monkeypatch.setattr(streaming, "io_callback", lambda *a, **k: (_ for _ in ()).throw(AssertionError("host call")))
    misses = eng.scheduler.counters["optimistic_misses"]
    g = eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=16, stop_on_eos=False)
    assert g.tokens == ref
    assert eng.scheduler.counters["optimistic_misses"] == misses
    assert any(k[0] == "fused_decode" and k[-1] for k in eng._jits)
    eng.close()


def test_a_cache_that_misses_every_step_still_runs_several_steps_per_dispatch(int4_dir, exp):
    """With misses in every dispatch, fetch=fused runs the program with the store's calls; its steps are timed like
    any other, so a dispatch runs what fits in --dispatch_ms.  Before, a dispatch with a miss was never timed: the
    step time stayed unknown and every dispatch ran one step (each paying the Python dispatch of a program holding
    host callbacks: 448 dispatches for 448 steps on b with 16 of 32 experts cached)."""
    eng = _load(int4_dir, "fused", cache_cap=1, dispatch_ms=10_000)
    eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=40, stop_on_eos=False)
    c = eng.scheduler.counters
    assert eng.store.stats()["misses"] > 40                       # misses nearly every step
    assert c["decode_steps"] >= 2 * (c["dispatches"] - c["optimistic_misses"])
    eng.close()

"""User-written routing plugins: the two example plugins (properties), the contract checks, loading through the API
and the CLI flags from a module on PYTHONPATH, the layer index / sequence position a plugin sees, and glm-jax-eval
--check_contract."""
from __future__ import annotations

import json
import os

import cli_inprocess
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import glm_jax
import glm_jax_plugins as gp
from glm_jax import options as O
from glm_jax_plugins import contract

HERE = os.path.dirname(__file__)
GOLDEN = os.path.join(HERE, "golden", "glm4moe_full")
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
PROMPT = [7, 8, 9, 10, 11]
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------- option / flag parsing (no jax)
def test_plugin_args_parse_literals_tuples_and_strings():
    assert O.parse_plugin_args("min_share=0.2,budgets=0,0,2,2,scope=union,use_resident=true,x=None") == {
        "min_share": 0.2, "budgets": (0, 0, 2, 2), "scope": "union", "use_resident": True, "x": None}
    assert O.parse_plugin_args("") == {}
    with pytest.raises(O.OptionError, match="--plugin_args"):
        O.parse_plugin_args("0.2")


def test_plugin_flags_pair_by_position_and_bad_input_names_the_flag():
    a, b = O.parse_plugin_flags(["m:f", "n:g"], ["k=1", ""])
    assert (a.spec, dict(a.kwargs), b.spec, dict(b.kwargs)) == ("m:f", {"k": 1}, "n:g", {})
    with pytest.raises(O.OptionError, match="--plugin_args: given 1 times for 2"):
        O.parse_plugin_flags(["m:f", "n:g"], ["k=1"])
    with pytest.raises(O.OptionError, match="--plugin=nocolon"):
        O.parse_plugin_flags(["nocolon"], [])
    with pytest.raises(O.PluginError, match="--plugin=no_such_module_xyz:f.*cannot import"):
        O.load_plugins(O.parse_plugin_flags(["no_such_module_xyz:f"], []))
    with pytest.raises(O.PluginError, match="has no attribute 'nope'"):
        O.load_plugins(O.parse_plugin_flags(["glm_jax_plugins:nope"], []))
    with pytest.raises(O.PluginError, match=r"weight_floor\(\*\*\{'bogus': 1\}\) raised TypeError"):
        O.load_plugins(O.parse_plugin_flags(["glm_jax_plugins.weight_floor:weight_floor"], ["bogus=1"]))
    with pytest.raises(O.OptionError, match=r"option 'plugins'\[0\]"):
        O.resolve({"plugins": [42]})


# ----------------------------------------------------------------------------- states
def states(seed, T, K, E, norm, rsf, n=6, layer_max=4, holes=True):
    """n router-like states (rows with some invalid slots when ``holes``), stacked for vmap."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        s = contract.router_state(rng, T, K, E, norm, rsf, layer=int(rng.integers(0, layer_max + 1)),
                                  num_layers=layer_max, resident=rng.random(E) < 0.5)
        if holes:
            valid = rng.random((T, K)) < 0.8
            valid[np.arange(T), rng.integers(0, K, T)] = True           # every row keeps >= 1 valid slot
            s = s.replace(valid=jnp.asarray(valid), weights=jnp.where(jnp.asarray(valid), s.weights, 0.0))
        out.append(s)
    return out, jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *out)


SHAPES = [(5, 4, 16, True, 2.5), (3, 2, 7, False, 1.5)]
cases = st.tuples(st.integers(0, len(SHAPES) - 1), st.integers(0, 2**31 - 1))
_VJ = {}


def vjit(name, fn):
    if name not in _VJ:
        _VJ[name] = jax.jit(jax.vmap(fn))
    return _VJ[name]


def check_renorm(s, valid_out, w_out):
    """Survivors renormalised like the router: sum = rsf with norm_topk_prob, else the old mass; zeros elsewhere."""
    w_in = np.where(np.asarray(s.valid), np.asarray(s.weights), 0.0)
    assert not np.any(w_out[~valid_out])
    want = s.routed_scaling_factor if s.norm_topk_prob else w_in.sum(-1)
    np.testing.assert_allclose(w_out.sum(-1), np.broadcast_to(want, w_out.shape[:1]), rtol=2e-5)
    ratio = np.where(valid_out, w_out / np.where(w_in > 0, w_in, 1.0), 0.0)    # proportional to the input weights
    for t in range(w_out.shape[0]):
        r = ratio[t][valid_out[t]]
        np.testing.assert_allclose(r, r[0], rtol=2e-5)


# ----------------------------------------------------------------------------- example plugin: weight floor
@SETTINGS
@given(cases)
def test_weight_floor_properties(case):
    shape, seed = case
    T, K, E, norm, rsf = SHAPES[shape]
    sts, batch = states(seed, T, K, E, norm, rsf)
    m = float(np.random.default_rng(seed).choice([0.1, 0.2, 0.3, 0.6]))
    out = vjit(("floor", shape), lambda s, m: gp.apply_weight_floor(s, m))(batch, jnp.full((len(sts),), m))
    for i, s in enumerate(sts):
        valid_in, w = np.asarray(s.valid), np.where(np.asarray(s.valid), np.asarray(s.weights), 0.0)
        v, wo = np.asarray(out.valid[i]), np.asarray(out.weights[i])
        share = w / w.sum(-1, keepdims=True)
        heaviest = np.arange(K) == np.argmax(np.where(valid_in, w, -np.inf), -1)[:, None]
        near = np.abs(share - m) < 1e-6                                      # fp32 rounding at the cut
        np.testing.assert_array_equal(v[~near], (valid_in & ((share >= m) | heaviest))[~near])
        assert v.any(-1).all()                                               # no empty row
        check_renorm(s, v, wo)
    # a floor below every share keeps everything: the identity on values (router states, no holes)
    _, full = states(seed, T, K, E, norm, rsf, holes=False)
    low = vjit(("floor", shape), lambda s, m: gp.apply_weight_floor(s, m))(full, jnp.full((len(sts),), 1e-9))
    np.testing.assert_array_equal(np.asarray(low.valid), np.asarray(full.valid))
    np.testing.assert_allclose(np.asarray(low.weights), np.asarray(full.weights), rtol=2e-5, atol=1e-7)


# ----------------------------------------------------------------------------- example plugin: per-layer budget
SCHEDULE = (0, 3, 1, 2)          # layer 0: off, 1: budget 3, 2: budget 1, 3: budget 2, >= 4: default 0


@SETTINGS
@given(cases)
def test_layer_budget_properties(case):
    shape, seed = case
    T, K, E, norm, rsf = SHAPES[shape]
    sts, batch = states(seed, T, K, E, norm, rsf)
    plug = gp.layer_budget(SCHEDULE)
    out = vjit(("layer_budget", shape), plug)(batch)
    for i, s in enumerate(sts):
        layer = int(s.layer)
        n = SCHEDULE[layer] if layer < len(SCHEDULE) else 0
        valid_in, w = np.asarray(s.valid), np.asarray(s.weights)
        v, wo = np.asarray(out.valid[i]), np.asarray(out.weights[i])
        if n == 0:                                                           # this layer is off: untouched
            np.testing.assert_array_equal(v, valid_in)
            np.testing.assert_array_equal(wo, w)
            continue
        assert (v <= valid_in).all() and v.any(-1).all()
        np.testing.assert_array_equal(v.sum(-1), np.minimum(n, valid_in.sum(-1)))
        for t in range(T):                                                   # the heaviest ones, by weight alone
            kept, dropped = w[t][v[t]], w[t][valid_in[t] & ~v[t]]
            if len(dropped):
                assert kept.min() >= dropped.max()
        check_renorm(s, v, wo)
    assert gp.layer_budget((0, 0, 0)) is gp.identity and gp.layer_budget("") is gp.identity
    assert gp.weight_floor(None) is gp.identity and gp.weight_floor(0.0) is gp.identity
    with pytest.raises(ValueError):
        gp.layer_budget((1, -1))


def test_example_plugins_jit_equals_eager():
    sts, _ = states(3, 4, 4, 12, True, 2.5, n=1)
    for plug in (gp.weight_floor(0.2), gp.layer_budget("0,2,1,3", default=1)):
        jp = jax.jit(plug)
        for s in sts:
            a, b = plug(s), jp(s)
            np.testing.assert_array_equal(np.asarray(a.valid), np.asarray(b.valid))
            np.testing.assert_allclose(np.asarray(a.weights), np.asarray(b.weights), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- the contract checks
def test_contract_structure_is_checked_at_trace_time():
    st_ = contract.abstract_state(4, 2, 8)
    bad = contract.checked(lambda s: s.replace(valid=s.valid[:, :1]), 0, "narrow")
    with pytest.raises(ValueError, match=r"routing plugin 'narrow' broke the contract: changed 'valid' from \[4, 2\] "
                                         r"bool to \[4, 1\] bool"):
        jax.eval_shape(bad, st_)
    fresh = contract.checked(lambda s: gp.RoutingState(ids=s.ids, weights=s.weights, valid=s.valid, scores=s.scores,
                                                      biased=s.biased, resident=s.resident, positions=s.positions),
                             0, "fresh")
    with pytest.raises(ValueError, match="dropped field 'layer'"):
        jax.eval_shape(fresh, st_)

    def py_if(s):
        return s if s.layer > 1 else s
    with pytest.raises(ValueError, match="'py_if' failed: TracerBoolConversionError.*jnp.where"):
        jax.eval_shape(contract.checked(py_if, 0), st_)


def test_contract_values_are_checked_in_jit_and_name_the_first_offender():
    s, _ = states(0, 4, 2, 8, True, 2.5, n=1, holes=False)
    s = s[0]
    nan = lambda s: s.replace(weights=s.weights.at[0, 0].set(jnp.nan))              # noqa: E731
    neg = lambda s: s.replace(weights=-s.weights)                                    # noqa: E731
    empty = lambda s: s.replace(valid=s.valid.at[2].set(False))                      # noqa: E731
    moved = lambda s: s.replace(positions=~s.positions)                              # noqa: E731
    ok = gp.weight_floor(0.3)
    run = lambda *ps: int(jax.jit(gp.compose(*[contract.checked(p, i) for i, p in enumerate(ps)]))(s).violation)  # noqa
    assert run(ok) == 0
    for i, (p, flag) in enumerate([(nan, contract.NONFINITE), (neg, contract.NEGATIVE), (empty, contract.EMPTY_ROW),
                                   (moved, contract.READ_ONLY_CHANGED)]):
        code = run(ok, p, nan)
        assert contract.decode(code) == (1, flag), (i, code)           # plugin #1 is named, not the later nan
    assert "no expert" in contract.describe(contract.EMPTY_ROW)


def test_classify_tells_routing_only_from_cache_dependent_and_cross_row():
    kw = dict(K=4, E=16, layers=[1, 3], norm_topk_prob=True, routed_scaling_factor=2.5, num_layers=4, seeds=1)
    floor = contract.classify(gp.weight_floor(0.2), **kw)
    assert floor == {"cache_dependent": False, "row_independent": True, "value_flags": 0, "kind": "routing-only"}
    assert contract.classify(gp.layer_budget((0, 1, 1, 1), use_resident=True), **kw)["kind"] == "cache-dependent"
    union = contract.classify(gp.expert_budget(2, "union"), **kw)
    assert not union["row_independent"]
    # an engine whose residency never changes (--budget_residency none / pinned) makes a resident-reading plugin
    # routing-only after all
    from glm_jax import evaluate as ev

    dep = contract.classify(gp.expert_budget(2, "position"), **kw)
    assert dep["cache_dependent"]
    for residency, kind in (("none", "routing-only (resident constant"), ("cache", "cache-dependent")):
        eng = glm_jax.Engine.load(GOLDEN, fetch="loop", cache_cap=1, budget_residency=residency)
        assert ev.effective_kind(dep, eng)["kind"].startswith(kind)


# ----------------------------------------------------------------------------- through the engine
def _gen(eng, n=12):
    return eng.generate(PROMPT, max_new_tokens=n, stop_on_eos=False)


@pytest.mark.parametrize("fetch", ["resident", "loop"])
def test_plugin_sees_the_layer_index_and_each_rows_sequence_position(fetch):
    """Top-1 only in layer 2 and from sequence position 8 on: with top-2 routing, one forward over 12 tokens
    (positions 0..11) drops one expert at positions 8..11 of layer 2 and none elsewhere -- in both fetch modes (the
    layer index is traced in fetch=loop, where every layer shares one compiled program)."""
    def late(s):
        rank = jnp.argsort(jnp.argsort(-jnp.where(s.valid, s.weights, -jnp.inf), axis=-1), axis=-1)
        on = (s.layer == 2) & (s.seq_pos >= 8)
        return gp.renormalize(s, valid=s.valid & ((rank < 1) | ~on[:, None]))
    eng = glm_jax.Engine.load(GOLDEN, fetch=fetch, cache_cap=2, mtp=False, plugins=[late])
    assert eng.plugin_names == ["late"] and eng.lossy
    eng.logits(list(range(10, 22)))
    assert eng._route_acc["dropped"] == 4


@pytest.fixture(scope="module")
def baseline_loop():
    return _gen(glm_jax.Engine.load(GOLDEN, fetch="loop", cache_cap=1, mtp=False)).stats


def test_api_loads_a_plugin_module_from_pythonpath(monkeypatch, baseline_loop):
    monkeypatch.syspath_prepend(EXAMPLES)
    eng = glm_jax.Engine.load(GOLDEN, fetch="loop", cache_cap=1, mtp=False,
                              plugins=[("my_plugins:late_topk", {"from_layer": 2, "keep": 1})])
    assert eng.plugin_names == ["late_topk(from_layer=2, keep=1)"]
    s = _gen(eng).stats
    assert s["experts_dropped"] == 11                 # top-2 -> top-1 in layer 2, 11 decoded positions
    # the store reads fewer bytes: layer 2 loads one expert per token instead of two
    assert s["bytes_read_per_token"] < baseline_loop["bytes_read_per_token"]
    assert baseline_loop["experts_dropped"] == 0


def _cli(argv, capsys):
    return cli_inprocess.run(argv, capsys)


def test_cli_plugin_flag_from_pythonpath(tmp_path, monkeypatch, capsys, baseline_loop):
    monkeypatch.syspath_prepend(EXAMPLES)
    out = tmp_path / "o.json"
    rc, _, err = _cli(["glm-jax", f"--model={GOLDEN}", "--prompt_ids=7,8,9,10,11", "--max_new_tokens=12",
                       "--ignore_eos", "--nomtp", "--fetch=loop", "--cache_cap=1", "--plugin=my_plugins:late_topk",
                       "--plugin_args=from_layer=2,keep=1", f"--output_json={out}"], capsys)
    assert rc == 0, err
    s = json.loads(out.read_text())["stats"]
    assert s["experts_dropped"] == 11 and "experts dropped 11" in err
    assert s["bytes_read_per_token"] < baseline_loop["bytes_read_per_token"]
    # bad arguments, and a plugin that breaks the contract: one line naming it, exit status 2
    rc, _, err = _cli(["glm-jax", f"--model={GOLDEN}", "--prompt_ids=7,8,9", "--max_new_tokens=2", "--nomtp",
                       "--plugin=glm_jax_plugins.layer_budget:layer_budget", "--plugin_args=budgets=0,1,-1"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("glm-jax: error: flag --plugin=glm_jax_plugins.layer_budget:layer_budget: layer_budget(")
    (tmp_path / "broken_plugins.py").write_text("def nan_weights():\n    return lambda s: s.replace(weights=s.weights "
                                                "* float('nan'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, _, err = _cli(["glm-jax", f"--model={GOLDEN}", "--prompt_ids=7,8,9", "--max_new_tokens=2", "--nomtp",
                       "--plugin=broken_plugins:nan_weights"], capsys)
    assert rc == 2 and err == ("glm-jax: error: routing plugin 'broken_plugins:nan_weights' broke the contract at "
                               "layer 1: gave a valid slot a NaN/inf weight\n")


def test_check_contract_passes_for_routing_only_plugin(capsys):
    """glm-jax-eval --check_contract on the shipped model (trained MTP head, experts through the store, 1 cached
    expert per layer): the gate-weight floor keeps greedy output identical with MTP drafts."""
    rc, out, err = _cli(["glm-jax-eval", "--check_contract", "--contract_tokens=16", "--cache_cap=1",
                         "--plugin=glm_jax_plugins.weight_floor:weight_floor", "--plugin_args=min_share=0.2"],
                        capsys)
    assert rc == 0, out + err
    assert "| weight_floor(min_share=0.2) | routing-only | yes | ok | yes |" in out
    assert "PASS: greedy output with MTP (draft 3) is identical to without, 16 tokens" in out


def test_check_contract_fails_for_cache_dependent_plugin(monkeypatch):
    from glm_jax import evaluate as ev

    monkeypatch.syspath_prepend(EXAMPLES)
    # (LRU: with one slot its cache follows the latest expert, so MTP's drafts visibly move what the plugin sees;
    # under the default LFU this prompt's 16 tokens happen to come out the same)
    r = ev.check_contract(None, dict(cache_cap=1, cache_policy="lru", plugins=["my_plugins:prefer_resident"]),
                          "ROMEO:\n", 16)
    assert not r["identical"] and r["first_diff"] is not None
    assert r["mtp_acceptance"] > 0 and r["experts_dropped"] > 0
    [p] = r["plugins"]
    assert p["kind"] == "cache-dependent" and not p["mtp_safe"]
    assert "FAIL" in ev.contract_report(r) and "expected" in ev.contract_report(r)

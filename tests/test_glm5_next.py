"""glm5_next (GLM-5.3 text) against transformers' golden fixture (tools/fixtures/make_golden_glm5_next.py), and the
KDA forms against each other."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from glm_jax.experts.glm5_next_weights import load_params
from glm_jax.model import dsa_pool, glm5_next, kda
from glm_jax.model.config import config_from_dict, load_config

FIX = os.path.join(os.path.dirname(__file__), "golden", "glm5next")
TOL = 1e-4


@functools.lru_cache(maxsize=None)
def _model():
    cfg = load_config(FIX)
    return cfg, load_params(FIX, cfg), jax.jit(functools.partial(glm5_next.step, cfg))


def _expected():
    with np.load(os.path.join(FIX, "expected.npz")) as z:
        return {k: z[k] for k in z.files}


S, T = 32, 12     # one cache length and one prefill width for every test: one compile each


def _prefill(ids):
    """ids (at most T tokens) padded to T, as the runner pads a prefill chunk."""
    cfg, params, f = _model()
    cache = glm5_next.init_cache(cfg, 1, S, jnp.float32)
    n = len(ids)
    toks = np.zeros((1, T), np.int32)
    toks[0, :n] = ids
    logits, _, cache, _ = f(params, cache, jnp.asarray(toks), jnp.zeros((1,), jnp.int32), jnp.asarray([n]))
    return np.asarray(logits[0, :n]), cache


def test_logits_match_transformers():
    z = _expected()
    for b in range(2):
        logits, _ = _prefill(z["input_ids"][b])
        assert np.abs(logits - z["logits"][b]).max() <= TOL, b


def test_prefill_state_matches_transformers():
    z = _expected()
    cfg = _model()[0]
    _, cache = _prefill(z["input_ids"][0])
    for i, t in enumerate(cfg.layer_types):
        if t != "linear_attention":
            assert "ckv" in cache[i]
            continue
        assert np.abs(np.asarray(cache[i]["rec"]) - z[f"kda_rec_{i}"]).max() <= 1e-5
        conv = z[f"kda_conv_{i}"][:, :, 1:].transpose(0, 2, 1)          # transformers keeps K inputs, we K-1
        assert np.abs(np.asarray(cache[i]["conv"]) - conv).max() <= 1e-5


def test_greedy_matches_transformers():
    """Chunked prefill of the prompt (padded: the padding leaves the KDA states alone), then one recurrent step a
    token: transformers' greedy tokens, and each step's logits those of its full forward over prompt + tokens."""
    z = _expected()
    cfg, params, f = _model()
    prompt, want = z["greedy_prompt"], z["greedy_tokens"]
    P = len(prompt)
    logits, cache = _prefill(prompt)
    got, rows = [], [logits]
    for i in range(len(want)):
        got.append(int(np.argmax(rows[-1][-1])))
        lg, _, cache, _ = f(params, cache, jnp.asarray([[got[-1]]]), jnp.asarray([P + i], jnp.int32))
        rows.append(np.asarray(lg[0]))
    assert got == want.tolist()
    all_logits = np.concatenate(rows)[:P + len(want)]
    assert np.abs(all_logits - z["greedy_logits"]).max() <= TOL


def test_fixture_exercises_the_clamp_and_sparse_pools():
    with open(os.path.join(FIX, "expected.json")) as fh:
        doc = json.load(fh)
    cfg = _model()[0]
    assert doc["max_routed_gate_up_abs"] < cfg.swiglu_limit < doc["max_clamped_mlp_gate_up"]
    assert doc["min_pool_topk_relative_gap"] > 1e-5 and doc["pool_topk_queries_checked"] > 0
    assert cfg.hc_mult == 4 and set(cfg.layer_types) == {"linear_attention", "indexed_attention"}
    assert [cfg.indexer_types[i] for i, t in enumerate(cfg.layer_types) if t == "indexed_attention"] == [
        "full", "shared"]


def _kda_inputs(B=2, T=11, nh=2, dk=4, seed=0):
    r = np.random.default_rng(seed)
    q = kda.l2norm(jnp.asarray(r.normal(size=(B, T, nh, dk)), jnp.float32)) * dk ** -0.5
    k = kda.l2norm(jnp.asarray(r.normal(size=(B, T, nh, dk)), jnp.float32))
    v = jnp.asarray(r.normal(size=(B, T, nh, dk)), jnp.float32)
    g = jnp.asarray(-5.0 * r.uniform(size=(B, T, nh, dk)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, nh)), jnp.float32)
    s0 = jnp.asarray(r.normal(size=(B, nh, dk, dk)), jnp.float32)
    return q, k, v, g, beta, s0


def test_kda_chunked_equals_recurrent():
    q, k, v, g, beta, s0 = _kda_inputs()
    o_r, s_r = jax.jit(kda.recurrent)(q, k, v, g, beta, s0)
    for chunk in (4, 64):                       # several chunks with a padded last one; one chunk
        o_c, s_c = jax.jit(kda.chunked, static_argnums=6)(q, k, v, g, beta, s0, chunk)
        assert np.abs(np.asarray(o_c - o_r)).max() < 1e-5
        assert np.abs(np.asarray(s_c - s_r)).max() < 1e-5
    # the state after a prefill equals the state after stepping the same tokens one by one
    s, one = s0, jax.jit(kda.recurrent)
    for t in range(q.shape[1]):
        o_t, s = one(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], s)
        assert np.abs(np.asarray(o_t[:, 0] - o_r[:, t])).max() < 1e-5
    assert np.abs(np.asarray(kda.chunked(q, k, v, g, beta, s0, 4)[1] - s)).max() < 1e-5


def test_kda_layer_padding_and_steps():
    """The fixture's first KDA layer on random inputs: a padded chunked prefill (row 1: 6 real tokens of 9) equals
    stepping the recurrent form a token at a time, where a padding step leaves a row's conv and delta states alone."""
    cfg, params, _ = _model()
    p = params["layers"][0]["kda"]
    attn = jax.jit(functools.partial(kda.kda_attention, cfg))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, cfg.hidden_size)), jnp.float32)
    n = jnp.asarray([9, 6])
    out, s_pad = attn(p, x, kda.init_kda_state(cfg, 2), jnp.arange(9)[None, :] < n[:, None])
    st, steps = kda.init_kda_state(cfg, 2), []
    for t in range(9):
        o, st = attn(p, x[:, t:t + 1], st, (t < n)[:, None])
        steps.append(o)
        if t == 5:
            six = st
    assert np.abs(np.asarray(jnp.concatenate(steps, 1)[:, :6] - out[:, :6])).max() < 1e-5
    assert np.abs(np.asarray(steps[8][0] - out[0, 8])).max() < 1e-5
    for key in ("conv", "rec"):
        assert np.abs(np.asarray(st[key] - s_pad[key])).max() < 1e-5
        assert np.array_equal(np.asarray(st[key][1]), np.asarray(six[key][1]))      # padding: untouched


def test_pooled_selection_structure():
    """Each query: min(index_topk / kp, complete visible pools) whole pools, plus its incomplete tail."""
    cfg, params, _ = _model()
    kp, k_pools = cfg.index_kpool, cfg.index_topk // cfg.index_kpool
    ip = params["layers"][1]["attn"]["indexer"]
    B, S = 1, 23
    r = np.random.default_rng(2)
    x = jnp.asarray(r.normal(size=(B, S, cfg.hidden_size)), jnp.float32)
    cache = {"idx_k": jnp.asarray(r.normal(size=(B, S, cfg.index_head_dim)), jnp.float32),
             "idx_g": jnp.asarray(r.normal(size=(B, S, cfg.index_head_dim)), jnp.float32)}
    q_resid = jnp.asarray(r.normal(size=(B, S, cfg.q_lora_rank)), jnp.float32)
    sel = np.asarray(dsa_pool.select(cfg, ip, x, q_resid, cache, jnp.arange(S)[None]))[0]
    assert sel.shape == (S, cfg.index_topk + kp - 1)
    for t in range(S):
        picked = sorted(int(j) for j in sel[t] if j >= 0)
        tail = list(range(t + 1 - (t + 1) % kp, t + 1))
        pools = [j for j in picked if j not in tail]
        assert set(tail) <= set(picked) and len(pools) == kp * min(k_pools, (t + 1) // kp)
        assert all(j <= t for j in picked) and len(set(picked)) == len(picked)
        assert all(pools[i] % kp == 0 and pools[i:i + kp] == list(range(pools[i], pools[i] + kp))
                   for i in range(0, len(pools), kp))


def test_pooled_attention_gathered_equals_masked():
    """The gathered selection (decode, short chunks) and the masked dense scores (long prefill chunks) agree, on
    the full and the shared layer of the fixture, with padding-free random inputs at positions 5.. of a cache."""
    cfg, params, _ = _model()
    r = np.random.default_rng(3)
    x = jnp.asarray(r.normal(size=(1, 20, cfg.hidden_size)), jnp.float32)
    cache = dsa_pool.init_pooled_cache(cfg, True, 1, S, jnp.float32)
    cache = {k: jnp.asarray(r.normal(size=v.shape), jnp.float32) for k, v in cache.items()}
    start = jnp.asarray([5], jnp.int32)
    run = jax.jit(functools.partial(dsa_pool.pooled_attention, cfg), static_argnames=("full", "gather"))
    outs = {}
    for g in (True, False):
        o1, _, sel = run(params["layers"][1]["attn"], x, cache, start, full=True, gather=g)
        o2, _, _ = run(params["layers"][2]["attn"], x, cache, start, full=False, prev_sel=sel, gather=g)
        outs[g] = (o1, o2)
    assert dsa_pool.use_gather(cfg, 20, sel.shape[-1], S) and not dsa_pool.use_gather(cfg, 20, S, S)
    for a, b in zip(outs[True], outs[False]):
        assert np.abs(np.asarray(a - b)).max() < 1e-5


def test_flat_checkpoint_loads(tmp_path):
    """A flat text-only checkpoint (text fields at the top of config.json, keys under model.) loads the same."""
    cfg, params, _ = _model()
    with open(os.path.join(FIX, "config.json")) as fh:
        raw = json.load(fh)
    flat = dict(raw["text_config"], model_type="glm5_next")
    with open(tmp_path / "config.json", "w") as fh:
        json.dump(flat, fh)
    t = load_file(os.path.join(FIX, "model.safetensors"))
    save_file({k.replace("model.language_model.", "model."): v for k, v in t.items() if "visual" not in k},
              str(tmp_path / "model.safetensors"))
    cfg2 = load_config(str(tmp_path))
    assert cfg2 == config_from_dict(raw, str(tmp_path / "config.json"))
    p2 = load_params(str(tmp_path), cfg2)
    a, b = jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(p2)
    assert len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    shutil.rmtree(tmp_path)


def test_missing_key_names_it(tmp_path):
    from glm_jax.experts.tensors import WeightError
    t = load_file(os.path.join(FIX, "model.safetensors"))
    t.pop("model.language_model.layers.0.self_attn.k_conv1d.weight")
    save_file(t, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(FIX, "config.json"), tmp_path / "config.json")
    with pytest.raises(WeightError, match="layers.0.self_attn.k_conv1d.weight"):
        load_params(str(tmp_path), load_config(str(tmp_path)))


CLAMP = os.path.join(os.path.dirname(__file__), "golden", "glm5next_clamp")


@pytest.mark.parametrize("kernel", ["xla", "native"])
def test_routed_clamp_matches_transformers(kernel, monkeypatch):
    """The fixture whose routed experts' gate and |up| exceed swiglu_limit (expected.json): the seam's clamp gives
    transformers' logits on the XLA and the native backend; the same forward with the routed clamp dropped misses
    them by far more than the tolerance (the clamp acts there)."""
    from glm_jax import kernels
    if kernel == "native" and not kernels.load():
        pytest.skip(f"native kernels unavailable: {kernels.last_error()}")
    cfg = load_config(CLAMP)
    with open(os.path.join(CLAMP, "expected.json")) as f:
        doc = json.load(f)
    assert min(doc["max_routed_gate"], doc["max_routed_up_abs"]) > cfg.swiglu_limit
    with np.load(os.path.join(CLAMP, "expected.npz")) as z:
        ids, want = z["input_ids"], z["logits"]
    params = load_params(CLAMP, cfg, kernel=kernel)

    def logits():
        f = jax.jit(functools.partial(glm5_next.step, cfg))
        out = []
        for b in range(2):
            cache = glm5_next.init_cache(cfg, 1, S, jnp.float32)
            lg = f(params, cache, jnp.asarray(ids[b:b + 1]), jnp.zeros((1,), jnp.int32))[0]
            out.append(np.asarray(lg[0]))
        return np.stack(out)

    assert np.abs(logits() - want).max() <= TOL
    seam = glm5_next.moe_routed
    monkeypatch.setattr(glm5_next, "moe_routed", lambda *a, limit=None, **kw: seam(*a, **kw))
    assert np.abs(logits() - want).max() > 100 * TOL

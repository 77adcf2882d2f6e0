"""glm_jax.mla (MLA + DSA indexer) against transformers oracle outputs saved in tests/golden/dsa_*/ (no torch here)."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from glm_jax.model import mla
from glm_jax.model.config import config_from_dict, load_config

jax.config.update("jax_enable_x64", False)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
FIXTURES = ["dsa_dense", "dsa_sparse"]
S_MAX = 16          # > T = 12: slots past the current length hold zeros / stale data and must be masked
TOL = 1e-4


class _Fix:
    def __init__(self, name):
        d = os.path.join(GOLDEN, name)
        self.cfg = load_config(d)
        self.w = load_file(os.path.join(d, "model.safetensors"))
        self.exp = dict(np.load(os.path.join(d, "expected.npz")))

    def get(self, key, shape=None):
        if key not in self.w:
            raise KeyError(f"missing tensor {key!r} (expected shape {shape})")
        a = self.w[key]
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise ValueError(f"tensor {key!r} has shape {a.shape}, expected {shape}")
        return a

    def params(self, layer):
        p = mla.load_mla_params(self.get, f"model.layers.{layer}.self_attn.", self.cfg, layer)
        return jax.tree.map(jnp.asarray, p)


_CACHE = {}


def fix(name):
    if name not in _CACHE:
        _CACHE[name] = _Fix(name)
    return _CACHE[name]


def _caches(cfg, B, S=S_MAX):
    return [mla.init_mla_cache(cfg, l, B, S, jnp.float32) for l in range(cfg.num_hidden_layers)]


@functools.lru_cache(maxsize=None)
def _jitted(cfg_id, layer, absorbed, dense_shortcut):
    cfg = _CFGS[cfg_id]
    return jax.jit(lambda p, x, c, st, ps: mla.mla_attention(cfg, p, x, c, st, layer, ps, absorbed=absorbed,
                                                             dense_shortcut=dense_shortcut))


_CFGS = {}


def attn(cfg, p, x, cache, start, layer, prev_sel=None, absorbed=True, dense_shortcut=True):
    """jitted mla.mla_attention (one compile per config / layer / flags / shapes)."""
    _CFGS[id(cfg)] = cfg
    return _jitted(id(cfg), layer, absorbed, dense_shortcut)(p, x, cache, start, prev_sel)


def _run_layers(f, xs, starts, caches, **kw):
    """Run every layer's attention on its own oracle input xs[l] [B,T,H]; returns outs [L], sels [L], caches."""
    outs, sels, new = [], [], []
    sel = None
    for l in range(f.cfg.num_hidden_layers):
        o, c, sel = attn(f.cfg, f.params(l), xs[l], caches[l], starts, l, sel, **kw)
        outs.append(o)
        sels.append(sel)
        new.append(c)
    return outs, sels, new


def _visible_set(sel_row, t):
    return sorted(int(j) for j in np.asarray(sel_row) if j <= t)


# ----------------------------------------------------------------------------- oracle parity, one layer at a time
@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("absorbed", [True, False])
def test_attention_matches_transformers(name, absorbed):
    f = fix(name)
    e = f.exp
    L = f.cfg.num_hidden_layers
    for b in range(2):
        xs = [jnp.asarray(e["attn_in"][b, l][None]) for l in range(L)]
        outs, sels, _ = _run_layers(f, xs, jnp.zeros((1,), jnp.int32), _caches(f.cfg, 1), absorbed=absorbed,
                                    dense_shortcut=False)
        T = xs[0].shape[1]
        for l in range(L):
            np.testing.assert_allclose(np.asarray(outs[l][0]), e["attn_out"][b, l], atol=TOL, rtol=0,
                                       err_msg=f"{name} row {b} layer {l}")
            for t in range(T):
                want = sorted(int(j) for j in e["attn_topk"][b, l, t] if j >= 0)
                assert _visible_set(sels[l][0, t], t) == want, (name, b, l, t)


def test_dense_shortcut_equals_indexer_path():
    f = fix("dsa_dense")
    e = f.exp
    xs = [jnp.asarray(e["attn_in"][:, l]) for l in range(f.cfg.num_hidden_layers)]
    z = jnp.zeros((2,), jnp.int32)
    a, sa, ca = _run_layers(f, xs, z, _caches(f.cfg, 2), dense_shortcut=True)
    b_, sb, cb = _run_layers(f, xs, z, _caches(f.cfg, 2), dense_shortcut=False)
    assert sa[0] is None and sb[0].shape == (2, 12, S_MAX)
    for x, y in zip(a, b_):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    for x, y in zip(ca, cb):
        for k in x:
            np.testing.assert_array_equal(np.asarray(x[k]), np.asarray(y[k]))


# ----------------------------------------------------------------------------- prefill + decode == one call
@pytest.mark.parametrize("name", FIXTURES)
def test_prefill_then_decode_equals_full(name):
    """Row 0: prefill 5, a chunk of 3, then single-token steps.  Row 1 rides along with a shorter history: its first
    call writes 5 tokens of which only 3 are real (the rest are stale garbage later overwritten), then it decodes with
    its own start.  Every produced output must equal the one-call output at that position."""
    f = fix(name)
    e = f.exp
    L, T = f.cfg.num_hidden_layers, e["attn_in"].shape[2]
    X = e["attn_in"]                                             # [2,L,T,H]
    full, fsel, _ = _run_layers(f, [jnp.asarray(X[:, l]) for l in range(L)], jnp.zeros((2,), jnp.int32),
                                _caches(f.cfg, 2))
    full = [np.asarray(o) for o in full]

    caches = _caches(f.cfg, 2)
    jit_layers = jax.jit(lambda xs, st, cs: _run_layers(f, xs, st, cs))
    pos = np.array([0, 0])
    lens = [(5, 3), (3, 2), (1, 1), (1, 1), (1, 1), (1, 1)]   # (tokens written, real tokens for row 1)
    while pos[0] < T:
        n = lens.pop(0) if lens else (1, 1)
        n_w, n1 = n
        xs = []
        for l in range(L):
            r0 = X[0, l, pos[0]:pos[0] + n_w]
            r1 = X[1, l, pos[1]:pos[1] + n_w]
            if r1.shape[0] < n_w:
                r1 = np.concatenate([r1, np.zeros((n_w - r1.shape[0], r1.shape[1]), r1.dtype)])
            r1 = r1.copy()
            r1[n1:] = 123.0 * (l + 1)                             # garbage past row 1's real tokens
            xs.append(jnp.asarray(np.stack([r0, r1])))
        outs, _, caches = jit_layers(xs, jnp.asarray(pos, jnp.int32), caches)
        for l in range(L):
            o = np.asarray(outs[l])
            np.testing.assert_allclose(o[0], full[l][0, pos[0]:pos[0] + n_w], atol=TOL, err_msg=f"row0 l{l} @{pos[0]}")
            k1 = min(n1, T - pos[1])
            np.testing.assert_allclose(o[1, :k1], full[l][1, pos[1]:pos[1] + k1], atol=TOL,
                                       err_msg=f"row1 l{l} @{pos[1]}")
        pos = pos + np.array([n_w, n1])


def test_sparse_fixture_is_really_sparse():
    """index_topk=4 < S: late queries select 4 of their visible keys, and outputs differ from dense attention."""
    f = fix("dsa_sparse")
    e = f.exp
    assert f.cfg.index_topk == 4 and f.cfg.indexer_types == ("full", "shared", "full", "full")
    topk = e["attn_topk"]
    assert topk.shape[-1] == 4 and (topk[:, :, -1] >= 0).all()
    x = jnp.asarray(e["attn_in"][:, 0])
    p = f.params(0)
    c = mla.init_mla_cache(f.cfg, 0, 2, S_MAX, jnp.float32)
    sparse, _, sel = attn(f.cfg, p, x, c, jnp.zeros((2,), jnp.int32), 0, None)
    shared_dense, _, _ = attn(f.cfg, f.params(1), jnp.asarray(e["attn_in"][:, 1]),
                                           mla.init_mla_cache(f.cfg, 1, 2, S_MAX, jnp.float32),
                                           jnp.zeros((2,), jnp.int32), 1, None)
    assert sel.shape == (2, 12, 4)
    assert np.abs(np.asarray(shared_dense) - e["attn_out"][:, 1]).max() > 1e-3   # prev_sel matters


# ----------------------------------------------------------------------------- params, cache, sizes
def test_params_and_cache_layout():
    f = fix("dsa_dense")
    cfg = f.cfg
    for l in range(cfg.num_hidden_layers + 1):                   # + the MTP layer (index L): full indexer
        p = f.params(l)
        full = mla.indexer_type(cfg, l) == "full"
        assert ("indexer" in p) == full
        assert set(p) >= {"q_a_w", "q_a_norm", "q_b_w", "kv_a_w", "kv_a_norm", "kv_b_w", "o_w"}
        c = mla.init_mla_cache(cfg, l, 2, 7, jnp.bfloat16)
        assert c["ckv"].shape == (2, 7, cfg.kv_lora_rank) and c["kpe"].shape == (2, 7, cfg.qk_rope_head_dim)
        assert ("idx_k" in c) == full
        if full:
            assert p["indexer"]["weights_proj"].dtype == jnp.float32
    assert mla.indexer_type(cfg, cfg.num_hidden_layers) == "full"
    with pytest.raises(KeyError):
        mla.load_mla_params(f.get, "model.layers.1.self_attn.", dataclasses.replace(cfg, indexer_types=("full",) * 4), 1)


def test_norm_eps_is_1e6_not_rms_norm_eps():
    assert mla.MLA_NORM_EPS == 1e-6 and mla.INDEXER_LN_EPS == 1e-6


def _glm5_cfg(**over):
    raw = dict(model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
               moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64,
               n_routed_experts=256, num_experts_per_tok=8, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
               qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32)
    raw.update(over)
    return config_from_dict(raw, "glm5.json")


def test_kv_bytes_per_token_glm5():
    cfg = _glm5_cfg()
    kb = mla.kv_bytes_per_token(cfg, 2)
    assert kb["per_layer_shared"] == (512 + 64) * 2 == 1152
    assert kb["per_layer_full"] == (512 + 64 + 128) * 2 == 1408
    assert kb["per_layer_uncompressed"] == 64 * (256 + 256) * 2 == 65536
    assert all(t == "full" for t in cfg.indexer_types)
    assert kb["model_total"] == 78 * 1408
    assert kb["model_total_uncompressed"] == 78 * 65536
    # with a shared-indexer pattern only the full layers pay for indexer keys
    cfg2 = _glm5_cfg(indexer_types=["full" if i in {0, 1, 2, *range(6, 78, 4)} else "shared" for i in range(78)])
    assert mla.kv_bytes_per_token(cfg2, 2)["model_total"] == 78 * 1152 + 21 * 256


def test_cache_bytes_match_kv_bytes_per_token():
    cfg = fix("dsa_sparse").cfg
    kb = mla.kv_bytes_per_token(cfg, 4)
    tot = 0
    for l in range(cfg.num_hidden_layers):
        c = mla.init_mla_cache(cfg, l, 1, 1, jnp.float32)
        tot += sum(a.size * a.dtype.itemsize for a in c.values())
    assert tot == kb["model_total"]


def test_softmax_scale_yarn():
    f = fix("dsa_sparse")
    rp = f.cfg.rope_parameters
    assert rp["rope_type"] == "yarn"
    m = 0.1 * rp["mscale_all_dim"] * np.log(rp["factor"]) + 1.0
    assert mla.softmax_scale(f.cfg) == pytest.approx(24 ** -0.5 * m * m)
    assert mla.softmax_scale(fix("dsa_dense").cfg) == pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("name", FIXTURES)
def test_mtp_layer_attention(name):
    """The MTP layer (index L) runs its own full indexer.  HF places its T-1 tokens at positions 1..T-1; only relative
    positions matter, so slots/positions 0..T-2 (start=0) agree within f32 rounding.  (A start of 1 over an empty
    slot 0 would attend to that zero slot: the MTP cache must be filled from slot 0.)"""
    f = fix(name)
    e = f.exp
    L = f.cfg.num_hidden_layers
    x = jnp.asarray(e["mtp_attn_in"][None])
    c = mla.init_mla_cache(f.cfg, L, 1, S_MAX, jnp.float32)
    assert "idx_k" in c
    out, _, sel = attn(f.cfg, f.params(L), x, c, jnp.zeros((1,), jnp.int32), L, None, dense_shortcut=False)
    np.testing.assert_allclose(np.asarray(out[0]), e["mtp_attn_out"], atol=TOL, rtol=0)
    for t in range(x.shape[1]):
        want = sorted(int(j) for j in e["mtp_attn_topk"][t] if j >= 0)
        assert _visible_set(sel[0, t], t) == want


def test_bf16_runs_and_is_close():
    f = fix("dsa_sparse")
    e = f.exp
    p = jax.tree.map(lambda a: a if a.dtype == jnp.float32 and a.ndim == 2 and a.shape[0] == f.cfg.index_n_heads
                     else a.astype(jnp.bfloat16), f.params(0))
    c = mla.init_mla_cache(f.cfg, 0, 2, S_MAX, jnp.bfloat16)
    out, c2, sel = attn(f.cfg, p, jnp.asarray(e["attn_in"][:, 0], jnp.bfloat16), c, jnp.zeros((2,), jnp.int32), 0)
    assert out.dtype == jnp.bfloat16 and c2["ckv"].dtype == jnp.bfloat16 and sel.dtype == jnp.int32
    assert float(jnp.abs(out.astype(jnp.float32) - e["attn_out"][:, 0]).max()) < 0.1


# ----------------------------------------------------------------------------- DSA: gathered top-k == dense mask
@functools.lru_cache(maxsize=None)
def _gather_jit(layer, gather):
    cfg = fix("dsa_sparse").cfg
    return jax.jit(lambda p, x, c, st, ps: mla.mla_attention(cfg, p, x, c, st, layer, ps, gather=gather))


def test_sparse_gather_equals_dense_masked():
    """The O(k) path (gather the selected keys) and the O(S) path (mask the dense scores with the selection) give
    the same outputs, selections and caches: a 12-token prefill, then decode steps, on the top-k=4 fixture with a
    cache longer than the sequence (stale slots must stay invisible)."""
    f = fix("dsa_sparse")
    e = f.exp
    cfg = f.cfg
    assert mla.topk_count(cfg, S_MAX) < S_MAX and mla.use_gather(cfg, 12, 4, S_MAX)
    res = {}
    for gather in (True, False):
        rng = np.random.default_rng(0)
        caches = _caches(cfg, 2)
        xs = [jnp.asarray(e["attn_in"][:, l]) for l in range(cfg.num_hidden_layers)]
        steps = [(xs, jnp.zeros((2,), jnp.int32))]
        for t in range(3):
            steps.append(([jnp.asarray(rng.standard_normal((2, 1, cfg.hidden_size)), jnp.float32)
                           for _ in range(cfg.num_hidden_layers)], jnp.asarray([12 + t, 9 + t], jnp.int32)))
        outs = []
        for xs_, st in steps:
            sel = None
            new = []
            for l in range(cfg.num_hidden_layers):
                o, c, sel = _gather_jit(l, gather)(f.params(l), xs_[l], caches[l], st, sel)
                outs.append((np.asarray(o), None if sel is None else np.asarray(sel)))
                new.append(c)
            caches = new
        res[gather] = (outs, caches)
    for (oa, sa), (ob, sb) in zip(res[True][0], res[False][0]):
        np.testing.assert_allclose(oa, ob, atol=2e-6, rtol=0)
        np.testing.assert_array_equal(sa, sb)
    for ca, cb in zip(res[True][1], res[False][1]):
        for k in ca:
            np.testing.assert_array_equal(np.asarray(ca[k]), np.asarray(cb[k]))


def test_use_gather_decision():
    cfg = fix("dsa_sparse").cfg
    assert not mla.use_gather(cfg, 1, 16, 16)                    # k == S: nothing to skip
    assert mla.use_gather(cfg, 1, 2048, 65536)
    big = dataclasses.replace(cfg, kv_lora_rank=512, qk_rope_head_dim=64)
    assert mla.use_gather(big, 1, 2048, 65536)                   # decode at GLM-5 widths
    assert not mla.use_gather(big, 512, 2048, 65536)             # a 512-token prefill chunk: dense masked


def test_mla_linears_stay_quantized_in_memory(tmp_path):
    """Real scale found it (docs/real-scale.md, GLM-5.2 slice): every MLA matrix was dequantized to f32 at load
    ("reshaped for absorption: always float"), so an int4 container's 0.37 GB of non-expert weights took 1.56 GB
    resident at H 6144 (o_proj alone 4x its bf16 size; ~50 GB for GLM-5.2's 78 layers).  Only kv_b is reshaped
    for absorption: q_a, q_b, kv_a and o are plain linears and now stay as stored (int8 here), through the native
    kernels; the memory plan counts them so; the output stays as close to the reference as before (top-1 0.92,
    median |error| 0.025 vs 0.026 with every MLA matrix dequantized)."""
    import glm_jax
    from glm_jax import fit
    from glm_jax.experts.convert import convert
    from glm_jax.kernels import formats as Q

    if not glm_jax.kernels.load():
        pytest.skip("native kernels unavailable")
    src = os.path.join(os.path.dirname(__file__), "golden", "dsa_sparse")
    exp = dict(np.load(os.path.join(src, "expected.npz")))
    dst = str(tmp_path / "dsa4")
    convert(src, dst, expert_format="int8_row", mtp_format="int8_row", dense_format="int8", progress=False)
    # the K/V cache as transformers keeps it (f32): what is measured is the quantized linears' error alone
    eng = glm_jax.Engine.load(dst, fetch="resident", kv_cache_dtype="float32")
    try:
        a = eng.params["layers"][0]["attn"]
        assert {k for k in Q.MLA_LINEARS if k in a} == {"q_a_w", "q_b_w", "kv_a_w", "o_w"}   # q LoRA: no q_proj_w
        for k in ("q_a_w", "q_b_w", "kv_a_w", "o_w"):
            assert isinstance(a[k], Q.QWeight) and a[k].fmt == "int8_row", (k, type(a[k]))
        # the indexer's projections stay float: int8 activations there flipped top-k picks (top-1 0.92 -> 0.67)
        assert "indexer" in a and not any(isinstance(a["indexer"][k], Q.QWeight) for k in ("wq_b", "wk"))
        # kv_b: split once at load into the absorbed per-head W_UK^T / W_UV (no per-step slice copies), each in
        # q_b's format on the grouped native kernel (GLM-5.2 slice: 5.2 of ~20 ms a token were these two and the
        # indexer in f32); one group's matrix is [kv_lora, nope] / [v, kv_lora], the heads its leading axis
        c = eng.cfg
        assert "kv_b_w" not in a
        assert isinstance(a["w_uk_t"], Q.QWeight) and a["w_uk_t"].fmt == "int8_row"
        assert a["w_uk_t"].shape == (c.kv_lora_rank, c.qk_nope_head_dim) and a["w_uk_t"].q.shape[0] == c.num_attention_heads
        assert isinstance(a["w_uv"], Q.QWeight) and a["w_uv"].shape == (c.v_head_dim, c.kv_lora_rank)
        got = eng.logits(exp["input_ids"][0].tolist())
        ref = exp["logits"][0]
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9 and np.median(np.abs(got - ref)) < 0.05
        # the memory plan's dense bytes: int8 matrices counted at their stored size (plus scales), not as f32
        tensors = fit.header_tensors(dst)
        planned, _ = fit.dense_bytes(tensors, eng.cfg, "native", packed=True)
        o_key = next(k for k, dt, sh in tensors if k.endswith("layers.0.self_attn.o_proj.weight"))
        assert dict((k, dt) for k, dt, _ in tensors)[o_key] == "int8"
        f32_all = sum(int(np.prod(sh)) * 4 for k, _, sh in tensors if k.endswith(".weight") and len(sh) == 2)
        assert planned < 0.6 * f32_all
    finally:
        eng.close()

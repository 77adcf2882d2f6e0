"""int4 groups that do not divide the row (issue 15 item 9): the last group of a row is shorter.

The reference for a row of n = 96 with G = 64 is two independent int4_row quantizations of its two slices ([:64] and
[64:96]): a group is a row of its own.  The numpy quantize/dequantize, quantized_nbytes, the record layout, the in-jit
dequantize and take_dot must all agree with it; a checkpoint with hidden_size 96 converts to int4_g64 (and runs: the
fuzz test's pristine container is exactly that, and its forward is checked there, to compile one engine less)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.experts.container import make_layout
from glm_jax.kernels import formats as quant
from glm_jax.model import moe

O, N, G = 12, 96, 64


def _w(seed=0, shape=(O, N)):
    return (np.random.default_rng(seed).normal(size=shape) * 0.1).astype(np.float32)


def test_shorter_last_group_equals_two_row_quantizations():
    w = _w()
    q, s = quant.quantize(w, "int4_g64")
    assert q.shape == (O, N // 2) and s.shape == (O, 2)
    # a slice no longer than G is one group (int4_g's f16 scales; int4_row keeps f32 ones)
    ref = np.concatenate([quant.dequantize(*quant.quantize(w[:, :G], "int4_g64"), "int4_g64"),
                          quant.dequantize(*quant.quantize(w[:, G:], "int4_g64"), "int4_g64")], axis=1)
    r = np.concatenate([quant.quantize(w[:, :G], "int4_row")[1], quant.quantize(w[:, G:], "int4_row")[1]], axis=1)
    np.testing.assert_array_equal(s, quant._f16_up(r, "int4_g64"))
    np.testing.assert_array_equal(quant.dequantize(q, s, "int4_g64"), ref)
    assert quant.quantized_nbytes(O, N, "int4_g64") == q.nbytes + s.nbytes
    lay = make_layout("int4_g64", N, 80)       # gate_up rows of 96 (2 groups), down rows of 80 (2 groups: 64 + 16)
    # records hold the tiles layout: scales [row tiles of 16, groups, 16]
    assert lay.section("gate_up_scale").shape == (10, 2, 16) and lay.section("down_scale").shape == (N // 16, 2, 16)


def test_dividing_groups_scales_are_the_f16_at_or_above_amax_over_7():
    """Where G divides the row: s = amax / 7 rounded up to an f16 (so |w| / s <= 7: nothing clipped beyond the int4
    rounding), the f16 below it under amax / 7; f32 scales of data written before (older containers) are
    read as they are."""
    w = _w(1, (O, 128))
    q, s = quant.quantize(w, "int4_g64")
    a = np.abs(w.reshape(O, 2, 64)).max(-1)
    want = np.where(a > 0, a / 7, 1).astype(np.float32)
    assert s.dtype == np.float16 and np.all(s.astype(np.float32) >= want)
    below = np.nextafter(s, np.float16(0)).astype(np.float32)
    assert np.all(below < want)
    vals = quant.dequantize(q, s, "int4_g64")
    assert np.abs(vals - w).max() <= s.astype(np.float32).max() / 2 + 1e-7
    np.testing.assert_array_equal(quant.dequantize(q, want, "int4_g64"),
                                  ((((q[..., None] >> np.array([0, 4])) & 15).reshape(O, 128).astype(np.float32) - 8)
                                   .reshape(O, 2, 64) * want[..., None]).reshape(O, 128))
    with pytest.raises(quant.FormatError, match="f16"):
        quant.quantize(np.full((1, 64), 1e6, np.float32), "int4_g64")


def test_in_jit_paths_agree_with_numpy():
    w = _w(2, (3, O, N))                                   # [S, out, in] like a bank
    q, s = quant.quantize(w, "int4_g64")
    ref = quant.dequantize(q, s, "int4_g64")
    got = np.asarray(jax.jit(lambda a, b: quant.dequant_jax(a, b, "int4_g64", jnp.float32))(q, s))
    np.testing.assert_array_equal(got, ref)
    bank = quant.ExpertBank(jnp.asarray(q), jnp.asarray(q[:, :, :N // 2]), jnp.asarray(s), jnp.asarray(s),
                            fmt="int4_g64")
    slots = jnp.asarray([[0, 2], [1, 0]], jnp.int32)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 1, N)).astype(np.float32))
    out = np.asarray(jax.jit(lambda b, sl, xx: moe.take_dot(b, "gate_up", sl, xx))(bank, slots, x))
    want = np.einsum("tkoh,th->tko", ref[np.asarray(slots)], np.asarray(x)[:, 0])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_odd_rows_fall_back_to_int8_row_and_say_so():
    assert quant.fit_format("int4_g64", 96, 64) == ("int4_g64", "")
    fmt, note = quant.fit_format("int4_g64", 96, 33)
    assert fmt == "int8_row" and "int8_row" in note and "33" in note
    for bad in ("int4_g0", "int4_g7", "int3", "int4_g-2"):
        with pytest.raises(quant.FormatError):
            quant.parse_format(bad)


def test_the_moe_seam_on_shorter_groups_matches_numpy():
    """moe_routed (both paths) on an int4_g64 bank with rows of 96 (gate/up) and 80 (down) vs float64 numpy."""
    from glm_jax import model as M
    rng = np.random.default_rng(5)
    E, H, I, T, K = 4, 96, 80, 5, 2
    gu, dn = _w(6, (E, 2 * I, H)), _w(7, (E, H, I))
    bank = quant.bank_from_float(gu, dn, "int4_g64")
    rgu = quant.dequantize(np.asarray(bank.gate_up), np.asarray(bank.gate_up_scale), "int4_g64").astype(np.float64)
    rdn = quant.dequantize(np.asarray(bank.down), np.asarray(bank.down_scale), "int4_g64").astype(np.float64)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    x = rng.normal(size=(T, H)).astype(np.float32)
    ref = np.zeros((T, H))
    for t in range(T):
        for k in range(K):
            h = rgu[ids[t, k]] @ x[t]
            ref[t] += w[t, k] * (rdn[ids[t, k]] @ (h[:I] / (1 + np.exp(-h[:I])) * h[I:]))
    f = jax.jit(M.moe_routed, static_argnames=("gather",))
    for gather in (True, False):
        out = np.asarray(f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), jnp.ones((T, K), bool), bank, None,
                           gather=gather))
        assert np.abs(out - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), gather


def test_a_hidden_96_checkpoint_converts_to_int4_g64(tmp_path):
    from glm_jax.experts.container import open_container
    from glm_jax.experts.convert import convert
    from glm_jax.model.config import load_config
    from tools.fixtures.synth_model import tiny_config, write_hf_checkpoint
    cfg = tiny_config(hidden_size=96, moe_intermediate_size=80, num_nextn_predict_layers=0, num_hidden_layers=2)
    src = str(tmp_path / "hf")
    ref = write_hf_checkpoint(src, cfg, seed=4)
    dst = str(tmp_path / "c")
    man = convert(src, dst, expert_format="int4_g64", progress=False)
    assert man["layers"]["1"]["format"] == "int4_g64" and man["group_size"] == 64
    c = open_container(dst, load_config(dst), verify="all")
    r = c.load_expert(1, 3)
    p = "model.layers.1.mlp.experts.3."
    gu = np.concatenate([ref[p + "gate_proj.weight"], ref[p + "up_proj.weight"]])
    np.testing.assert_array_equal(quant.dequantize(r["gate_up"], r["gate_up_scale"], "int4_g64"),
                                  quant.dequantize(*quant.quantize(gu, "int4_g64"), "int4_g64"))
    c.close()

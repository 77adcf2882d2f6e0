"""The MoE seam (model.moe_routed) on every bank format: both paths (gather for few tokens, every used slot for many)
against a numpy reference that dequantizes the same bank; the many-token path is independent of slot placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax import model as M
from glm_jax.kernels import formats as quant

E, H, I, T, K = 8, 128, 64, 12, 3


def _setup(fmt, seed=0):
    rng = np.random.default_rng(seed)
    gu = rng.normal(size=(E, 2 * I, H)).astype(np.float32) * 0.1
    dn = rng.normal(size=(E, H, I)).astype(np.float32) * 0.1
    bank = quant.bank_from_float(gu, dn, fmt)
    ids = np.stack([rng.choice(E - 2, K, replace=False) for _ in range(T)]).astype(np.int32)   # experts 6, 7 unused
    w = rng.random((T, K)).astype(np.float32)
    valid = rng.random((T, K)) > 0.2
    x = rng.normal(size=(T, H)).astype(np.float32)
    return bank, ids, w, valid, x


def _reference(bank, ids, w, valid, x):
    gu = quant.dequantize(np.asarray(bank.gate_up), None if bank.gate_up_scale is None
                          else np.asarray(bank.gate_up_scale), bank.fmt)
    dn = quant.dequantize(np.asarray(bank.down), None if bank.down_scale is None
                          else np.asarray(bank.down_scale), bank.fmt)
    out = np.zeros((T, H), np.float64)
    for t in range(T):
        for k in range(K):
            if valid[t, k]:
                e = ids[t, k]
                h = gu[e].astype(np.float64) @ x[t]
                a = h[:I] / (1 + np.exp(-h[:I])) * h[I:]
                out[t] += w[t, k] * (dn[e].astype(np.float64) @ a)
    return out


_routed = jax.jit(M.moe_routed, static_argnames=("gather",))


@pytest.mark.parametrize("fmt", ["int4_g64", "int4_row", "int8_row", "bf16", "f32"])
def test_both_paths_match_the_numpy_reference(fmt):
    bank, ids, w, valid, x = _setup(fmt)
    ref = _reference(bank, ids, w, valid, x)
    for gather in (True, False):
        out = np.asarray(_routed(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), jnp.asarray(valid), bank,
                                 None, gather=gather))
        assert np.abs(out - ref).max() < 1e-4 * max(1.0, np.abs(ref).max()), (fmt, gather)


@pytest.mark.parametrize("fmt", ["int4_g64", "f32"])
def test_many_token_path_ignores_slot_placement(fmt):
    """The same experts in other slots (another cache history): bitwise the same output."""
    bank, ids, w, valid, x = _setup(fmt, seed=1)
    perm = np.random.default_rng(2).permutation(E)            # slot of expert e = perm[e]
    inv = np.argsort(perm)
    moved = jax.tree_util.tree_map(lambda a: a[inv] if hasattr(a, "shape") and a.ndim else a, bank)
    args = (jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), jnp.asarray(valid))
    a = np.asarray(_routed(*args, bank, jnp.arange(E, dtype=jnp.int32), gather=False))
    b = np.asarray(_routed(*args, moved, jnp.asarray(perm, jnp.int32), gather=False))
    assert np.array_equal(a, b), np.abs(a - b).max()

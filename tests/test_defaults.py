"""Defaults chosen by measurement: the compute dtype follows the backend's measured speed and the
checkpoint's declaration, never the model's width."""

import json

import jax.numpy as jnp

from glm_jax import engine as E


def _dir(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_auto_dtype_does_not_switch_a_wide_f32_checkpoint_to_bf16(tmp_path):
    # GLM-5's real widths, declared float32: bf16 compute moved logits by up to 2.9 and flipped argmaxes
    d = _dir(tmp_path, hidden_size=6144, dtype="float32")
    assert E._pick_dtype("auto", d, None) == jnp.float32


def test_auto_dtype_on_cpu_computes_bf16_checkpoints_in_f32(tmp_path):
    d = _dir(tmp_path, hidden_size=6144, torch_dtype="bfloat16")
    assert E.declared_dtype(d) == "bfloat16"
    assert E._pick_dtype("auto", d, None) == jnp.float32        # CPU: bf16 arithmetic is the slow path
    assert E._pick_dtype("bfloat16", d, None) == jnp.bfloat16   # an explicit choice wins


def test_bf16_checkpoint_keeps_bf16_weights_under_f32_compute():
    """auto on CPU: activations f32, the dense matrices stay bf16 in memory (the native kernels widen them)."""
    import os

    import glm_jax
    from glm_jax import kernels

    path = os.path.join(os.path.dirname(__file__), "golden", "glm4moe_fused")   # declared bfloat16
    eng = glm_jax.Engine.load(path)
    assert eng.dtype == jnp.float32 and eng.checkpoint_dtype == "bfloat16"
    if kernels.load():
        assert eng.params["layers"][0]["attn"]["qkv"].fmt == "bf16"
        assert eng.params["layers"][0]["attn"]["qkv"].q.dtype == jnp.bfloat16

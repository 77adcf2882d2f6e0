"""The model's basic pieces (glm4_moe and glm_moe_dsa alike): RMSNorm, linear (float or a packed QWeight: the
native kernels), half-split RoPE, the dense/shared MLP, token embedding and the output head.

Plain functions over the params pytree (WORKSPACE.md).  Shapes: B batch, T query tokens, H hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..kernels.formats import QWeight, qdot, qtake

F32 = jnp.float32


def row_sum(x):
    """Sum over the last axis (keepdims) as a fixed tree of elementwise adds, zero-padded to a power of two.
    XLA:CPU's reduce codegen changes its summation order with the number of rows, and a row's numbers must not
    depend on how many rows share the forward (the scheduler's decode widths follow the running rows); zero
    padding leaves the sum bitwise unchanged (an attention window of any power-of-two size)."""
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x


def softmax(x):
    """softmax over the last axis with ``row_sum`` (row-count invariant; max is exact in any order)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0)))
    return e / row_sum(e)


def rms_norm(x, w, eps):
    """transformers numerics: f32 statistics, cast back to the input dtype *before* the weight multiply."""
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(row_sum(x32 * x32) / x.shape[-1] + eps)
    return w * y.astype(x.dtype)

def linear(x, w, b=None, rows=None):
    """x [..., in] @ w[out, in].T (+ b); ``w`` a float array or a QWeight (quant.py: native kernels).  ``rows``
    (bool, x's leading shape): the rows that matter (the native kernels skip padding rows)."""
    y = qdot(x, w, rows).astype(x.dtype) if isinstance(w, QWeight) else jnp.einsum("...i,oi->...o", x, w)
    return y if b is None else y + b

def rope_cos_sin(positions, rot_dim: int, theta: float, dtype):
    """cos/sin tables [..., rot_dim] for half-split ("NeoX") RoPE, as transformers computes them (f32)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rot_dim, 2, dtype=np.int64).astype(np.float32) / rot_dim))
    freqs = positions.astype(F32)[..., None] * jnp.asarray(inv_freq, F32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)

def apply_rope_half(x, cos, sin):
    """Half-split RoPE on the first cos.shape[-1] dims of x [B, T, heads, hd]; cos/sin [B, T, rot]."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([xr * c + rotated * s, xp], axis=-1)

USE_SEAM_MLP = True     # a quantized native MLP as one MoE-seam call (a one-expert bank): tools/bench A/B switch


def _seam_mlp(gu: QWeight, dn: QWeight, x, rows):
    """gate_up -> silu(gate) * up -> down as one ``kernels.moe`` call on a one-slot bank made of the two matrices
    (their tiles layout is a bank slot's), padding rows (``rows`` False) skipped: two native products, the
    activation and its int8 quantization in one call instead of two calls and XLA's ops between them."""
    lead, H = x.shape[:-1], x.shape[-1]
    n = int(np.prod(lead, dtype=np.int64)) if lead else 1
    ok = jnp.ones((n, 1), bool) if rows is None else rows.reshape(n, 1)
    slots = jnp.where(ok, 0, -1).astype(jnp.int32)
    y = kernels.moe(x.reshape(n, H).astype(F32), slots, jnp.ones((n, 1), F32), gu.q[None], gu.scale[None],
                    dn.q[None], dn.scale[None], gu.fmt, gu.group(), dn.group(), dn.shape[1])
    return y.reshape(*lead, H).astype(x.dtype)


def mlp(p, x, rows=None):
    if "gate_up" in p:       # gate and up fused into one matrix (quant.pack_layer)
        gu, dn = p["gate_up"], p["down_w"]
        if (USE_SEAM_MLP and isinstance(gu, QWeight) and isinstance(dn, QWeight) and gu.kernel == dn.kernel == "native"
                and gu.layout == dn.layout == "tiles" and gu.fmt == dn.fmt and gu.fmt not in ("f32", "bf16")):
            return _seam_mlp(gu, dn, x, rows)
        h = linear(x, p["gate_up"], rows=rows)
        I = h.shape[-1] // 2
        return linear(jax.nn.silu(h[..., :I]) * h[..., I:], p["down_w"], rows=rows)
    return linear(jax.nn.silu(linear(x, p["gate_w"])) * linear(x, p["up_w"]), p["down_w"])

def positions_of(start, T):
    return start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

def embed(params, tokens):
    e = qtake(params["embed"], tokens)
    return e if not isinstance(params["embed"], QWeight) else e.astype(params["norm"].dtype)

def head_logits(h, w, rows=None):
    """h [..., H] @ w[V, H].T -> logits f32 (w a float array or a QWeight; ``rows``: see linear)."""
    if isinstance(w, QWeight):
        return qdot(h, w, rows)
    return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=F32)

def head(params, h, rows=None):
    """Final norm is applied by the caller; logits in f32."""
    return head_logits(h, params["lm_head"], rows)

"""Routed-expert storage formats.

The numpy functions (quantize_* / dequantize_*) are the reference: the converter
uses them to write containers and tests use them to check the in-jit path.
``ExpertBank`` holds S expert slots of one layer in one format; ``bank_take``
gathers slots and dequantizes them inside jit (packed uint8 in, nibbles unpacked
in XLA, scales applied).

int4: symmetric absmax per group (``int4_g{G}``) or per row (``int4_row``),
``s = amax / 7``, ``q = clip(rint(w / s), -8, 7)``, stored offset-binary (+8), two
nibbles per byte with the even element in the low nibble.  int8_row: per row,
``s = amax / 127``, ``q = clip(rint(w / s), -127, 127)``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_FORMATS = ("f32", "bf16")


def parse_format(fmt: str, group_size: int = 64) -> tuple[str, int]:
    """Normalise a format name: returns (kind, group) with kind in f32|bf16|int8_row|int4_row|int4_g."""
    if fmt in ("f32", "bf16", "int8_row", "int4_row"):
        return fmt, 0
    m = re.fullmatch(r"int4_g(\d+)", fmt)
    if m:
        return "int4_g", int(m.group(1))
    if fmt == "int4_g":
        return "int4_g", int(group_size)
    raise ValueError(f"unknown expert format {fmt!r} (expected int4_g64, int4_g<N>, int4_row, int8_row, bf16, f32)")


# ----------------------------------------------------------------------------- numpy reference
def _bf16():
    return jnp.bfloat16  # ml_dtypes bfloat16, usable as a numpy dtype


def quantize(w: np.ndarray, fmt: str) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Quantize a 2-D or 3-D float weight ``[..., out, in]`` along its last axis."""
    kind, g = parse_format(fmt)
    w = np.asarray(w, dtype=np.float32)
    if kind == "f32":
        return np.ascontiguousarray(w), None
    if kind == "bf16":
        return np.ascontiguousarray(w.astype(_bf16())), None
    if kind == "int8_row":
        amax = np.abs(w).max(axis=-1, keepdims=True)
        s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
        return q, s
    n_in = w.shape[-1]
    if n_in % 2:
        raise ValueError(f"int4 needs an even input dimension, got {n_in}")
    if kind == "int4_row" or n_in <= g:
        g = n_in   # a row shorter than the group is one group
    if n_in % g:
        raise ValueError(f"input dimension {n_in} is not a multiple of the int4 group size {g}")
    wg = w.reshape(*w.shape[:-1], n_in // g, g)
    amax = np.abs(wg).max(axis=-1, keepdims=True)
    s = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = (np.clip(np.rint(wg / s), -8, 7).astype(np.int16) + 8).astype(np.uint8).reshape(w.shape)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, s[..., 0]


def dequantize(q: np.ndarray, s: Optional[np.ndarray], fmt: str) -> np.ndarray:
    kind, g = parse_format(fmt)
    if kind in FLOAT_FORMATS:
        return np.asarray(q, dtype=np.float32)
    if kind == "int8_row":
        return q.astype(np.float32) * s
    lo = (q & 0x0F).astype(np.int16) - 8
    hi = (q >> 4).astype(np.int16) - 8
    vals = np.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2).astype(np.float32)
    n_in = vals.shape[-1]
    ng = s.shape[-1]
    return (vals.reshape(*vals.shape[:-1], ng, n_in // ng) * s[..., None]).reshape(vals.shape)


def quantized_nbytes(out_dim: int, in_dim: int, fmt: str) -> int:
    kind, g = parse_format(fmt)
    n = out_dim * in_dim
    if kind == "f32":
        return 4 * n
    if kind == "bf16":
        return 2 * n
    if kind == "int8_row":
        return n + 4 * out_dim
    if kind == "int4_row":
        return n // 2 + 4 * out_dim
    return n // 2 + 4 * out_dim * (in_dim // min(g, in_dim))


# ----------------------------------------------------------------------------- ExpertBank
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertBank:
    """S expert slots of one MoE layer in one storage format (see module docstring)."""

    gate_up: jax.Array                 # [S, 2I, H] float | [S, 2I, H/2] uint8 | [S, 2I, H] int8
    down: jax.Array                    # [S, H, I]  likewise
    gate_up_scale: Optional[jax.Array] = None   # [S, 2I, H/g] | [S, 2I, 1] f32
    down_scale: Optional[jax.Array] = None
    fmt: str = dataclasses.field(default="f32", metadata=dict(static=True))

    @property
    def num_slots(self) -> int:
        return self.gate_up.shape[0]


def _dequant_jax(q, s, fmt: str, dtype):
    kind, _ = parse_format(fmt)
    if kind in FLOAT_FORMATS:
        return q.astype(dtype)
    if kind == "int8_row":
        return (q.astype(jnp.float32) * s).astype(dtype)
    lo = (q & 0x0F).astype(jnp.int8) - 8
    hi = (q >> 4).astype(jnp.int8) - 8
    vals = jnp.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2).astype(jnp.float32)
    ng = s.shape[-1]
    n_in = vals.shape[-1]
    out = vals.reshape(*vals.shape[:-1], ng, n_in // ng) * s[..., None]
    return out.reshape(vals.shape).astype(dtype)


def bank_take(bank: ExpertBank, slots: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Gather ``slots`` (any int shape) and dequantize: returns gate_up [..., 2I, H], down [..., H, I]."""
    take = lambda a: None if a is None else jnp.take(a, slots, axis=0)  # noqa: E731
    gu = _dequant_jax(take(bank.gate_up), take(bank.gate_up_scale), bank.fmt, dtype)
    dn = _dequant_jax(take(bank.down), take(bank.down_scale), bank.fmt, dtype)
    return gu, dn


def take_dot(bank: ExpertBank, part: str, slots: jax.Array, x: jax.Array) -> jax.Array:
    """Quantized experts times activations without materializing dequantized weights (the decode hot path).

    ``part`` "gate_up" ([S, 2I, H]) or "down" ([S, H, I]); ``slots`` int [T, K]; ``x`` f32 [T, 1 | K, in].
    Returns f32 [T, K, out]: out[t, k, o] = sum_j W_{slots[t,k]}[o, j] * x[t, k, j].  For int4 the packed bytes
    are split into low (even j) and high (odd j) nibbles and multiplied with x's even / odd elements, summed per
    group, offset-corrected and scaled: a fused multiply-reduce over the packed bytes (XLA:CPU makes the
    dequantize-then-dot form several passes over an interleaved float copy: 3-8x slower at decode, measured).
    int8: converted, then one dot (faster than a multiply-reduce there, measured).  Float banks use bank_take."""
    q = jnp.take(getattr(bank, part), slots, axis=0)                          # [T, K, O, in'] packed/int8
    sc = getattr(bank, part + "_scale")
    sc = None if sc is None else jnp.take(sc, slots, axis=0)                  # [T, K, O, G]
    kind, _ = parse_format(bank.fmt)
    if kind in FLOAT_FORMATS:
        raise ValueError(f"take_dot is for quantized banks (got {bank.fmt}); float banks use bank_take")
    x = x.astype(jnp.float32)
    T, K = slots.shape
    if kind == "int8_row":      # a dot is fastest here (measured; XLA:CPU)
        xb = jnp.broadcast_to(x, (T, K, x.shape[-1]))
        return jnp.einsum("tkoh,tkh->tko", q.astype(jnp.float32), xb) * sc[..., 0]
    # int4: sum_j (q_j - 8) x_j s_g = s_g (sum_j q_j x_j - 8 sum_j x_j), per group g
    G = sc.shape[-1]
    gs2 = q.shape[-1] // G
    xe, xo = x[..., None, 0::2], x[..., None, 1::2]                             # [T, 1|K, 1, in/2]
    p = ((q & 0x0F).astype(jnp.float32) * xe + (q >> 4).astype(jnp.float32) * xo)
    p = p.reshape(*p.shape[:-1], G, gs2).sum(-1)                                # [T, K, O, G]
    corr = 8.0 * (xe + xo).reshape(*xe.shape[:-1], G, gs2).sum(-1)              # [T, 1|K, 1, G]
    return ((p - corr) * sc).sum(-1)


def bank_all(bank: ExpertBank, dtype) -> tuple[jax.Array, jax.Array]:
    """Dequantize every slot (used when every slot is computed for every token)."""
    gu = _dequant_jax(bank.gate_up, bank.gate_up_scale, bank.fmt, dtype)
    dn = _dequant_jax(bank.down, bank.down_scale, bank.fmt, dtype)
    return gu, dn


def bank_from_float(gate_up: np.ndarray, down: np.ndarray, fmt: str = "f32") -> ExpertBank:
    """Quantize float expert stacks ``[E, 2I, H]`` / ``[E, H, I]`` into a resident ExpertBank."""
    kind, _ = parse_format(fmt)
    if kind == "f32":
        return ExpertBank(jnp.asarray(gate_up), jnp.asarray(down), fmt="f32")
    if kind == "bf16":
        return ExpertBank(jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16), fmt="bf16")
    gq, gs = quantize(gate_up, fmt)
    dq, ds = quantize(down, fmt)
    return ExpertBank(jnp.asarray(gq), jnp.asarray(dq), jnp.asarray(gs), jnp.asarray(ds), fmt=fmt)

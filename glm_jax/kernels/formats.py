"""Routed-expert storage formats.

The numpy functions (quantize_* / dequantize_*) are the reference: the converter
uses them to write containers and tests use them to check the in-jit path.
``ExpertBank`` holds S expert slots of one layer in one format; ``bank_take``
gathers slots and dequantizes them inside jit (packed uint8 in, nibbles unpacked
in XLA, scales applied).

int4: symmetric absmax per group (``int4_g{G}``, G even) or per row (``int4_row``),
``s = amax / 7``, ``q = clip(rint(w / s), -8, 7)``, stored offset-binary (+8), two
nibbles per byte with the even element in the low nibble.  A row of ``n`` elements has
``ceil(n / G)`` groups: when G does not divide n the last group is shorter (``n % G``
elements; a row no longer than G is one group).  int8_row: per row, ``s = amax / 127``,
``q = clip(rint(w / s), -127, 127)``.  int4 needs an even row length (two nibbles per
byte); ``fit_format`` picks int8_row for a layer where it is odd, and says so.

Scales: int4_g{G} keeps them in f16 (``s`` rounded up to the next f16, so no weight is clipped), as llama.cpp's Q4_0
does: 4.25 bits a weight at G = 64 instead of 4.5 with f32 scales, the bytes a decode step streams 5.6% fewer.  int4_row
and int8_row (one scale a row) keep f32.  Data written with f32 int4_g scales (older containers) is read as
it is: the kernels take either.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..errors import GlmJaxError

FLOAT_FORMATS = ("f32", "bf16")


class FormatError(GlmJaxError):
    """An unknown or impossible expert storage format."""


def parse_format(fmt: str, group_size: int = 64) -> tuple[str, int]:
    """Normalise a format name: returns (kind, group) with kind in f32|bf16|int8_row|int4_row|int4_g."""
    if fmt in ("f32", "bf16", "int8_row", "int4_row"):
        return fmt, 0
    m = re.fullmatch(r"int4_g(\d+)", fmt) if isinstance(fmt, str) else None
    g = int(m.group(1)) if m else (group_size if fmt == "int4_g" else None)
    if g is None:
        raise FormatError(f"unknown expert format {fmt!r} (expected int4_g64, int4_g<N>, int4_row, int8_row, bf16, "
                          f"f32)")
    if isinstance(g, bool) or not isinstance(g, int) or g < 2 or g % 2:
        raise FormatError(f"expert format {fmt!r}: the int4 group size must be an even integer >= 2, got {g!r}")
    return "int4_g", g


def int4_group(kind: str, g: int, n_in: int) -> int:
    """Elements per int4 group in a row of ``n_in``: the whole row (int4_row, or a row no longer than the group),
    else ``g``; the row then has ceil(n_in / g) groups, the last one shorter when g does not divide n_in."""
    return n_in if (kind == "int4_row" or n_in <= g) else g


def _groups(kind: str, g: int, n_in: int, ng: int) -> int:
    """Group length of stored int4 data with ``ng`` scales per row (the format's rule; data written by an older
    rule that divides evenly is read as before)."""
    G = int4_group(kind, g, n_in)
    return G if -(-n_in // G) == ng else n_in // ng


def fit_format(fmt: str, hidden: int, inter: int) -> tuple[str, str]:
    """(format to store a layer's experts in, note): int4 needs even row lengths (hidden_size for gate/up,
    moe_intermediate_size for down); where one is odd the layer is stored int8_row instead, with a one-line note."""
    kind, _ = parse_format(fmt)
    if kind.startswith("int4") and (hidden % 2 or inter % 2):
        return "int8_row", (f"{fmt} needs even row lengths (hidden_size={hidden}, moe_intermediate_size={inter}); "
                            f"those experts are stored as int8_row instead")
    return fmt, ""


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
        raise FormatError(f"{fmt}: int4 needs an even input dimension, got {n_in} (fit_format picks int8_row)")
    G = int4_group(kind, g, n_in)
    ng = -(-n_in // G)
    pad = ng * G - n_in                 # the last group is shorter: zero padding changes no absmax
    wp = np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)]) if pad else w
    wg = wp.reshape(*w.shape[:-1], ng, G)
    amax = np.abs(wg).max(axis=-1, keepdims=True)
    s = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    if kind == "int4_g":
        s = _f16_up(s, fmt)
    q = (np.clip(np.rint(wg / s), -8, 7).astype(np.int16) + 8).astype(np.uint8).reshape(*w.shape[:-1], ng * G)
    q = q[..., :n_in]
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, s[..., 0]


F16_MAX = 65504.0


def _f16_up(s: np.ndarray, fmt: str) -> np.ndarray:
    """f32 scales -> the f16 at or above each (so ``w / s`` stays within the int4 range)."""
    if s.size and float(s.max()) > F16_MAX:
        raise FormatError(f"{fmt}: a weight of magnitude {float(s.max()) * 7:.3g} is beyond the f16 scales' range "
                          f"(|w| <= {F16_MAX * 7:.3g}); store it as bf16 or f32")
    h = s.astype(np.float16)
    low = h.astype(np.float32) < s
    if low.any():
        h = np.where(low, np.nextafter(h, np.float16(np.inf)), h)
    return h


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
    G = _groups(kind, g, n_in, ng)
    pad = ng * G - n_in
    if pad:
        vals = np.pad(vals, [(0, 0)] * (vals.ndim - 1) + [(0, pad)])
    out = (vals.reshape(*vals.shape[:-1], ng, G) * s[..., None].astype(np.float32)).reshape(vals.shape)
    return out[..., :n_in] if pad else out


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
    return n // 2 + 2 * out_dim * -(-in_dim // int4_group(kind, g, in_dim))      # f16 scales


# ----------------------------------------------------------------------------- the "tiles" layout
# What the native kernels read (glm_jax/kernels/qkernels.cc): rows in tiles of 16; per tile the input is cut into
# units of 4 (int8) or 8 (int4) elements, one 64-byte vector per unit holding the unit for all 16 rows: byte 4i+j is
# row 16t+i's element 4u+j (int8), or for int4 its element 8u+j in the low and 8u+4+j in the high nibble (offset
# binary, q+8).  Rows padded to a multiple of 16, the input to a multiple of the unit, with zero weights (int4 value
# 8).  Scales [tiles, groups, 16].  Stored as q [..., R, K/2] (int4) / [..., R, K] (int8): the same bytes as a
# row-major matrix of that shape, in tile order.
TILE = 16


def _unit(kind: str) -> int:
    return 4 if kind == "int8_row" else 8


def _nibbles(q: np.ndarray) -> np.ndarray:
    return np.stack([q & 0x0F, q >> 4], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)


def to_tiles(q: np.ndarray, s: np.ndarray, fmt: str, n_in: int,
             block_bytes: int = 16 << 20) -> tuple[np.ndarray, np.ndarray]:
    """Row-major quantized (``quantize``'s output: q [..., out, in'] and s [..., out, groups]) -> the tiles layout.
    Converted ``block_bytes`` of unpacked values at a time (whole tiles of TILE rows: rows are independent), so
    the temporaries stay at a few blocks whatever the matrix (GLM-4.5-Air's first dense MLP, gate|up [21888, 4096]
    int4, took +320 MB at load unpacked whole)."""
    kind, _ = parse_format(fmt)
    u = _unit(kind)
    q, s = np.asarray(q), np.asarray(s)
    lead, out = q.shape[:-2], q.shape[-2]
    R, K = -(-out // TILE) * TILE, -(-n_in // u) * u
    per_row = K * max(1, int(np.prod(lead, dtype=np.int64)))
    rows = max(TILE, block_bytes // max(1, per_row) // TILE * TILE)
    if R <= rows:
        return _tiles_block(q, s, kind, n_in, R, K)
    qt = st = None
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        qb, sb = _tiles_block(q[..., r0:min(r1, out), :], s[..., r0:min(r1, out), :], kind, n_in, r1 - r0, K)
        if qt is None:
            qt = np.empty(lead + (R,) + qb.shape[-1:], qb.dtype)
            st = np.empty(lead + (R // TILE,) + sb.shape[-2:], sb.dtype)
        qt[..., r0:r1, :] = qb
        st[..., r0 // TILE:r1 // TILE, :, :] = sb
    return qt, st


def _tiles_block(q: np.ndarray, s: np.ndarray, kind: str, n_in: int, R: int, K: int):
    """``to_tiles`` of rows padded to R (a multiple of TILE) and inputs to K."""
    vals = q if kind == "int8_row" else _nibbles(q)[..., :n_in]
    lead, out = vals.shape[:-2], vals.shape[-2]
    vp = np.full(lead + (R, K), 0 if kind == "int8_row" else 8, vals.dtype)
    vp[..., :out, :n_in] = vals
    del vals
    nl = len(lead)
    perm = tuple(range(nl)) + (nl, nl + 2, nl + 1, nl + 3)
    if kind == "int8_row":
        t = vp.reshape(lead + (R // TILE, TILE, K // 4, 4)).transpose(perm)
        qt = np.ascontiguousarray(t).reshape(lead + (R, K))
    else:
        t = vp.reshape(lead + (R // TILE, TILE, K // 8, 2, 4)).transpose(perm + (nl + 4,))   # [.., T, U, 16, 2, 4]
        t = np.ascontiguousarray(t.transpose(tuple(range(nl + 3)) + (nl + 4, nl + 3)))        # [.., T, U, 16, 4, 2]
        del vp
        qt = (t[..., 0] | (t[..., 1] << 4)).astype(np.uint8).reshape(lead + (R, K // 2))
    sp = np.zeros(lead + (R, s.shape[-1]), s.dtype if s.dtype == np.float16 else np.float32)
    sp[..., :out, :] = s
    st = np.ascontiguousarray(np.swapaxes(sp.reshape(lead + (R // TILE, TILE, s.shape[-1])), -1, -2))
    return qt, st


def from_tiles(qt: np.ndarray, st: np.ndarray, fmt: str, out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """The tiles layout -> row-major (q, s) as ``quantize`` writes them (numpy; the inverse of ``to_tiles``)."""
    kind, _ = parse_format(fmt)
    lead = qt.shape[:-2]
    R = qt.shape[-2]
    nl = len(lead)
    s = np.swapaxes(np.asarray(st), -1, -2).reshape(lead + (R, st.shape[-2]))[..., :out, :]
    if kind == "int8_row":
        K = qt.shape[-1]
        v = qt.reshape(lead + (R // TILE, K // 4, TILE, 4)).transpose(tuple(range(nl)) + (nl, nl + 2, nl + 1, nl + 3))
        return np.ascontiguousarray(v).reshape(lead + (R, K))[..., :out, :n_in], s
    K = qt.shape[-1] * 2
    b = qt.reshape(lead + (R // TILE, K // 8, TILE, 4))
    v = np.stack([b & 0x0F, b >> 4], axis=-2)                                  # [.., T, U, 16, 2, 4]
    v = v.transpose(tuple(range(nl)) + (nl, nl + 2, nl + 1, nl + 3, nl + 4))    # [.., T, 16, U, 2, 4]
    v = np.ascontiguousarray(v).reshape(lead + (R, K))[..., :out, :n_in]
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8), s


def _rows_jax(qt, st, fmt: str, out: int, n_in: int):
    """``from_tiles`` in jnp (the XLA fallback path reads a tiles-layout bank through it)."""
    kind, _ = parse_format(fmt)
    lead = qt.shape[:-2]
    R = qt.shape[-2]
    nl = len(lead)
    s = jnp.swapaxes(st, -1, -2).reshape(lead + (R, st.shape[-2]))[..., :out, :]
    if kind == "int8_row":
        K = qt.shape[-1]
        v = qt.reshape(lead + (R // TILE, K // 4, TILE, 4)).transpose(tuple(range(nl)) + (nl, nl + 2, nl + 1, nl + 3))
        return v.reshape(lead + (R, K))[..., :out, :n_in], s
    K = qt.shape[-1] * 2
    b = qt.reshape(lead + (R // TILE, K // 8, TILE, 4))
    v = jnp.stack([b & 0x0F, b >> 4], axis=-2)
    v = v.transpose(tuple(range(nl)) + (nl, nl + 2, nl + 1, nl + 3, nl + 4)).reshape(lead + (R, K))[..., :out, :n_in]
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(jnp.uint8), s


# ----------------------------------------------------------------------------- ExpertBank
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertBank:
    """S expert slots of one MoE layer in one storage format (see module docstring)."""

    gate_up: jax.Array                 # [S, 2I, H] float | [S, 2I, H/2] uint8 | [S, 2I, H] int8
    down: jax.Array                    # [S, H, I]  likewise
    gate_up_scale: Optional[jax.Array] = None   # [S, 2I, ceil(H/g)] | [S, 2I, 1] f32
    down_scale: Optional[jax.Array] = None
    fmt: str = dataclasses.field(default="f32", metadata=dict(static=True))
    # "native": the MoE seam runs glm_jax/kernels (C++ through jax.ffi); "xla": the jnp paths below
    kernel: str = dataclasses.field(default="xla", metadata=dict(static=True))
    # quantized formats: "rows" (quantize's row-major) or "tiles" (the native kernels' layout, hidden/inter given)
    layout: str = dataclasses.field(default="rows", metadata=dict(static=True))
    hidden: int = dataclasses.field(default=0, metadata=dict(static=True))
    inter: int = dataclasses.field(default=0, metadata=dict(static=True))
    # a device mesh: the slots are sharded over its "expert" axis and the seam runs in shard_map (parallel.py);
    # ``comm`` how tokens reach their experts there ("psum" | "all_to_all")
    mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))
    comm: str = dataclasses.field(default="psum", metadata=dict(static=True))

    @property
    def num_slots(self) -> int:
        return self.gate_up.shape[0]

    @property
    def local_slots(self) -> int:
        """Slots each device computes on (a mesh bank: one expert shard's; the seam's path choice uses this)."""
        return self.num_slots // (self.mesh.shape["expert"] if self.mesh is not None else 1)

    @property
    def dims(self) -> tuple:
        """(hidden, inter) of the experts."""
        if self.layout == "tiles":
            return self.hidden, self.inter
        return self.down.shape[1], self.down.shape[2] * (2 if self.fmt.startswith("int4") else 1)

    def group(self, part: str) -> int:
        """int4 group size of ``part`` ("gate_up" | "down") in elements (0 = one group per row / not int4)."""
        kind, g = parse_format(self.fmt)
        if kind != "int4_g":
            return 0
        H, I = self.dims
        n_in = H if part == "gate_up" else I
        return 0 if g >= n_in else g


def native_ok(fmt: str, hidden: int, inter: int) -> bool:
    """Can the native kernels run experts of this format and shape (glm_jax.kernels.supported)."""
    _, g = parse_format(fmt)
    return kernels.supported(fmt, hidden, g or hidden) and kernels.supported(fmt, inter, g or inter)


def with_kernel(bank: "ExpertBank", kernel: str) -> "ExpertBank":
    """``bank`` computed by ``kernel`` ("native" where the kernels support its format, shape and layout, else
    "xla", which reads a tiles-layout bank through ``as_rows``)."""
    quantized = bank.fmt not in FLOAT_FORMATS
    if kernel == "native" and (not native_ok(bank.fmt, *bank.dims) or (quantized and bank.layout != "tiles")):
        kernel = "xla"
    return dataclasses.replace(bank, kernel=kernel)


def as_rows(bank: ExpertBank) -> ExpertBank:
    """A tiles-layout bank as the row-major one the XLA paths read (jnp; traced into the caller's program)."""
    if bank.layout != "tiles" or bank.fmt in FLOAT_FORMATS:
        return bank
    H, I = bank.dims
    gq, gs = _rows_jax(bank.gate_up, bank.gate_up_scale, bank.fmt, 2 * I, H)
    dq, ds = _rows_jax(bank.down, bank.down_scale, bank.fmt, H, I)
    return ExpertBank(gq, dq, gs, ds, fmt=bank.fmt, kernel=bank.kernel)


def bank_tiles(gate_up_q, gate_up_s, down_q, down_s, fmt: str, hidden: int, inter: int) -> tuple:
    """Row-major quantized experts [E, ...] -> the tiles layout's four arrays (numpy)."""
    gq, gs = to_tiles(gate_up_q, gate_up_s, fmt, hidden)
    dq, ds = to_tiles(down_q, down_s, fmt, inter)
    return gq, gs, dq, ds


def dequant_jax(q, s, fmt: str, dtype):
    kind, g = parse_format(fmt)
    if kind in FLOAT_FORMATS:
        return q.astype(dtype)
    if kind == "int8_row":
        return (q.astype(jnp.float32) * s).astype(dtype)
    lo = (q & 0x0F).astype(jnp.int8) - 8
    hi = (q >> 4).astype(jnp.int8) - 8
    vals = jnp.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2).astype(jnp.float32)
    ng = s.shape[-1]
    n_in = vals.shape[-1]
    G = _groups(kind, g, n_in, ng)
    pad = ng * G - n_in                  # a shorter last group: pad, scale, cut (static shapes)
    if pad:
        vals = jnp.pad(vals, [(0, 0)] * (vals.ndim - 1) + [(0, pad)])
    out = vals.reshape(*vals.shape[:-1], ng, G) * s[..., None].astype(jnp.float32)
    out = out.reshape(vals.shape)
    return (out[..., :n_in] if pad else out).astype(dtype)


def bank_from_float(gate_up: np.ndarray, down: np.ndarray, fmt: str = "f32", kernel: str = "xla") -> ExpertBank:
    """Quantize float expert stacks ``[E, 2I, H]`` / ``[E, H, I]`` into a resident ExpertBank."""
    kind, _ = parse_format(fmt)
    if kind == "f32":
        bank = ExpertBank(jnp.asarray(gate_up), jnp.asarray(down), fmt="f32")
    elif kind == "bf16":
        bank = ExpertBank(jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16), fmt="bf16")
    else:
        gq, gs = quantize(gate_up, fmt)
        dq, ds = quantize(down, fmt)
        H, I = down.shape[-2], down.shape[-1]
        if kernel == "native" and native_ok(fmt, H, I):
            gq, gs, dq, ds = bank_tiles(gq, gs, dq, ds, fmt, H, I)
            bank = ExpertBank(jnp.asarray(gq), jnp.asarray(dq), jnp.asarray(gs), jnp.asarray(ds), fmt=fmt,
                              layout="tiles", hidden=H, inter=I)
        else:
            bank = ExpertBank(jnp.asarray(gq), jnp.asarray(dq), jnp.asarray(gs), jnp.asarray(ds), fmt=fmt)
    return with_kernel(bank, kernel)


# ----------------------------------------------------------------------------- dense weights
class QTensor(tuple):
    """A dense weight as stored quantized on disk (numpy ``q``, ``scale``, format name), before it becomes a QWeight.
    ``shape`` is the logical [out, in]."""

    def __new__(cls, q, scale, fmt):
        return super().__new__(cls, (q, scale, fmt))

    q = property(lambda self: self[0])
    scale = property(lambda self: self[1])
    fmt = property(lambda self: self[2])

    @property
    def shape(self):
        return (self.q.shape[0], self.q.shape[1] * (2 if self.fmt.startswith("int4") else 1))

    def dequant(self) -> np.ndarray:
        return dequantize(self.q, self.scale, self.fmt)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QWeight:
    """A dense weight ``[out, in]`` (HF orientation, math ``x @ W.T``) in one storage format: ``q`` float
    (f32 / bf16) or quantized (int8_row: int8 [out, in]; int4_g<G>: packed uint8 [out, in/2]) with f32 ``scale``
    [out, groups].  ``kernel`` "native": products run glm_jax/kernels (always for quantized formats; for float
    formats up to NATIVE_MAX_ROWS rows, above that XLA's GEMM is faster); "xla": dequantize + einsum."""

    q: jax.Array
    scale: Optional[jax.Array] = None
    fmt: str = dataclasses.field(default="f32", metadata=dict(static=True))
    kernel: str = dataclasses.field(default="xla", metadata=dict(static=True))
    # quantized: "rows" or "tiles" (the native kernels' layout; ``dims`` = the logical [out, in])
    layout: str = dataclasses.field(default="rows", metadata=dict(static=True))
    dims: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        if self.layout == "tiles":
            return self.dims
        return (self.q.shape[0], self.q.shape[1] * (2 if self.fmt.startswith("int4") else 1))

    def group(self) -> int:
        kind, g = parse_format(self.fmt)
        return g if kind == "int4_g" and g < self.shape[1] else 0

    def rows(self):
        """(q, scale) row-major."""
        if self.layout == "tiles":
            return _rows_jax(self.q, self.scale, self.fmt, *self.dims)
        return self.q, self.scale

    def dequant(self, dtype):
        return dequant_jax(*self.rows(), self.fmt, dtype)


NATIVE_MAX_ROWS = 32     # float weights: the native kernel up to this many rows (decode / verify), XLA's GEMM above


def qdot(x, w: QWeight, rows=None):
    """x [..., in] @ w.T -> [..., out] f32.  ``rows`` (bool, x's leading shape, optional): rows that matter; the
    native kernel skips the others (their output is 0), the XLA path computes them anyway."""
    out_dim, in_dim = w.shape
    lead = x.shape[:-1]
    n = int(np.prod(lead, dtype=np.int64)) if lead else 1
    if w.kernel == "native" and (w.fmt not in FLOAT_FORMATS or n <= NATIVE_MAX_ROWS):
        y = kernels.qlinear(x.reshape(n, in_dim).astype(jnp.float32), w.q, w.scale, w.fmt, w.group(), out_dim,
                            None if rows is None else rows.reshape(n))
        return y.reshape(*lead, out_dim)
    # float weights: the wider of the two dtypes (f32 activations x bf16 weights compute in f32, as the native
    # kernels do; bf16 x bf16 stays bf16)
    dt = x.dtype if w.fmt not in FLOAT_FORMATS else jnp.promote_types(x.dtype, w.q.dtype)
    return jnp.einsum("...i,oi->...o", x.astype(dt), w.dequant(dt), preferred_element_type=jnp.float32)


def qtake(w, ids):
    """Rows ``ids`` of an embedding table (a float array or a QWeight) as float."""
    if not isinstance(w, QWeight):
        return jnp.take(w, ids, axis=0)
    q, s = w.rows()
    sc = None if s is None else jnp.take(s, ids, axis=0)
    return dequant_jax(jnp.take(q, ids, axis=0), sc, w.fmt, jnp.float32)


def to_qweight(a, fmt: str, kernel: str, dtype, tiles: bool = True) -> "QWeight":
    """A loaded dense weight (float array or QTensor) as a QWeight in ``fmt`` ("native": as stored / the compute
    dtype).  Quantized formats go to the tiles layout for the native kernels (``tiles=False``: keep rows, for
    tables that are only gathered from)."""
    if isinstance(a, QTensor):
        if fmt in ("native", a.fmt):
            return _quant_qweight(a.q, a.scale, a.fmt, a.shape, kernel, tiles)
        a = a.dequant()
    if fmt == "native":      # as stored: a bf16 matrix stays bf16 (the kernels compute in f32 either way)
        fmt = "bf16" if (np.asarray(a).dtype == _bf16() or dtype == jnp.bfloat16) else "f32"
    kind, _ = parse_format(fmt)
    if kind in FLOAT_FORMATS:
        return QWeight(jnp.asarray(a, jnp.bfloat16 if kind == "bf16" else jnp.float32), fmt=kind, kernel=kernel)
    q, s = quantize_rows(a, fmt)
    return _quant_qweight(q, s, fmt, np.shape(a), kernel, tiles)


def to_qweight_grouped(a, fmt: str, kernel: str = "native") -> "QWeight":
    """G float matrices ``a`` [G, out, in] (MLA's per-head W_UK^T / W_UV) quantized to ``fmt`` (each row on its own,
    as ``to_qweight``) in the tiles layout with a leading group axis: ``qdot_grouped``'s weight (``dims`` = one
    group's [out, in])."""
    a = np.asarray(a, np.float32)
    G, out, n_in = a.shape
    q, s = quantize_rows(a.reshape(G * out, n_in), fmt)
    return _quant_qweight(q.reshape((G, out) + q.shape[1:]), s.reshape((G, out) + s.shape[1:]), fmt, (out, n_in),
                          kernel, True)


def grouped_ok(fmt: str, n_in: int) -> bool:
    """Whether ``to_qweight_grouped`` / the grouped kernel takes ``fmt`` for inputs of ``n_in`` (quantized formats
    the native kernels run)."""
    return parse_format(fmt)[0] in ("int8_row", "int4_g") and native_ok(fmt, n_in, n_in)


def qdot_grouped(x, w: "QWeight"):
    """x [..., G, in] -> [..., G, out] f32, group g through w's matrix g (``kernels.qlinear_grouped``)."""
    out_dim, in_dim = w.shape
    lead, G = x.shape[:-2], x.shape[-2]
    n = int(np.prod(lead, dtype=np.int64)) if lead else 1
    xg = jnp.swapaxes(x.reshape(n, G, in_dim), 0, 1).astype(jnp.float32)          # [G, n, in]
    y = kernels.qlinear_grouped(xg, w.q, w.scale, w.fmt, w.group(), out_dim)       # [G, n, out]
    return jnp.swapaxes(y, 0, 1).reshape(*lead, G, out_dim)


def quantize_rows(a, fmt: str, chunk_bytes: int = 16 << 20):
    """``quantize`` of a 2-D weight, a block of rows at a time (every format here quantizes each row on its own):
    the float32 temporaries stay at ``chunk_bytes`` whatever the matrix (a [151552, 4096] bf16 embedding would
    otherwise take ~10 GB of f32 copies to quantize), so quantizing at load needs no more than the stored matrix,
    its result and one block."""
    a = np.asarray(a)
    if a.ndim != 2 or a.shape[0] * a.shape[1] * 4 <= chunk_bytes:
        return quantize(np.asarray(a, np.float32), fmt)
    rows = max(1, chunk_bytes // (4 * a.shape[1]))
    qs, ss = None, None
    for r0 in range(0, a.shape[0], rows):
        q, s = quantize(np.asarray(a[r0:r0 + rows], np.float32), fmt)
        if qs is None:
            qs = np.empty((a.shape[0],) + q.shape[1:], q.dtype)
            ss = None if s is None else np.empty((a.shape[0],) + s.shape[1:], s.dtype)
        qs[r0:r0 + rows] = q
        if ss is not None:
            ss[r0:r0 + rows] = s
    return qs, ss


def _quant_qweight(q, s, fmt: str, dims: tuple, kernel: str, tiles: bool) -> QWeight:
    out, n_in = dims
    if tiles and kernel == "native" and native_ok(fmt, n_in, n_in):
        qt, st = to_tiles(q, s, fmt, n_in)
        return QWeight(jnp.asarray(qt), jnp.asarray(st), fmt=fmt, kernel=kernel, layout="tiles",
                       dims=(int(out), int(n_in)))
    return QWeight(jnp.asarray(q), jnp.asarray(s), fmt=fmt, kernel=kernel if tiles else "xla")


def _concat(parts: list):
    """Fuse float arrays or same-format QTensors along the output axis."""
    if all(isinstance(p, QTensor) for p in parts) and len({p.fmt for p in parts}) == 1:
        return QTensor(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]), parts[0].fmt)
    if not any(isinstance(p, QTensor) for p in parts) and len({np.asarray(p).dtype for p in parts}) == 1:
        return np.concatenate([np.asarray(p) for p in parts])
    return np.concatenate([p.dequant() if isinstance(p, QTensor) else np.asarray(p, np.float32) for p in parts])


def head_format(fmt: str) -> str:
    """The lm_head's storage format for a dense format: int8 for int4 dense formats (as llama.cpp keeps its output
    matrix above 4 bits), else the same."""
    return "int8_row" if fmt.startswith("int4") else fmt


# MLA matrices used only as linears (q_proj_w where q_lora_rank is null): packed (weights.load_layer keeps the indexer
# float; kv_b, split per head, is packed grouped in q_b's format: pack_layer)
MLA_LINEARS = ("q_a_w", "q_b_w", "q_proj_w", "kv_a_w", "o_w")


def pack_layer(lp: dict, kernel: str, fmt: str = "native", dtype=None, fuse: bool = True) -> dict:
    """One decoder layer's dense matrices as QWeights for the native kernels: the GQA q/k/v projections fused into
    one ``qkv`` (+ ``qkv_b``), each MLP's gate/up into one ``gate_up`` (one kernel call each).  ``fmt``: the dense
    storage format ("native" keeps what was loaded: bf16 stays bf16, stored-quantized stays quantized).  MLA
    attention: its linears (q_a, q_b, kv_a, o) are packed the same way, kv_b and the DSA indexer are left
    float (loaded so); with ``fuse=False`` (a mesh) every MLA matrix stays float.  ``fuse=False`` keeps q/k/v and gate/up apart (a
    tensor-parallel mesh splits each by heads / intermediate columns).  Expects numpy leaves / QTensors."""
    dtype = dtype or jnp.float32

    def qw(a):
        return to_qweight(a, fmt, kernel, dtype)

    def mlp(p):
        if p is None or "gate_w" not in p:
            return p
        if not fuse:
            return {k: qw(p[k]) for k in ("gate_w", "up_w", "down_w")}
        return {"gate_up": qw(_concat([p["gate_w"], p["up_w"]])), "down_w": qw(p["down_w"])}

    lp = dict(lp)
    a = lp.get("attn")
    if a is not None and "kv_a_w" in a:            # MLA: its linears packed (the loader keeps the rest float)
        a = dict(a)
        for k in (k for k in MLA_LINEARS if k in a):   # a mesh (fuse=False) splits them by heads: float there
            a[k] = qw(a[k]) if fuse else a[k].dequant() if isinstance(a[k], QTensor) else a[k]
        # the absorbed per-head products (W_UK^T, W_UV) in q_b's quantized format, on the grouped native kernel (as
        # llama.cpp keeps attn_k_b / attn_v_b in its file's bits); float where q_b is float (an f32 / bf16 model)
        qb = a.get("q_b_w", a.get("q_proj_w"))
        if fuse and kernel == "native" and "w_uk_t" in a and isinstance(qb, QWeight) and all(
                grouped_ok(qb.fmt, np.shape(a[k])[-1]) for k in ("w_uk_t", "w_uv")):
            for k in ("w_uk_t", "w_uv"):
                a[k] = to_qweight_grouped(a[k], qb.fmt, kernel)
        lp["attn"] = a
    elif a is not None and "q_w" in a and not fuse:
        a = dict(a)
        for k in ("q_w", "k_w", "v_w", "o_w"):
            a[k] = qw(a[k])
        lp["attn"] = a
    elif a is not None and "q_w" in a:
        a = dict(a)
        a["qkv"] = qw(_concat([a.pop("q_w"), a.pop("k_w"), a.pop("v_w")]))
        if "q_b" in a:
            a["qkv_b"] = np.concatenate([np.asarray(a.pop(k), np.float32) for k in ("q_b", "k_b", "v_b")])
        a["o_w"] = qw(a["o_w"])
        lp["attn"] = a
    if "mlp" in lp:
        lp["mlp"] = mlp(lp["mlp"])
    if "moe" in lp:
        lp["moe"] = dict(lp["moe"], shared=mlp(lp["moe"]["shared"]))
        if kernel == "native" and fuse and not isinstance(lp["moe"]["router_w"], QWeight):
            # the router's f32 product on the native kernel (decode rows: XLA's one tiny dot per layer went through
            # its XNNPACK fusion at 50-140 us a step); row-invariant, as the padded XLA product was made to be
            lp["moe"]["router_w"] = QWeight(jnp.asarray(np.asarray(lp["moe"]["router_w"], np.float32)), fmt="f32",
                                            kernel=kernel)
    return lp


def pack_table(a, kernel: str, fmt: str, dtype):
    """An embedding table: a QWeight when stored quantized or bf16 (rows widened as they are looked up), else the
    array as loaded; a float table with a quantized ``fmt`` is quantized at load (as glm-jax-convert stores it)."""
    if not isinstance(a, QTensor) and fmt not in ("native", "f32", "bf16"):
        return to_qweight(a, fmt, kernel, dtype, tiles=False)
    if isinstance(a, QTensor) or np.asarray(a).dtype == _bf16():
        return to_qweight(a, "native", kernel, dtype, tiles=False)
    return a

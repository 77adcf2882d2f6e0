"""Hugging Face safetensors checkpoints, below both readers of them (the dense loader ``weights.py`` and the
container's expert source ``container.py``): the index of a sharded checkpoint, FP8 block dequantization, the
finiteness check every loaded float weight passes.  A leaf of ``glm_jax.experts``.
"""

from __future__ import annotations

import os

import numpy as np

from .. import fileio
from ..errors import GlmJaxError


class WeightError(GlmJaxError):
    pass

INDEX_NAME = "model.safetensors.index.json"

def read_index(path: str, error=None) -> dict:
    """``weight_map`` of ``path/model.safetensors.index.json``: {tensor key: shard file name}, checked (a JSON object
    of string keys to shard names inside ``path``); every problem is one ``error`` (default WeightError) line."""
    error = error or WeightError
    idx = os.path.join(path, INDEX_NAME)
    try:
        raw = fileio.read_json(idx)
    except OSError as e:
        raise error(f"{idx}: invalid index file ({e})") from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise error(f"{idx}: invalid index file (expected an object with a non-empty 'weight_map')")
    for k, fn in wm.items():
        if (not isinstance(fn, str) or not fn or os.path.isabs(fn) or ".." in fn.split("/")
                or not fn.endswith(".safetensors")):
            raise error(f"{idx}: weight_map['{k}']: invalid shard name {fn!r} (expected a *.safetensors file in "
                        f"the same directory)")
    return wm

def check_finite(a: np.ndarray, key: str, where: str):
    """Refuse NaN/Inf in a loaded float weight, naming the tensor (a corrupt or overflowed checkpoint)."""
    if a.dtype.kind != "f" and a.dtype.name not in ("bfloat16",) and not a.dtype.name.startswith("float8"):
        return
    ok = np.isfinite(a) if a.dtype.kind == "f" else np.isfinite(a.astype(np.float32))
    if not ok.all():
        n = int(a.size - np.count_nonzero(ok))
        raise WeightError(f"{where}: tensor '{key}' contains {n} NaN/Inf value{'s' if n > 1 else ''} (of {a.size}); "
                          f"the checkpoint is corrupt")

def dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, block: int = 128) -> np.ndarray:
    """DeepSeek/GLM FP8 block dequant: ``w[..., i, j] * scale_inv[..., i // 128, j // 128]`` (leading axes, e.g. the
    expert axis of a fused ``[E, out, in]`` tensor, are carried through)."""
    w = w.astype(np.float32)
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block, axis=-2), block, axis=-1)
    if s.ndim != w.ndim or s.shape[-2] < w.shape[-2] or s.shape[-1] < w.shape[-1]:
        raise WeightError(f"FP8 scale_inv of shape {list(scale_inv.shape)} does not cover a weight of shape "
                          f"{list(w.shape)} in {block}x{block} blocks")
    return w * s[..., : w.shape[-2], : w.shape[-1]]

"""Load Hugging Face safetensors checkpoints into the params pytree (see WORKSPACE.md).

* single ``model.safetensors`` or sharded with ``model.safetensors.index.json``;
* bf16 / f16 / f32 (cast to the requested dtype), FP8 (``weight_scale_inv`` 128x128 blocks) dequantized on read;
* routed experts per-expert (``mlp.experts.{e}.gate_proj.weight``, what the hub and ``save_pretrained`` write) or
  fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).

A missing key or a wrong shape raises :class:`WeightError` naming the key and the expected shape.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np

from ..kernels.formats import QTensor, bank_from_float, fit_format, head_format, pack_layer, pack_table, to_qweight
from ..model import mla
from ..model.config import ModelConfig
from .container import DENSE_NAME, SafeTensorsDir
from .tensors import INDEX_NAME, WeightError, check_finite, dequant_fp8, read_index  # noqa: F401  (re-exported)

INT8_SCALE_SUFFIX = "_scale"   # int8 per-output-channel dense weights written by glm-jax-convert
class TensorSource:
    """Key -> numpy tensor over a directory of safetensors files (memory-mapped, read lazily)."""

    def __init__(self, path: str, files: Optional[list] = None):
        """``path``: a checkpoint directory; ``files``: restrict to these safetensors files (e.g. a container's
        dense.safetensors)."""
        self.path = path
        self._handles: dict = {}
        index = os.path.join(path, INDEX_NAME)
        by_key: dict[str, str] = {}
        if files is None and os.path.exists(index):
            for k, fn in read_index(path).items():
                by_key[k] = os.path.join(path, fn)
        else:
            cands = files or (sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
                              if os.path.isdir(path) else [])
            if not cands:
                raise WeightError(f"{path}: no model.safetensors or model.safetensors.index.json found")
            for fn in cands:
                full = os.path.join(path, fn)
                if not os.path.exists(full):
                    raise WeightError(f"{full}: not found")
                for k in self._open(full).keys():
                    by_key[k] = full
        self._files = by_key

    def _open(self, fn):
        from safetensors import safe_open

        h = self._handles.get(fn)
        if h is None:
            if not os.path.exists(fn):
                raise WeightError(f"{fn}: shard listed in the index is missing")
            try:
                h = safe_open(fn, framework="numpy")
            except Exception as e:  # corrupt header etc.
                raise WeightError(f"{fn}: cannot read safetensors file ({e})") from None
            self._handles[fn] = h
        return h

    def keys(self):
        return self._files.keys()

    def __contains__(self, key):
        return key in self._files

    def shape(self, key) -> tuple:
        try:
            return tuple(self._open(self._files[key]).get_slice(key).get_shape())
        except WeightError:
            raise
        except Exception as e:
            raise WeightError(f"{self._files[key]}: cannot read tensor '{key}' ({e})") from None

    def raw(self, key) -> np.ndarray:
        if key not in self._files:
            raise WeightError(f"{self.path}: missing tensor '{key}'")
        try:
            h = self._open(self._files[key])
            if h.get_slice(key).get_dtype().startswith("F8"):   # numpy has no float8: the raw reader (ml_dtypes)
                if getattr(self, "_raw_dirs", None) is None:
                    self._raw_dirs = {}
                d = os.path.dirname(self._files[key])
                if d not in self._raw_dirs:
                    self._raw_dirs[d] = SafeTensorsDir(d)
                return self._raw_dirs[d].read(key)
            return h.get_tensor(key)
        except WeightError:
            raise
        except Exception as e:
            raise WeightError(f"{self._files[key]}: cannot read tensor '{key}' ({e})") from None

    def get(self, key: str, shape: Optional[tuple] = None, dtype=np.float32, keep_quant: bool = False):
        """Read ``key`` as ``dtype``; FP8 tensors are dequantized with their ``weight_scale_inv``.  A dense weight
        that glm-jax-convert stored quantized (int8 / packed int4 + ``{key}_scale``) is dequantized, or with
        ``keep_quant`` returned as a ``quant.QTensor``."""
        if key not in self._files:
            exp = f" (expected shape {list(shape)})" if shape is not None else ""
            raise WeightError(f"{self.path}: missing tensor '{key}'{exp}")
        a = self.raw(key)
        if a.dtype in (np.int8, np.uint8) and key + INT8_SCALE_SUFFIX in self._files:   # --dense_format=int8|int4
            sc = self.raw(key + INT8_SCALE_SUFFIX)
            if sc.dtype not in (np.float16, np.float32):     # int4: f16 (f32 in older containers), int8: f32
                sc = sc.astype(np.float32)
            if a.dtype == np.int8:
                qt = QTensor(a, sc, "int8_row")
            else:
                n_in, ng = a.shape[-1] * 2, sc.shape[-1]
                # glm-jax-convert --dense_format=int4_g64 writes groups of 64 (a shorter last one where 64 does
                # not divide the row); otherwise the group that gives this many scales
                g = 64 if -(-n_in // 64) == ng else -(-n_in // ng)
                qt = QTensor(a, sc, "int4_row" if ng == 1 else f"int4_g{g}")
            if shape is not None and tuple(qt.shape) != tuple(shape):
                raise WeightError(f"{self._files[key]}: tensor '{key}' has shape {list(qt.shape)}, expected "
                                  f"{list(shape)}")
            if keep_quant:
                return qt
            a = qt.dequant()
        elif a.dtype.name.startswith("float8"):
            a = dequant_fp8(a, self.raw(key + "_scale_inv") if (key + "_scale_inv") in self._files
                            else self.raw(key.rsplit(".", 1)[0] + ".weight_scale_inv"))
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise WeightError(f"{self._files[key]}: tensor '{key}' has shape {list(a.shape)}, expected {list(shape)}")
        if dtype is not None and a.dtype != dtype:
            a = a.astype(dtype)
        check_finite(a, key, self._files[key])
        return a


# ----------------------------------------------------------------------------- key map
def _attn_gqa(get, pre: str, cfg: ModelConfig) -> dict:
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    p = {
        "q_w": get(pre + "q_proj.weight", (nh * hd, H)),
        "k_w": get(pre + "k_proj.weight", (nkv * hd, H)),
        "v_w": get(pre + "v_proj.weight", (nkv * hd, H)),
        "o_w": get(pre + "o_proj.weight", (H, nh * hd)),
    }
    if cfg.attention_bias:
        p["q_b"] = get(pre + "q_proj.bias", (nh * hd,))
        p["k_b"] = get(pre + "k_proj.bias", (nkv * hd,))
        p["v_b"] = get(pre + "v_proj.bias", (nkv * hd,))
    if cfg.use_qk_norm:
        p["q_norm"] = get(pre + "q_norm.weight", (hd,))
        p["k_norm"] = get(pre + "k_norm.weight", (hd,))
    return p


def _mlp(get, pre: str, H: int, I: int) -> dict:
    return {"gate_w": get(pre + "gate_proj.weight", (I, H)), "up_w": get(pre + "up_proj.weight", (I, H)),
            "down_w": get(pre + "down_proj.weight", (H, I))}


def load_experts(src: TensorSource, cfg: ModelConfig, layer: int, dtype=np.float32,
                 ids: Optional[list] = None) -> tuple[np.ndarray, np.ndarray]:
    """Routed experts of one layer as fused stacks ``gate_up [E, 2I, H]``, ``down [E, H, I]`` (``ids``: only those
    experts, in that order: a mesh process reads its own shard; per-expert keys read only those tensors, a fused
    checkpoint's [E, ...] tensors are read whole and sliced)."""
    E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    pre = f"model.layers.{layer}.mlp.experts."
    if pre + "gate_up_proj" in src:
        gu = src.get(pre + "gate_up_proj", (E, 2 * I, H), dtype)
        dn = src.get(pre + "down_proj", (E, H, I), dtype)
        if ids is not None:
            gu, dn = np.ascontiguousarray(gu[ids]), np.ascontiguousarray(dn[ids])
        return gu, dn
    for proj, shp in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):    # before allocating E of them
        k = f"{pre}0.{proj}_proj.weight"
        if k not in src:
            raise WeightError(f"{src.path}: missing tensor '{k}' (expected shape {list(shp)})")
        if src.shape(k) != shp:
            raise WeightError(f"{src._files[k]}: tensor '{k}' has shape {list(src.shape(k))}, expected {list(shp)}")
    ids = list(range(E)) if ids is None else list(ids)
    gu = np.empty((len(ids), 2 * I, H), dtype)
    dn = np.empty((len(ids), H, I), dtype)
    for j, e in enumerate(ids):
        gu[j, :I] = src.get(f"{pre}{e}.gate_proj.weight", (I, H), dtype)
        gu[j, I:] = src.get(f"{pre}{e}.up_proj.weight", (I, H), dtype)
        dn[j] = src.get(f"{pre}{e}.down_proj.weight", (H, I), dtype)
    return gu, dn


def _float(a):
    return a.dequant() if isinstance(a, QTensor) else a


_MLA_LINEAR_KEYS = ("q_a_proj.weight", "q_b_proj.weight", "self_attn.q_proj.weight", "kv_a_proj_with_mqa.weight",
                    "o_proj.weight")


def load_layer(get: Callable, cfg: ModelConfig, i: int, moe: bool) -> dict:
    """Everything of layer i except its routed experts."""
    H = cfg.hidden_size
    pre = f"model.layers.{i}."
    lp = {"input_norm": get(pre + "input_layernorm.weight", (H,)),
          "post_norm": get(pre + "post_attention_layernorm.weight", (H,))}
    if cfg.is_mla:
        # The projections q_a, q_b (or q_proj), kv_a, o are plain linears: kept as stored, packed by
        # formats.pack_layer.  The rest is float: kv_b is reshaped for absorption (per-head W_UK / W_UV) and the DSA
        # indexer's top-k is discrete (int8 activations there flipped its picks on the golden DSA model)
        def get_mla(key, shape=None):
            a = get(key, shape)
            return a if key.endswith(_MLA_LINEAR_KEYS) and ".indexer." not in key else _float(a)
        lp["attn"] = mla.load_mla_params(get_mla, pre + "self_attn.", cfg, i)
    else:
        lp["attn"] = _attn_gqa(get, pre + "self_attn.", cfg)
    if moe:
        E = cfg.n_routed_experts
        lp["moe"] = {
            "router_w": get(pre + "mlp.gate.weight", (E, H), np.float32),
            "router_bias": get(pre + "mlp.gate.e_score_correction_bias", (E,), np.float32),
            "shared": _mlp(get, pre + "mlp.shared_experts.", H, cfg.moe_intermediate_size * cfg.n_shared_experts),
        }
    else:
        lp["mlp"] = _mlp(get, pre + "mlp.", H, cfg.intermediate_size)
    return lp


def dense_shapes(cfg: ModelConfig, has_key: Callable) -> dict:
    """{key: shape} of every dense (non-expert) tensor ``load_params`` reads for ``cfg`` -- the same key map, with
    a ``get`` that records instead of reading (its arrays are zero-strided views: nothing allocated) -- so the
    converter refuses what the engine would refuse.  ``has_key``: the optional MTP tensors present in the source."""
    want = {}

    def get(key, shape=None, dt=np.float32):
        want[key] = tuple(shape)
        return np.broadcast_to(np.zeros((), np.float32), shape)
    H, V = cfg.hidden_size, cfg.vocab_size
    get("model.embed_tokens.weight", (V, H))
    get("model.norm.weight", (H,))
    if not cfg.tie_word_embeddings:
        get("lm_head.weight", (V, H))
    for i in range(cfg.num_hidden_layers):
        load_layer(get, cfg, i, cfg.is_moe_layer(i))
    L = cfg.num_hidden_layers
    pre = f"model.layers.{L}."
    if cfg.has_mtp and has_key(pre + "eh_proj.weight"):
        for k, shp in (("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("eh_proj.weight", (H, 2 * H)),
                       ("shared_head.norm.weight", (H,))):
            get(pre + k, shp)
        for k in ("shared_head.head.weight", "embed_tokens.weight"):
            if has_key(pre + k):
                get(pre + k, (V, H))
        load_layer(get, cfg, L, True)
    return want


_F32_KEYS = ("router_w", "router_bias", "weights_proj")   # kept f32 as transformers does


def _cast_tree(tree, dtype):
    import jax.numpy as jnp

    def cast(path_key, a):
        if a is None:
            return None
        if path_key in _F32_KEYS:
            return jnp.asarray(a, jnp.float32)
        return jnp.asarray(a, dtype)

    def walk(t, k=None):
        if isinstance(t, dict):
            return {kk: walk(v, kk) for kk, v in t.items()}
        if isinstance(t, list):
            return [walk(v, k) for v in t]
        if isinstance(t, np.ndarray) or hasattr(t, "dtype"):
            return cast(k, t)
        return t

    return walk(tree)


def load_params(path: str, cfg: ModelConfig, dtype=None, expert_fmt: Optional[str] = "f32",
                load_mtp: bool = True, src: Optional[TensorSource] = None, kernel: str = "xla",
                dense_fmt: str = "native", fuse: bool = True, expert_kernel: Optional[str] = None,
                expert_bank: Optional[Callable] = None, pack: Optional[bool] = None) -> dict:
    """Build the params pytree.  ``expert_fmt=None`` leaves routed experts out (they are streamed by a store);
    otherwise they are stored resident as an ExpertBank in that format (f32 / bf16 / int8_row / int4_g64 ...).
    ``kernel="native"`` (or a ``dense_fmt`` other than "native") packs the dense matrices as QWeights
    (quant.pack_layer: fused q/k/v and gate/up unless ``fuse=False``, stored-quantized weights kept quantized);
    ``pack=True`` packs for the XLA path too (a tensor-parallel mesh: stored bf16 / int8 stay so, split by rows).
    ``expert_kernel``: who computes the experts (default ``kernel``); ``expert_bank(load, fmt, kernel)`` builds a
    layer's bank from ``load(ids) -> (gate_up, down)`` and returns (bank, slot map): a mesh reads only its shards
    (mesh.MeshPlan.resident_bank); default: every expert into one bank."""
    import jax.numpy as jnp


    dtype = dtype or jnp.float32
    src = src or TensorSource(path)
    if expert_fmt is not None:
        expert_fmt, note = fit_format(_bank_fmt(expert_fmt, dtype), cfg.hidden_size, cfg.moe_intermediate_size)
        if note:
            import sys
            print(f"glm-jax: note: {note}", file=sys.stderr)
    pack = (kernel == "native" or dense_fmt != "native") if pack is None else pack
    ekernel = expert_kernel or kernel

    def experts(layer):
        fmt = _bank_fmt(expert_fmt, dtype)
        if expert_bank is not None:
            bank, smap = expert_bank(lambda ids: load_experts(src, cfg, layer, ids=ids), fmt, ekernel)
            return {"experts": bank, "slot_of": smap}
        return {"experts": bank_from_float(*load_experts(src, cfg, layer), fmt, ekernel)}

    def get(key, shape=None, dt=np.float32):
        # packed: keep the stored float dtype (a bf16 matrix stays bf16 in its QWeight; _cast_tree casts the rest)
        return src.get(key, shape, None if pack and dt is np.float32 else dt, keep_quant=pack)

    # every piece is packed and cast to device arrays as soon as it is read, so the load's peak memory is the
    # result plus one layer's temporaries (not the whole model in numpy, then packed, then cast)
    def layer(lp):
        a = lp.get("attn")
        if fuse and a is not None and "kv_b_w" in a:      # one device: W_UK / W_UV contiguous, split once
            lp = dict(lp, attn=mla.presplit_kv_b(a, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim))
        return _cast_tree(pack_layer(lp, kernel, dense_fmt, dtype, fuse) if pack else lp, dtype)

    def table(a):
        return pack_table(a, kernel, dense_fmt, dtype) if pack else a

    def head_matrix(a):
        return to_qweight(a, head_format(dense_fmt), kernel, dtype) if pack else a

    H, V = cfg.hidden_size, cfg.vocab_size
    emb = get("model.embed_tokens.weight", (V, H))
    params = {"embed": table(emb), "norm": get("model.norm.weight", (H,))}
    params["lm_head"] = head_matrix(emb if cfg.tie_word_embeddings else get("lm_head.weight", (V, H)))
    del emb
    params = _cast_tree(params, dtype)
    layers = []
    for i in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(i)
        layers.append(layer(load_layer(get, cfg, i, moe)))
        if moe and expert_fmt is not None:
            layers[-1].update(experts(i))
    params["layers"] = layers
    params["mtp"] = None
    L = cfg.num_hidden_layers
    if load_mtp and cfg.has_mtp and f"model.layers.{L}.eh_proj.weight" in src:
        pre = f"model.layers.{L}."
        mtp = {"enorm": get(pre + "enorm.weight", (H,)), "hnorm": get(pre + "hnorm.weight", (H,)),
               "eh_proj": get(pre + "eh_proj.weight", (H, 2 * H)),
               "head_norm": get(pre + "shared_head.norm.weight", (H,))}
        if pack:
            mtp["eh_proj"] = to_qweight(mtp["eh_proj"], dense_fmt, kernel, dtype)
        mtp["head"] = (head_matrix(get(pre + "shared_head.head.weight", (V, H)))
                       if pre + "shared_head.head.weight" in src else None)
        mtp["embed"] = (table(get(pre + "embed_tokens.weight", (V, H))) if pre + "embed_tokens.weight" in src
                        else None)
        mtp = _cast_tree(mtp, dtype)
        mtp["layer"] = layer(load_layer(get, cfg, L, True))
        if expert_fmt is not None:
            mtp["layer"].update(experts(L))
        params["mtp"] = mtp
    return params


def load_dense_params(path: str, cfg: ModelConfig, dtype=None, file: Optional[str] = None, kernel: str = "xla",
                      dense_fmt: str = "native", fuse: bool = True, pack: Optional[bool] = None) -> dict:
    """Dense (non-expert) params of a glm-jax-convert container (its dense.safetensors, or ``file``)."""
    return load_params(path, cfg, dtype=dtype, expert_fmt=None,
                       src=TensorSource(path, files=[os.path.basename(file) if file else DENSE_NAME]),
                       kernel=kernel, dense_fmt=dense_fmt, fuse=fuse, pack=pack)


def _bank_fmt(expert_fmt: str, dtype) -> str:
    import jax.numpy as jnp

    if expert_fmt in ("auto", "native"):
        return "bf16" if dtype == jnp.bfloat16 else "f32"
    return expert_fmt

"""Load a glm5_next (GLM-5.3) text checkpoint into the params pytree of ``model/glm5_next.py``.

HF key names as the hub and ``save_pretrained`` write them: multimodal checkpoints under ``model.language_model.``
(the vision tower's ``model.visual.*`` is not read), flat text-only ones under ``model.``; per-expert or fused
routed experts (weights.load_experts); the q/k/v short convolutions as three [D, 1, K] tensors; the forget gate's
``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log`` directly under ``self_attn``; hyper-connections as
``hc_{attn,ffn}_{fn,base,scale}``.  Everything is read as float (the dense formats and the streamed path come
later); ``_keep_in_fp32_modules_strict``'s tensors stay f32.

glm-jax-convert reads the text part through ``TextTensors`` (the flat ``model.`` names; the vision tower is not
converted); a converted container loads with every expert resident (``load_container_params``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..kernels.formats import FLOAT_FORMATS, ExpertBank, bank_from_float, with_kernel
from ..model.config import ModelConfig
from ..model.dsa_pool import load_pooled_params
from ..model.glm5_next import is_linear
from ..model.kda import load_kda_params
from .container import Container, SafeTensorsDir, open_container, verify_dense
from .tensors import WeightError
from .weights import TensorSource, _bank_fmt, _mlp, load_experts

TEXT_PREFIXES = ("model.language_model.", "model.")
_F32 = ("router_w", "router_bias", "weights_proj", "conv_w", "dt_bias", "A_log", "base", "scale")


class PrefixedSource:
    """A TensorSource seen through the ``model.`` names: ``model.X`` reads ``<prefix>X`` (weights.load_experts and
    the key map name the flat layout)."""

    def __init__(self, src: TensorSource, prefix: str):
        self.src, self.prefix, self.path = src, prefix, src.path

    def _key(self, key: str) -> str:
        return self.prefix + key[len("model."):] if key.startswith("model.") else key

    def __contains__(self, key):
        return self._key(key) in self.src

    @property
    def _files(self):           # load_experts names the file of a bad tensor through it
        return _Files(self)

    def shape(self, key):
        return self.src.shape(self._key(key))

    def get(self, key, shape=None, dtype=np.float32, keep_quant: bool = False):
        return self.src.get(self._key(key), shape, dtype, keep_quant)


class _Files:
    def __init__(self, ps: PrefixedSource):
        self.ps = ps

    def __getitem__(self, key):
        return self.ps.src._files[self.ps._key(key)]


def text_prefix(src: TensorSource) -> str:
    for p in TEXT_PREFIXES:
        if p + "embed_tokens.weight" in src:
            return p
    raise WeightError(f"{src.path}: missing tensor 'model.language_model.embed_tokens.weight' (or the flat "
                      f"'model.embed_tokens.weight')")


def _hc(get, pre: str, which: str, cfg: ModelConfig) -> dict:
    N, H = cfg.hc_mult, cfg.hidden_size
    n = (2 + N) * N
    return {"fn": get(f"{pre}hc_{which}_fn", (n, N * H)), "base": get(f"{pre}hc_{which}_base", (n,)),
            "scale": get(f"{pre}hc_{which}_scale", (3,))}


def load_layer(get, cfg: ModelConfig, i: int) -> dict:
    """Everything of layer i except its routed experts."""
    H = cfg.hidden_size
    pre = f"model.layers.{i}."
    lp = {"input_norm": get(pre + "input_layernorm.weight", (H,)),
          "post_norm": get(pre + "post_attention_layernorm.weight", (H,)),
          "attn_hc": _hc(get, pre, "attn", cfg), "ffn_hc": _hc(get, pre, "ffn", cfg)}
    if is_linear(cfg, i):
        lp["kda"] = load_kda_params(get, pre + "self_attn.", cfg)
    else:
        lp["attn"] = load_pooled_params(get, pre + "self_attn.", cfg, cfg.indexer_types[i] == "full")
    if cfg.is_moe_layer(i):
        E = cfg.n_routed_experts
        lp["moe"] = {"router_w": get(pre + "mlp.gate.weight", (E, H)),
                     "router_bias": get(pre + "mlp.gate.e_score_correction_bias", (E,)),
                     "shared": _mlp(get, pre + "mlp.shared_experts.", H,
                                    cfg.moe_intermediate_size * cfg.n_shared_experts)}
    else:
        lp["mlp"] = _mlp(get, pre + "mlp.", H, cfg.intermediate_size)
    return lp


def _cast(tree, dtype):
    import jax.numpy as jnp

    def walk(t, k=None):
        if isinstance(t, dict):
            return {kk: walk(v, kk) for kk, v in t.items()}
        if isinstance(t, np.ndarray):
            return jnp.asarray(t, jnp.float32 if k in _F32 else dtype)
        return t
    return walk(tree)


def load_params(path: str, cfg: ModelConfig, dtype=None, expert_fmt: Optional[str] = "f32",
                kernel: str = "xla", src: Optional[TensorSource] = None) -> dict:
    """The params pytree (routed experts resident as an ExpertBank in ``expert_fmt``; None leaves them out)."""
    import jax.numpy as jnp

    dtype = dtype or jnp.float32
    base = src or TensorSource(path)
    src = PrefixedSource(base, text_prefix(base))
    get = lambda key, shape=None: src.get(key, shape, np.float32)   # noqa: E731
    H, V = cfg.hidden_size, cfg.vocab_size
    emb = get("model.embed_tokens.weight", (V, H))
    head_key = "lm_head.weight"
    params = {"embed": emb, "norm": get("model.norm.weight", (H,)),
              "lm_head": emb if cfg.tie_word_embeddings else base.get(head_key, (V, H), np.float32)}
    params = _cast(params, dtype)
    layers = []
    for i in range(cfg.num_hidden_layers):
        lp = _cast(load_layer(get, cfg, i), dtype)
        if cfg.is_moe_layer(i) and expert_fmt is not None:
            lp["experts"] = bank_from_float(*load_experts(src, cfg, i), _bank_fmt(expert_fmt, dtype), kernel)
        layers.append(lp)
    params["layers"] = layers
    params["mtp"] = None
    return params



def dense_shapes(cfg: ModelConfig, has_key=None) -> dict:
    """{flat key: shape} of every dense tensor ``load_params`` reads for ``cfg`` (its key map with a ``get`` that
    records: the converter refuses what the engine would refuse).  ``has_key``: unused (no MTP layer is built)."""
    want = {}

    def get(key, shape=None):
        want[key] = tuple(shape)
        return np.broadcast_to(np.zeros((), np.float32), shape)
    H, V = cfg.hidden_size, cfg.vocab_size
    get("model.embed_tokens.weight", (V, H))
    get("model.norm.weight", (H,))
    if not cfg.tie_word_embeddings:
        get("lm_head.weight", (V, H))
    for i in range(cfg.num_hidden_layers):
        load_layer(get, cfg, i)
    return want


class TextTensors:
    """A SafeTensorsDir seen as a flat text-only checkpoint: ``model.X`` reads ``<prefix>X`` (``text_prefix``), the
    top-level ``lm_head.weight`` as it is; the vision tower's tensors and those of layers past ``num_hidden_layers``
    (the MTP layer hub checkpoints carry, which transformers skips on load) are not listed (what glm-jax-convert
    reads)."""

    def __init__(self, st: SafeTensorsDir, cfg: ModelConfig):
        self.st, self.path = st, st.path
        prefix = text_prefix(st)
        past = tuple(f"model.layers.{i}." for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + 8))
        names = {("model." + k[len(prefix):] if k.startswith(prefix) else k): k
                 for k in st.keys() if k.startswith(prefix) or not k.startswith("model.")}
        self._names = {n: k for n, k in names.items() if not n.startswith(past)}
        self.tensors = {n: st.tensors[k] for n, k in self._names.items()}

    def keys(self):
        return self._names.keys()

    def __contains__(self, key):
        return key in self._names

    def _k(self, key: str) -> str:
        return self._names.get(key, key)

    def info(self, key: str):
        return self.st.info(self._k(key))

    def read(self, key: str) -> np.ndarray:
        return self.st.read(self._k(key))

    def read_row(self, key: str, i: int) -> np.ndarray:
        return self.st.read_row(self._k(key), i)

    def read_float(self, key: str) -> np.ndarray:
        return self.st.read_float(self._k(key))

    def is_fp8(self, key: str) -> bool:
        return self.st.is_fp8(self._k(key))

    def close(self):
        self.st.close()


def container_bank(cont: Container, layer: int, kernel: str) -> ExpertBank:
    """Every expert of one layer of a converted container as a resident ExpertBank (the records' own format and
    layout: quantized formats in the native kernels' tiles, which the XLA paths read through ``as_rows``)."""
    import jax.numpy as jnp

    lay, E = cont.layout(layer), cont.num_experts(layer)
    arrs = {s.name: np.empty((E,) + tuple(s.shape), s.np_dtype) for s in lay.sections}
    for e in range(E):
        cont.read_expert(layer, e, {n: a[e] for n, a in arrs.items()})
    arrs = {n: jnp.asarray(a) for n, a in arrs.items()}
    if lay.fmt in FLOAT_FORMATS:
        bank = ExpertBank(arrs["gate_up"], arrs["down"], fmt=lay.fmt)
    else:
        bank = ExpertBank(arrs["gate_up"], arrs["down"], arrs["gate_up_scale"], arrs["down_scale"], fmt=lay.fmt,
                          layout="tiles", hidden=lay.hidden, inter=lay.inter)
    return with_kernel(bank, kernel)


def load_container_params(path: str, cfg: ModelConfig, dtype=None, kernel: str = "xla") -> dict:
    """A glm-jax-convert container of a glm5_next checkpoint: the dense file through ``load_params`` (quantized
    dense tensors dequantized on read), every routed expert resident in the container's format."""
    cont = open_container(path, cfg, verify="first")
    try:
        verify_dense(path, cont.manifest)
        params = load_params(path, cfg, dtype, expert_fmt=None, kernel=kernel,
                             src=TensorSource(path, files=[cont.dense_path]))
        for i, lp in enumerate(params["layers"]):
            if cfg.is_moe_layer(i):
                lp["experts"] = container_bank(cont, i, kernel)
    finally:
        cont.close()
    return params

"""Load a glm5_next (GLM-5.3) text checkpoint into the params pytree of ``model/glm5_next.py``.

HF key names as the hub and ``save_pretrained`` write them: multimodal checkpoints under ``model.language_model.``
(the vision tower's ``model.visual.*`` is not read), flat text-only ones under ``model.``; per-expert or fused
routed experts (weights.load_experts); the q/k/v short convolutions as three [D, 1, K] tensors; the forget gate's
``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log`` directly under ``self_attn``; hyper-connections as
``hc_{attn,ffn}_{fn,base,scale}``.  Everything is read as float (the dense formats and the streamed path come
later); ``_keep_in_fp32_modules_strict``'s tensors stay f32.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..kernels.formats import bank_from_float
from ..model.config import ModelConfig
from ..model.dsa_pool import load_pooled_params
from ..model.glm5_next import is_linear
from ..model.kda import load_kda_params
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


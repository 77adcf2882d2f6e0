"""glm5_next (GLM-5.3 text) as flax NNX modules with logical axes, beside modules.py's (same Node / Split machinery):
``Glm5NextModel(params)`` wraps ``experts/glm5_next_weights.py``'s params pytree; ``__call__`` is
``glm5_next.step``, so the runner's one-jit step runs it through ``Split`` as it runs the other families."""

from __future__ import annotations

from flax import nnx

from . import glm5_next
from .modules import MLP, GlmModel, MLAAttention, MoE, Node, _vector
from .router import identity_plugin


class KDA(Node):
    """KDA linear attention: q/k/v and the gates' up projections by heads; the short conv by channel (q|k|v)."""
    AXES = {"q_w": ("heads", "embed"), "k_w": ("heads", "embed"), "v_w": ("heads", "embed"),
            "conv_w": ("qkv", None), "f_a_w": ("head_dim", "embed"), "f_b_w": ("heads", "head_dim"),
            "dt_bias": _vector("heads"), "A_log": _vector("heads"), "b_w": ("heads", "embed"),
            "g_a_w": ("head_dim", "embed"), "g_b_w": ("heads", "head_dim"), "o_norm": _vector("head_dim"),
            "o_w": ("embed", "heads")}


class HyperConnection(Node):
    """One hyper-connection's mixing map: small, replicated."""
    AXES = {"fn": ("hc", None), "base": _vector("hc"), "scale": _vector(None)}


class PooledIndexer(Node):
    """The k-pooled DSA indexer (full layers): small, replicated."""
    AXES = {"wq_b": ("indexer", "lora"), "wk": ("index_dim", "embed"), "weights_proj": ("indexer_heads", "embed"),
            "k_norm_w": _vector("index_dim"), "k_norm_b": _vector("index_dim"), "ape": (None, "index_dim"),
            "gate_w": ("index_dim", "embed")}


class PooledAttention(MLAAttention):
    CHILDREN = {"indexer": PooledIndexer}


class Glm5NextLayer(Node):
    AXES = {"input_norm": _vector("embed"), "post_norm": _vector("embed")}
    CHILDREN = {"kda": KDA, "attn": PooledAttention, "attn_hc": HyperConnection, "ffn_hc": HyperConnection,
                "mlp": MLP, "moe": MoE}


class Glm5NextModel(Node):
    AXES = {"embed": ("vocab", "embed"), "norm": _vector("embed"), "lm_head": ("vocab", "embed")}

    def _wrap(self, k, v):
        if k == "layers":
            return nnx.List([Glm5NextLayer(lp) for lp in v])
        return super()._wrap(k, v)

    def __call__(self, cfg, cache, tokens, start, lengths=None, resident=None, plugin=None, moe_rows=None,
                 logit_rows=None):
        del moe_rows        # every row's routed experts run (the seam's gather path is row-invariant here)
        return glm5_next.step(cfg, self.params(), cache, tokens, start, lengths, resident, plugin or identity_plugin,
                              logit_rows)


def model_class(cfg):
    """The NNX model class of a config's family."""
    return Glm5NextModel if cfg.model_type == "glm5_next" else GlmModel

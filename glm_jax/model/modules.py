"""The model as flax NNX modules: every parameter an ``nnx.Param`` carrying its logical axes (model layer).

One definition says what each parameter is and how it shards: the ``AXES`` table of each module class names the
logical axis of every dimension of every parameter it holds ("heads", "kv_heads", "mlp", "expert", "embed",
"vocab", ...); ``glm_jax/runtime/mesh.py`` maps logical axes to mesh axes (THE SHARDING RULES, one table) and places the
state.  A module's parameters are exactly one entry of the params pytree documented in WORKSPACE.md (attribute name
= dict key), and ``params()`` returns that pytree (the same arrays, no copy): the forward math stays the pure
functions of model.py / mla.py that the streaming loop also calls layer by layer; ``GlmModel.__call__`` is
``model.step`` on the model's parameters.  Routing plugins stay pure functions over the routing arrays; the MoE seam
(``model.moe_routed``) stays the one seam.

The loader fills it: ``GlmModel(params)`` over what ``weights.load_params`` read (shapes checked against the config
key by key there).  Dense matrices packed for the native kernels (``quant.QWeight``: float, or quantized in the rows
or tiles layout) become a ``Linear`` (``q`` / ``scale`` Params, format fields static); a layer's routed experts
(``quant.ExpertBank``) an ``Experts`` module (slots on the "expert" axis; its format, kernel and mesh static).

Hot paths jit over split state: ``Split.of(model)`` is ``nnx.split``'s (graphdef, state) as one jit argument whose
leaves are the state's arrays and whose static part is the graphdef; ``model.step`` merges it inside the trace and
calls the module (``nnx.merge`` -> ``GlmModel.__call__``), ``model.mtp_forward`` merges it into its params pytree,
so the compiled program is the one the params pytree gives and the dispatch flattens a flat list of arrays
(graph-mode ``nnx.jit`` per call costs ~10x).
"""

from __future__ import annotations

import jax
from flax import nnx

from ..kernels.formats import ExpertBank, QWeight
from . import transformer
from .router import identity_plugin


def _param(value, axes):
    axes = tuple(axes)
    if len(axes) != getattr(value, "ndim", len(axes)):
        raise ValueError(f"internal: logical axes {axes} for a parameter of shape {getattr(value, 'shape', '?')}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _vector(name):
    return (name,)


class Linear(nnx.Module):
    """A dense matrix ``[out, in]`` (HF orientation, math ``x @ W.T``): a float array, or a ``quant.QWeight``
    (``q`` + ``scale`` Params; fmt / kernel / layout / dims static).  Quantized weights in the native kernels'
    tiles layout (16 rows interleaved) are kept whole (replicated): the native kernels read whole matrices; a
    tensor-parallel mesh loads dense weights for the XLA path in rows layout (mesh.py)."""

    def __init__(self, w, axes):
        out_ax, in_ax = axes[-2:]            # (MLA's per-head W_UK^T / W_UV: a leading heads axis, tiles: whole)
        if isinstance(w, QWeight):
            self.meta = (w.fmt, w.kernel, w.layout, tuple(w.dims))
            if w.layout == "tiles":
                qa, sa = (None,) * w.q.ndim, (None,) * (0 if w.scale is None else w.scale.ndim)
            elif w.scale is None:                       # float QWeight [out, in]
                qa, sa = (out_ax, in_ax), ()
            else:                                       # quantized rows: [out, in'] + scale [out, groups]
                qa, sa = (out_ax, None), (out_ax, None)  # the input axis of packed data stays whole
            self.q = _param(w.q, qa)
            self.scale = None if w.scale is None else _param(w.scale, sa)
        else:
            self.meta = None
            self.q = _param(w, axes)
            self.scale = None

    def value(self):
        if self.meta is None:
            return self.q[...]
        fmt, kernel, layout, dims = self.meta
        return QWeight(self.q[...], None if self.scale is None else self.scale[...], fmt=fmt, kernel=kernel,
                       layout=layout, dims=dims)


class Experts(nnx.Module):
    """One MoE layer's routed-expert slots (a ``quant.ExpertBank``): every array's first axis is the slot axis,
    logical "expert" (sharded over the mesh's expert axis for a mesh bank)."""

    FIELDS = ("gate_up", "down", "gate_up_scale", "down_scale")

    def __init__(self, bank: ExpertBank):
        self.meta = (bank.fmt, bank.kernel, bank.layout, bank.hidden, bank.inter, bank.mesh, bank.comm)
        for f in self.FIELDS:
            a = getattr(bank, f)
            setattr(self, f, None if a is None else _param(a, ("expert",) + (None,) * (a.ndim - 1)))

    def value(self) -> ExpertBank:
        fmt, kernel, layout, hidden, inter, mesh, comm = self.meta
        arrs = {f: (None if getattr(self, f) is None else getattr(self, f)[...]) for f in self.FIELDS}
        return ExpertBank(**arrs, fmt=fmt, kernel=kernel, layout=layout, hidden=hidden, inter=inter, mesh=mesh,
                          comm=comm)


class SlotMap(nnx.Variable):
    """Where each routed expert sits in its layer's bank: ``[E]`` (one device) or ``[n, E]`` (a mesh bank: row d =
    shard d's slots, -1 where it does not hold the expert).  Not a learned parameter."""


class Node(nnx.Module):
    """A params-pytree dict as a module: ``AXES`` gives every array parameter's logical axes (one name or None per
    dimension; a callable of the array's ndim where the rank varies), ``CHILDREN`` the module class of every
    sub-dict.  An unknown key is an error, so every parameter the loader produces has declared axes."""

    AXES: dict = {}
    CHILDREN: dict = {}

    def __init__(self, d: dict):
        self.keys_ = tuple(d)
        for k, v in d.items():
            if hasattr(Node, k):
                raise ValueError(f"internal: parameter name {k!r} shadows a module attribute")
            setattr(self, k, self._wrap(k, v))

    def _wrap(self, k, v):
        if v is None:
            return None
        if k in self.CHILDREN:
            return self.CHILDREN[k](v)
        if isinstance(v, ExpertBank):
            return Experts(v)
        if k == "slot_of":
            return SlotMap(v, out_sharding=("expert", None) if v.ndim == 2 else (None,), eager_sharding=False)
        if k not in self.AXES:
            raise ValueError(f"internal: {type(self).__name__} has no logical axes for parameter {k!r}")
        axes = self.AXES[k]
        axes = axes(v.ndim) if callable(axes) else axes
        if isinstance(v, QWeight):
            return Linear(v, axes)
        return _param(v, axes)

    def params(self) -> dict:
        out = {}
        for k in self.keys_:
            v = getattr(self, k)
            if v is None:
                out[k] = None
            elif isinstance(v, (Node, nnx.List)):
                out[k] = [x.params() for x in v] if isinstance(v, nnx.List) else v.params()
            elif isinstance(v, (Linear, Experts)):
                out[k] = v.value()
            else:
                out[k] = v[...]
        return out


# ----------------------------------------------------------------------------- the pieces
class MLP(Node):
    """Dense MLP and the shared expert: gate/up [I, H] (fused ``gate_up`` [2I, H] for the native kernels), down
    [H, I]; tensor-parallel over the intermediate axis."""
    AXES = {"gate_w": ("mlp", "embed"), "up_w": ("mlp", "embed"), "down_w": ("embed", "mlp"),
            "gate_up": ("gate_up", "embed")}


class GQAAttention(Node):
    """glm4_moe attention: q/k/v [heads*hd, H] (fused ``qkv`` for the native kernels), o [H, heads*hd], optional
    biases and per-head q/k norms; heads split over the model axis."""
    AXES = {"q_w": ("heads", "embed"), "k_w": ("kv_heads", "embed"), "v_w": ("kv_heads", "embed"),
            "q_b": _vector("heads"), "k_b": _vector("kv_heads"), "v_b": _vector("kv_heads"),
            "qkv": ("qkv", "embed"), "qkv_b": _vector("qkv"), "o_w": ("embed", "heads"),
            "q_norm": _vector("head_dim"), "k_norm": _vector("head_dim")}


class Indexer(Node):
    """The DSA indexer (glm_moe_dsa "full" layers): small, replicated."""
    AXES = {"wq_b": ("indexer", "lora"), "wk": ("index_dim", "embed"), "weights_proj": ("indexer_heads", "embed"),
            "k_norm_w": _vector("index_dim"), "k_norm_b": _vector("index_dim")}


class MLAAttention(Node):
    """MLA attention (glm_moe_dsa with the DSA indexer, glm4_moe_lite without): the low-rank down projections
    replicated, the per-head up projections (q_b or q_proj, kv_b) and o split by heads over the model axis; the
    latent KV cache is shared by all heads (replicated)."""
    AXES = {"q_a_w": ("lora", "embed"), "q_a_norm": _vector("lora"), "q_b_w": ("heads", "lora"),
            "q_proj_w": ("heads", "embed"),
            "kv_a_w": ("lora", "embed"), "kv_a_norm": _vector("lora"), "kv_b_w": ("heads", "lora"),
            "o_w": ("embed", "heads"), "q_a_b": _vector("lora"), "kv_a_b": _vector("lora"), "o_b": _vector("embed"),
            # one device: kv_b split at load into contiguous per-head W_UK^T / W_UV (mla.py absorbs them)
            "w_uk_t": ("heads", "lora", "head_dim"), "w_uv": ("heads", "head_dim", "lora")}
    CHILDREN = {"indexer": Indexer}


class MoE(Node):
    """Router (f32, replicated) + shared expert.  The routed experts sit beside it in the layer (``experts``)."""
    AXES = {"router_w": ("router", "embed"), "router_bias": _vector("router")}
    CHILDREN = {"shared": MLP}


def _attention_class(d):
    return MLAAttention(d) if ("kv_b_w" in d or "w_uk_t" in d) else GQAAttention(d)


class DecoderLayer(Node):
    """One decoder layer: norms, attention, and a dense MLP or a MoE (router + shared expert + routed experts)."""
    AXES = {"input_norm": _vector("embed"), "post_norm": _vector("embed")}
    CHILDREN = {"attn": _attention_class, "mlp": MLP, "moe": MoE}


class MTP(Node):
    """The MTP (nextn) layer: enorm / hnorm / eh_proj / shared_head norm, optional own head and embedding, and one
    MoE decoder layer."""
    AXES = {"enorm": _vector("embed"), "hnorm": _vector("embed"), "eh_proj": ("embed", "embed2"),
            "head_norm": _vector("embed"), "head": ("vocab", "embed"), "embed": ("vocab", "embed")}
    CHILDREN = {"layer": DecoderLayer}


class GlmModel(Node):
    """The whole model (glm4_moe or glm_moe_dsa).  ``GlmModel(params)`` wraps the loader's params pytree;
    ``__call__`` is ``model.step``."""
    AXES = {"embed": ("vocab", "embed"), "norm": _vector("embed"), "lm_head": ("vocab", "embed")}
    CHILDREN = {"mtp": MTP}

    def _wrap(self, k, v):
        if k == "layers":
            return nnx.List([DecoderLayer(lp) for lp in v])
        return super()._wrap(k, v)

    def __call__(self, cfg, cache, tokens, start, lengths=None, resident=None, plugin=None, moe_rows=None,
                 logit_rows=None):
        return transformer.step(cfg, self.params(), cache, tokens, start, lengths, resident,
                                plugin or identity_plugin, moe_rows, logit_rows)


# ----------------------------------------------------------------------------- split state as a jit argument
@jax.tree_util.register_pytree_node_class
class Split:
    """``nnx.split(model)`` as one jit argument: leaves = the state's arrays (a flat list: cheap to dispatch),
    static = (graphdef, the state's treedef).  ``params()`` merges them inside the trace."""

    def __init__(self, graphdef, treedef, leaves):
        self.graphdef, self.treedef, self.leaves = graphdef, treedef, list(leaves)

    @classmethod
    def of(cls, model: nnx.Module) -> "Split":
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        return cls(graphdef, treedef, leaves)

    def tree_flatten(self):
        return tuple(self.leaves), (self.graphdef, self.treedef)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(aux[0], aux[1], leaves)

    def merge(self) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, self.leaves))

    def params(self) -> dict:
        return self.merge().params()

"""Model configuration read from a Hugging Face ``config.json``.

One dataclass covers every supported family.  Fields shared by all GLM MoE models
sit at the top; architecture-specific blocks (GQA attention for ``glm4_moe``, MLA +
DSA indexer for ``glm_moe_dsa``, MLA alone for ``glm4_moe_lite``) are plain optional
fields, so adding a family adds fields, it does not reshape the class.  Each family's
own fields are parsed by its own function (``_FAMILIES``).

Every problem is a :class:`ConfigError` whose one-line message names the file and
the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

from .. import fileio
from ..errors import GlmJaxError, NonFiniteError  # noqa: F401  (re-exported)

class ConfigError(GlmJaxError):
    pass


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int          # dense MLP width
    moe_intermediate_size: int      # routed / shared expert width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    rope_type: str
    max_position_embeddings: int
    attention_bias: bool
    use_qk_norm: bool
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    # "dense" or "sparse" per main layer (glm4_moe: derived from first_k_dense_replace)
    mlp_layer_types: tuple
    eos_token_ids: tuple = ()
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    hidden_act: str = "silu"
    # --- MLA (glm_moe_dsa, glm4_moe_lite; q_lora_rank None: a direct q_proj) and the DSA indexer (glm_moe_dsa);
    # None / () elsewhere ---
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    index_topk: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_n_heads: Optional[int] = None
    indexer_types: tuple = ()       # "full" / "shared" per main layer
    rope_interleave: bool = True    # MLA's RoPE on interleaved lane pairs (glm4_moe_lite may say false: halves)
    rope_parameters: Any = None     # the raw dict, for yarn/mscale
    # --- glm5_next (KDA linear attention + k-pooled DSA MLA without RoPE + hyper-connections); empty elsewhere ---
    layer_types: tuple = ()         # "linear_attention" / "indexed_attention" per main layer
    linear_num_heads: Optional[int] = None
    linear_head_dim: Optional[int] = None
    linear_conv_kernel_dim: Optional[int] = None
    linear_lower_bound: Optional[float] = None   # the forget gate's lower bound (None: the softplus gate)
    hc_mult: int = 0                # residual streams (0: a plain residual)
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 0
    swiglu_limit: Optional[float] = None
    index_kpool: int = 0            # tokens per pooled indexer key (0: per-token DSA)
    index_kpool_always_select_tail: bool = True
    source: str = ""                # path of the config.json, for messages

    # ------------------------------------------------------------------ derived
    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (a latent K/V cache; mla.py), with or without the DSA indexer."""
        return self.kv_lora_rank is not None

    @property
    def rotary_dim(self) -> int:
        if self.is_mla:
            return int(self.qk_rope_head_dim)
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mtp_layer_index(self) -> int:
        return self.num_hidden_layers

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (``i == num_hidden_layers`` is the MTP layer, always MoE)."""
        if i >= self.num_hidden_layers:
            return True
        return self.mlp_layer_types[i] == "sparse"

    @property
    def moe_layers(self) -> tuple:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source", None)
        return d


def _err(src: str, field: str, msg: str) -> ConfigError:
    return ConfigError(f"{src}: field '{field}': {msg}")


MAX_DIM = 1 << 24          # sanity bound of every size field (a corrupt config must not allocate the machine away)
MAX_LAYERS = 1 << 12


def _get(raw: dict, src: str, field: str, default: Any = dataclasses.MISSING, kind=None):
    if field not in raw or raw[field] is None:
        if default is dataclasses.MISSING:
            return _missing(src, field)
        return default
    v = raw[field]
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _err(src, field, f"expected an integer, got {v!r}")
        if not -MAX_DIM <= v <= MAX_DIM:
            raise _err(src, field, f"{v} is out of range (|value| <= {MAX_DIM})")
    elif kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _err(src, field, f"expected a finite number, got {v!r}")
        v = float(v)
    elif kind is bool:
        if not isinstance(v, bool):
            raise _err(src, field, f"expected true/false, got {v!r}")
    return v


def _missing(src, field):
    raise _err(src, field, "missing (required)")


def _as_id_tuple(v, src, field) -> tuple:
    if v is None:
        return ()
    if isinstance(v, bool):
        raise _err(src, field, f"expected a token id or a list of ids, got {v!r}")
    if isinstance(v, int):
        return (v,)
    if isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return tuple(v)
    raise _err(src, field, f"expected a token id or a list of ids, got {v!r}")


def _indexer_types(raw: dict, src: str, n_layers: int) -> tuple:
    """Mirror of transformers' GlmMoeDsaConfig derivation of ``indexer_types``."""
    if raw.get("indexer_types") is not None:
        if not isinstance(raw["indexer_types"], list):
            raise _err(src, "indexer_types", f"expected a list of 'full'/'shared', got {raw['indexer_types']!r}")
        t = tuple(raw["indexer_types"])
        if len(t) != n_layers or any(x not in ("full", "shared") for x in t):
            raise _err(src, "indexer_types", f"expected {n_layers} entries of 'full'/'shared', got {list(t)!r}")
        if t and t[0] != "full":
            raise _err(src, "indexer_types", "layer 0 must be 'full' (a 'shared' layer reuses the previous layer's selection)")
        return t
    pat = raw.get("index_topk_pattern")
    if pat is not None:
        if not isinstance(pat, str) or len(pat) != n_layers or any(c not in "FS" for c in pat):
            raise _err(src, "index_topk_pattern", f"expected a string of {n_layers} 'F'/'S', got {pat!r}")
        if pat[0] != "F":
            raise _err(src, "index_topk_pattern", "layer 0 must be 'F'")
        return tuple("full" if c == "F" else "shared" for c in pat)
    freq = raw.get("index_topk_freq", 1) or 1
    off = raw.get("index_skip_topk_offset", 2)   # transformers' default offset
    off = 2 if off is None else off
    if not isinstance(freq, int) or freq < 1:
        raise _err(src, "index_topk_freq", f"expected an integer >= 1, got {freq!r}")
    return tuple("full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n_layers))


def config_from_dict(raw: dict, source: str = "config.json", generation_config: Optional[dict] = None) -> ModelConfig:
    src = source
    mt = raw.get("model_type")
    if mt == "glm5_next":
        return glm5_next_config(raw, source, generation_config)
    if mt not in _FAMILIES:
        raise _err(src, "model_type", f"unsupported model_type {mt!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    g = lambda f, d=dataclasses.MISSING, k=None: _get(raw, src, f, d, k)  # noqa: E731
    core = _core_fields(raw, g, src)
    rope = _rope_fields(raw, src)
    fam = _FAMILIES[mt](raw, src, g, core, rope)
    return ModelConfig(model_type=mt, **core, **dict(rope, **fam), **_moe_fields(g, src, core["vocab_size"]),
                       **_token_fields(raw, src, generation_config, core["vocab_size"]), source=src)


def _core_fields(raw: dict, g, src: str) -> dict:
    """The sizes every family has: vocabulary, hidden width, layers, heads, norms, context, MTP layers."""
    c = {"vocab_size": g("vocab_size", k=int), "hidden_size": g("hidden_size", k=int),
         "num_hidden_layers": g("num_hidden_layers", k=int), "num_attention_heads": g("num_attention_heads", k=int)}
    c["num_key_value_heads"] = g("num_key_value_heads", c["num_attention_heads"], int)
    for f, v in c.items():
        if v <= 0:
            raise _err(src, f, f"must be positive, got {v}")
    if c["num_hidden_layers"] > MAX_LAYERS:
        raise _err(src, "num_hidden_layers", f"{c['num_hidden_layers']} is out of range (<= {MAX_LAYERS})")
    if c["num_attention_heads"] % c["num_key_value_heads"]:
        raise _err(src, "num_key_value_heads", f"{c['num_key_value_heads']} does not divide "
                                               f"num_attention_heads={c['num_attention_heads']}")
    nextn = g("num_nextn_predict_layers", 0, int)
    if nextn < 0 or nextn > 1:
        raise _err(src, "num_nextn_predict_layers", f"only 0 or 1 MTP layers are supported, got {nextn}")
    sizes = {f: g(f, k=int) for f in ("intermediate_size", "moe_intermediate_size")}
    for f, v in sizes.items():
        if v <= 0:
            raise _err(src, f, f"must be positive, got {v}")
    eps = g("rms_norm_eps", 1e-5, float)
    if not 0 < eps < 1:
        raise _err(src, "rms_norm_eps", f"expected a number in (0, 1), got {eps!r}")
    mpe = g("max_position_embeddings", 131072, int)
    if mpe <= 0:
        raise _err(src, "max_position_embeddings", f"must be positive, got {mpe}")
    act = raw.get("hidden_act", "silu")
    if not isinstance(act, str) or act != "silu":
        raise _err(src, "hidden_act", f"unsupported activation {act!r} (only 'silu')")
    return dict(c, **sizes, num_nextn_predict_layers=nextn, rms_norm_eps=eps, max_position_embeddings=mpe,
                hidden_act=act, attention_bias=g("attention_bias", False, bool),
                tie_word_embeddings=g("tie_word_embeddings", False, bool))


def _rope_fields(raw: dict, src: str) -> dict:
    """RoPE: nested rope_parameters (transformers 5) or legacy top-level fields.  partial_rotary_factor is left
    None where the config does not give it (each family has its own default)."""
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise _err(src, "rope_parameters", f"expected an object, got {rp!r}")
    rope_theta = rp.get("rope_theta", raw.get("rope_theta", 10000.0))
    prf = rp.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not 0 < rope_theta < math.inf:
        raise _err(src, "rope_theta", f"expected a positive number, got {rope_theta!r}")
    if prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or not (0 < prf <= 1)):
        raise _err(src, "partial_rotary_factor", f"expected a number in (0, 1], got {prf!r}")
    if not isinstance(rope_type, str) or rope_type not in ("default", "yarn"):
        raise _err(src, "rope_parameters.rope_type", f"unsupported rope_type {rope_type!r}")
    return {"rope_theta": float(rope_theta), "partial_rotary_factor": prf, "rope_type": rope_type,
            "rope_parameters": dict(rp) if rp else None}


def _moe_fields(g, src: str, vocab: int) -> dict:
    """The routed / shared experts and the router's groups, scaling and normalisation."""
    n_exp = g("n_routed_experts", k=int)
    top_k = g("num_experts_per_tok", k=int)
    if n_exp <= 0:
        raise _err(src, "n_routed_experts", f"must be positive, got {n_exp}")
    if not 0 < top_k <= n_exp:
        raise _err(src, "num_experts_per_tok", f"must be in [1, n_routed_experts={n_exp}], got {top_k}")
    n_group = g("n_group", 1, int)
    topk_group = g("topk_group", 1, int)
    if n_group <= 0 or n_exp % n_group:
        raise _err(src, "n_group", f"{n_group} must divide n_routed_experts={n_exp}")
    if not 0 < topk_group <= n_group:
        raise _err(src, "topk_group", f"must be in [1, n_group={n_group}], got {topk_group}")
    if n_group > 1 and n_exp // n_group < 2:
        raise _err(src, "n_group", f"each group needs >= 2 experts (group score = sum of top-2), got {n_exp // n_group}")
    if top_k > topk_group * (n_exp // n_group):
        raise _err(src, "num_experts_per_tok", f"{top_k} exceeds the experts in topk_group={topk_group} groups")
    shared = g("n_shared_experts", 1, int)
    if shared < 0:
        raise _err(src, "n_shared_experts", f"must be >= 0, got {shared}")
    rsf = g("routed_scaling_factor", 1.0, float)
    if rsf <= 0:
        raise _err(src, "routed_scaling_factor", f"must be positive, got {rsf!r}")
    return {"n_routed_experts": n_exp, "num_experts_per_tok": top_k, "n_shared_experts": shared, "n_group": n_group,
            "topk_group": topk_group, "norm_topk_prob": g("norm_topk_prob", True, bool), "routed_scaling_factor": rsf}


def _token_fields(raw: dict, src: str, generation_config: Optional[dict], vocab: int) -> dict:
    eos = _as_id_tuple(raw.get("eos_token_id"), src, "eos_token_id")
    if generation_config:
        eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation_config.get("eos_token_id"),
                                                     src + " (generation_config.json)", "eos_token_id")))
    for e in eos:
        if not 0 <= e < vocab:
            raise _err(src, "eos_token_id", f"id {e} outside the vocabulary [0, {vocab})")
    ids = {"eos_token_ids": eos}
    for f in ("bos_token_id", "pad_token_id"):
        v = raw.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab):
            v = None            # informational only (never used by the engine); an unusable value is ignored
        ids[f] = v
    return ids


# ----------------------------------------------------------------------------- each family's own fields
def _mlp_layer_types(raw: dict, src: str, g, n_layers: int, first_k_default: int) -> tuple:
    """``mlp_layer_types`` as given, else ``first_k_dense_replace`` dense layers then sparse ones."""
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        fk = g("first_k_dense_replace", first_k_default, int)
        mlp_types = ["dense"] * min(max(fk, 0), n_layers) + ["sparse"] * max(n_layers - fk, 0)
    if not isinstance(mlp_types, list):
        raise _err(src, "mlp_layer_types", f"expected a list of 'dense'/'sparse', got {mlp_types!r}")
    mlp_types = tuple(mlp_types)
    if len(mlp_types) != n_layers or any(t not in ("dense", "sparse") for t in mlp_types):
        raise _err(src, "mlp_layer_types", f"expected {n_layers} entries of 'dense'/'sparse', got {list(mlp_types)!r}")
    return mlp_types


def _mla_fields(g, src: str, optional=()) -> dict:
    """MLA's ranks and head widths (every one positive; those in ``optional`` may be absent: None)."""
    kw = {}
    for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        kw[f] = g(f, None, int) if f in optional else g(f, k=int)
        if kw[f] is not None and kw[f] <= 0:
            raise _err(src, f, f"must be positive, got {kw[f]}")
    return kw


def _glm4_moe(raw: dict, src: str, g, core: dict, rope: dict) -> dict:
    """GLM-4.5 / 4.6 / 4.7: GQA (head_dim, partial RoPE, optional q/k norms), first_k_dense_replace dense layers."""
    n_layers, hidden, n_heads = core["num_hidden_layers"], core["hidden_size"], core["num_attention_heads"]
    if rope["rope_type"] != "default":
        raise _err(src, "rope_parameters.rope_type", f"unsupported rope_type {rope['rope_type']!r}")
    prf = 0.5 if rope["partial_rotary_factor"] is None else rope["partial_rotary_factor"]
    head_dim = g("head_dim", None, int)
    if head_dim is not None and head_dim <= 0:
        raise _err(src, "head_dim", f"must be positive, got {head_dim}")
    if head_dim is None:
        if hidden % n_heads:
            raise _err(src, "head_dim", f"missing and hidden_size={hidden} is not divisible by num_attention_heads={n_heads}")
        head_dim = hidden // n_heads
    rot = int(head_dim * prf)
    if rot % 2 or rot <= 0:
        raise _err(src, "partial_rotary_factor", f"head_dim*partial_rotary_factor={head_dim * prf} must be a positive even integer")
    fk = g("first_k_dense_replace", 1, int)
    if not 0 <= fk <= n_layers:
        raise _err(src, "first_k_dense_replace", f"must be in [0, {n_layers}], got {fk}")
    return {"head_dim": int(head_dim), "partial_rotary_factor": float(prf),
            "mlp_layer_types": tuple(["dense"] * fk + ["sparse"] * (n_layers - fk)),
            "use_qk_norm": g("use_qk_norm", False, bool)}


def _glm_moe_dsa(raw: dict, src: str, g, core: dict, rope: dict) -> dict:
    """GLM-5 / 5.1 / 5.2: MLA (interleaved RoPE) + the DSA indexer on "full" layers."""
    n_layers = core["num_hidden_layers"]
    kw = _mla_fields(g, src)
    for f in ("index_topk", "index_head_dim", "index_n_heads"):
        kw[f] = g(f, k=int)
        if kw[f] <= 0:
            raise _err(src, f, f"must be positive, got {kw[f]}")
    prf = 1.0 if rope["partial_rotary_factor"] is None else rope["partial_rotary_factor"]
    return dict(kw, head_dim=kw["qk_rope_head_dim"], partial_rotary_factor=float(prf),
                mlp_layer_types=_mlp_layer_types(raw, src, g, n_layers, 3),
                indexer_types=_indexer_types(raw, src, n_layers), use_qk_norm=False)


def _glm4_moe_lite(raw: dict, src: str, g, core: dict, rope: dict) -> dict:
    """GLM-4.7-Flash: MLA without the DSA indexer; q_lora_rank may be None (a direct q_proj); RoPE interleaved
    unless rope_interleave is false; one dense layer first unless mlp_layer_types / first_k_dense_replace say
    otherwise.  transformers rotates head_dim * partial_rotary_factor lanes of a qk_rope_head_dim-wide key (its
    head_dim is qk_rope_head_dim), so any factor but 1 fails there: refused here."""
    kw = _mla_fields(g, src, optional=("q_lora_rank",))
    prf = 1.0 if rope["partial_rotary_factor"] is None else rope["partial_rotary_factor"]
    if prf != 1:
        raise _err(src, "partial_rotary_factor",
                   f"glm4_moe_lite rotates the whole qk_rope_head_dim: expected 1, got {prf!r}")
    return dict(kw, head_dim=kw["qk_rope_head_dim"], partial_rotary_factor=1.0,
                mlp_layer_types=_mlp_layer_types(raw, src, g, core["num_hidden_layers"], 1),
                rope_interleave=g("rope_interleave", True, bool), use_qk_norm=False)


# model_type -> the parser of that family's own fields (architecture fields beyond the shared ones)
_FAMILIES = {"glm4_moe": _glm4_moe, "glm_moe_dsa": _glm_moe_dsa, "glm4_moe_lite": _glm4_moe_lite}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES) + ("glm5_next",)     # glm5_next: its own parse (glm5_next_config)


def _glm5_next_text(raw: dict, src: str) -> dict:
    """The text fields of a glm5_next config: nested under ``text_config`` (multimodal checkpoints) or at the top
    level (flat text-only ones); the top level's token ids fill what the text config leaves unset."""
    text = raw.get("text_config")
    if text is None:
        return dict(raw)
    if not isinstance(text, dict):
        raise _err(src, "text_config", f"expected an object, got {text!r}")
    out = dict(text)
    for f in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if out.get(f) is None and raw.get(f) is not None:
            out[f] = raw[f]
    return out


def _glm5_next_layer_types(t: dict, src: str, n: int) -> tuple:
    """transformers' Glm5NextTextConfig: KDA on every layer but each 4th, "full_attention" read as indexed."""
    lt = t.get("layer_types")
    if lt is None:
        return tuple("indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n))
    if not isinstance(lt, list):
        raise _err(src, "layer_types", f"expected a list, got {lt!r}")
    lt = tuple("indexed_attention" if x == "full_attention" else x for x in lt)
    if len(lt) != n or any(x not in ("linear_attention", "indexed_attention") for x in lt):
        raise _err(src, "layer_types",
                   f"expected {n} entries of 'linear_attention'/'indexed_attention', got {list(lt)!r}")
    return lt


def _glm5_next_indexer_types(t: dict, src: str, n: int, layer_types: tuple) -> tuple:
    """indexer_types, or index_topk_pattern ("F"/"S"), or the freq/offset schedule; the first indexed layer must
    run its own indexer (a "shared" one reuses the last full indexed layer's selection)."""
    probe = dict(t, indexer_types=t.get("indexer_types"))
    pat = t.get("index_topk_pattern")
    if probe["indexer_types"] is None and isinstance(pat, list):
        probe["indexer_types"] = pat
    it = probe["indexer_types"]
    if it is not None:
        if not isinstance(it, list) or len(it) != n or any(x not in ("full", "shared") for x in it):
            raise _err(src, "indexer_types", f"expected {n} entries of 'full'/'shared', got {it!r}")
        it = tuple(it)
    elif pat is not None:
        if not isinstance(pat, str) or len(pat) != n or any(c not in "FS" for c in pat):
            raise _err(src, "index_topk_pattern", f"expected a string of {n} 'F'/'S', got {pat!r}")
        it = tuple("full" if c == "F" else "shared" for c in pat)
    else:
        it = _indexer_types({k: v for k, v in t.items() if k in ("index_topk_freq", "index_skip_topk_offset")},
                            src, n)
    first = next((i for i, x in enumerate(layer_types) if x == "indexed_attention"), None)
    if first is not None and it[first] != "full":
        raise _err(src, "indexer_types", f"the first indexed layer ({first}) must be 'full'")
    return it


def glm5_next_config(raw: dict, source: str, generation_config: Optional[dict] = None) -> ModelConfig:
    """GLM-5.3 (``glm5_next``) text config: the glm_moe_dsa fields (MLA without RoPE, DSA) parsed by
    config_from_dict, then its own: layer_types, the KDA widths, hyper-connections, the SwiGLU clamp, k-pooling."""
    src = source
    t = _glm5_next_text(raw, src)
    g = lambda f, d=dataclasses.MISSING, k=None: _get(t, src, f, d, k)  # noqa: E731
    n = g("num_hidden_layers", k=int)
    if not 0 < n <= MAX_LAYERS:
        raise _err(src, "num_hidden_layers", f"{n} is out of range [1, {MAX_LAYERS}]")
    if g("qk_rope_head_dim", 0, int) != 0:
        raise _err(src, "qk_rope_head_dim", "glm5_next's MLA has no RoPE (expected 0)")
    if g("num_key_value_heads", g("num_attention_heads", k=int), int) != g("num_attention_heads", k=int):
        raise _err(src, "num_key_value_heads", "must equal num_attention_heads")
    layer_types = _glm5_next_layer_types(t, src, n)
    kw = {"layer_types": layer_types, "indexer_types": _glm5_next_indexer_types(t, src, n, layer_types)}
    lin = t.get("linear_attn_config") if isinstance(t.get("linear_attn_config"), dict) else {}
    for f, alias, d in (("linear_num_heads", "num_heads", 64), ("linear_head_dim", "head_dim", 128),
                        ("linear_conv_kernel_dim", "short_conv_kernel_size", 4)):
        kw[f] = (_get(lin, src, alias, None, int) if lin.get(alias) is not None else None) or g(f, d, int)
        if kw[f] <= 0:
            raise _err(src, f, f"must be positive, got {kw[f]}")
    lb = lin.get("gate_lower_bound", t.get("linear_lower_bound", -5.0))
    if lin and lb is None and lin.get("safe_gate", True):     # transformers: the safe gate's bound by default
        lb = -5.0
    if lb is not None and (isinstance(lb, bool) or not isinstance(lb, (int, float)) or not math.isfinite(lb)):
        raise _err(src, "linear_lower_bound", f"expected a finite number or null, got {lb!r}")
    kw["linear_lower_bound"] = None if lb is None else float(lb)
    kw["hc_mult"] = g("hc_mult", 4, int)
    kw["hc_sinkhorn_iters"] = g("hc_sinkhorn_iters", 20, int)
    kw["index_kpool"] = g("index_kpool", 16, int)
    for f in ("hc_mult", "hc_sinkhorn_iters", "index_kpool"):
        if not 0 < kw[f] <= 4096:
            raise _err(src, f, f"must be in [1, 4096], got {kw[f]}")
    kw["hc_eps"] = g("hc_eps", 1e-6, float)
    kw["swiglu_limit"] = g("swiglu_limit", 10.0, float)
    for f in ("hc_eps", "swiglu_limit"):
        if kw[f] is not None and kw[f] <= 0:
            raise _err(src, f, f"must be positive, got {kw[f]}")
    kw["index_kpool_always_select_tail"] = g("index_kpool_always_select_tail", True, bool)
    if g("index_topk", 2048, int) % kw["index_kpool"]:
        raise _err(src, "index_topk", f"must be a multiple of index_kpool={kw['index_kpool']}")
    # the common and MLA/DSA fields through the glm_moe_dsa parse: its RoPE width is checked positive there, so a
    # placeholder of 1 stands in for the 0 checked above; the indexer schedule is this family's (kw)
    dsa = {k: v for k, v in t.items() if k not in ("indexer_types", "index_topk_pattern", "rope_parameters",
                                                   "rope_scaling")}
    dsa.update(model_type="glm_moe_dsa", qk_rope_head_dim=1, index_topk=g("index_topk", 2048, int),
               index_head_dim=g("index_head_dim", 128, int), index_n_heads=g("index_n_heads", 32, int),
               q_lora_rank=g("q_lora_rank", 1536, int), kv_lora_rank=g("kv_lora_rank", 512, int),
               qk_nope_head_dim=g("qk_nope_head_dim", 256, int), v_head_dim=g("v_head_dim", 256, int))
    base = config_from_dict(dsa, source, generation_config)
    return dataclasses.replace(base, model_type="glm5_next", qk_rope_head_dim=0, head_dim=0, rope_parameters=None,
                               **kw)


def _read_json(path: str, what: str):
    try:
        return fileio.read_json(path)
    except fileio.FileProblem as e:                  # a FIFO, /dev/zero, too large, invalid JSON, a huge integer
        raise ConfigError(f"{path}: {what}: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what} ({e.strerror or e})") from None


def load_config(path: str) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a model directory."""
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    model_dir = os.path.dirname(cfg_path)
    if not os.path.exists(cfg_path):
        raise ConfigError(f"{cfg_path}: not found (expected a Hugging Face config.json)")
    raw = _read_json(cfg_path, "the model config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object")
    gen = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        gen = _read_json(gen_path, "the generation config")
        if not isinstance(gen, dict):
            raise ConfigError(f"{gen_path}: expected a JSON object")
    try:
        return config_from_dict(raw, cfg_path, gen)
    except GlmJaxError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
        # a field of an unexpected shape that no explicit check caught: still one line naming the file
        raise ConfigError(f"{cfg_path}: invalid config ({type(e).__name__}: {e})") from None

"""Model configuration read from a Hugging Face ``config.json``.

One dataclass covers every supported family.  Fields shared by all GLM MoE models
sit at the top; architecture-specific blocks (GQA attention for ``glm4_moe``, MLA +
DSA indexer for ``glm_moe_dsa``) are plain optional fields, so adding a family adds
fields, it does not reshape the class.

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

SUPPORTED_MODEL_TYPES = ("glm4_moe", "glm_moe_dsa")


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
    # --- glm_moe_dsa (MLA + DSA indexer); None / () for glm4_moe ---
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    index_topk: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_n_heads: Optional[int] = None
    indexer_types: tuple = ()       # "full" / "shared" per main layer
    rope_parameters: Any = None     # the raw dict, for yarn/mscale
    source: str = ""                # path of the config.json, for messages

    # ------------------------------------------------------------------ derived
    @property
    def rotary_dim(self) -> int:
        if self.model_type == "glm_moe_dsa":
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
    if mt not in SUPPORTED_MODEL_TYPES:
        raise _err(src, "model_type", f"unsupported model_type {mt!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    g = lambda f, d=dataclasses.MISSING, k=None: _get(raw, src, f, d, k)  # noqa: E731

    vocab = g("vocab_size", k=int)
    hidden = g("hidden_size", k=int)
    n_layers = g("num_hidden_layers", k=int)
    n_heads = g("num_attention_heads", k=int)
    n_kv = g("num_key_value_heads", n_heads, int)
    for f, v in (("vocab_size", vocab), ("hidden_size", hidden), ("num_hidden_layers", n_layers),
                 ("num_attention_heads", n_heads), ("num_key_value_heads", n_kv)):
        if v <= 0:
            raise _err(src, f, f"must be positive, got {v}")
    if n_layers > MAX_LAYERS:
        raise _err(src, "num_hidden_layers", f"{n_layers} is out of range (<= {MAX_LAYERS})")
    if n_heads % n_kv:
        raise _err(src, "num_key_value_heads", f"{n_kv} does not divide num_attention_heads={n_heads}")

    # rope: nested rope_parameters (transformers 5) or legacy top-level fields
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise _err(src, "rope_parameters", f"expected an object, got {rp!r}")
    rope_theta = rp.get("rope_theta", raw.get("rope_theta", 10000.0))
    prf = rp.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5 if mt == "glm4_moe" else 1.0))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not 0 < rope_theta < math.inf:
        raise _err(src, "rope_theta", f"expected a positive number, got {rope_theta!r}")
    if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not (0 < prf <= 1):
        raise _err(src, "partial_rotary_factor", f"expected a number in (0, 1], got {prf!r}")
    if not isinstance(rope_type, str) or rope_type not in ("default", "yarn") or (rope_type == "yarn"
                                                                                   and mt == "glm4_moe"):
        raise _err(src, "rope_parameters.rope_type", f"unsupported rope_type {rope_type!r}")

    if mt == "glm4_moe":
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
        mlp_types = tuple(["dense"] * fk + ["sparse"] * (n_layers - fk))
    else:
        head_dim = g("qk_rope_head_dim", k=int)
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            fk = g("first_k_dense_replace", 3, int)
            mlp_types = ["dense"] * min(fk, n_layers) + ["sparse"] * max(n_layers - fk, 0)
        if not isinstance(mlp_types, list):
            raise _err(src, "mlp_layer_types", f"expected a list of 'dense'/'sparse', got {mlp_types!r}")
        mlp_types = tuple(mlp_types)
        if len(mlp_types) != n_layers or any(t not in ("dense", "sparse") for t in mlp_types):
            raise _err(src, "mlp_layer_types", f"expected {n_layers} entries of 'dense'/'sparse', got {list(mlp_types)!r}")

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

    eos = _as_id_tuple(raw.get("eos_token_id"), src, "eos_token_id")
    if generation_config:
        eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation_config.get("eos_token_id"), src + " (generation_config.json)", "eos_token_id")))
    for e in eos:
        if not 0 <= e < vocab:
            raise _err(src, "eos_token_id", f"id {e} outside the vocabulary [0, {vocab})")
    act = raw.get("hidden_act", "silu")
    if not isinstance(act, str) or act != "silu":
        raise _err(src, "hidden_act", f"unsupported activation {act!r} (only 'silu')")

    kw = {}
    if mt == "glm_moe_dsa":
        for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "index_topk", "index_head_dim", "index_n_heads"):
            kw[f] = g(f, k=int)
        kw["indexer_types"] = _indexer_types(raw, src, n_layers)

    nextn = g("num_nextn_predict_layers", 0, int)
    if nextn < 0 or nextn > 1:
        raise _err(src, "num_nextn_predict_layers", f"only 0 or 1 MTP layers are supported, got {nextn}")
    sizes = {f: g(f, k=int) for f in ("intermediate_size", "moe_intermediate_size")}
    sizes["n_shared_experts"] = g("n_shared_experts", 1, int)
    for f, v in sizes.items():
        if v <= 0 if f != "n_shared_experts" else v < 0:
            raise _err(src, f, f"must be {'positive' if f != 'n_shared_experts' else '>= 0'}, got {v}")
    for f in kw:
        if f != "indexer_types" and kw[f] <= 0:
            raise _err(src, f, f"must be positive, got {kw[f]}")
    eps = g("rms_norm_eps", 1e-5, float)
    if not 0 < eps < 1:
        raise _err(src, "rms_norm_eps", f"expected a number in (0, 1), got {eps!r}")
    rsf = g("routed_scaling_factor", 1.0, float)
    if rsf <= 0:
        raise _err(src, "routed_scaling_factor", f"must be positive, got {rsf!r}")
    mpe = g("max_position_embeddings", 131072, int)
    if mpe <= 0:
        raise _err(src, "max_position_embeddings", f"must be positive, got {mpe}")
    ids = {}
    for f in ("bos_token_id", "pad_token_id"):
        v = raw.get(f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab):
            v = None            # informational only (never used by the engine); an unusable value is ignored
        ids[f] = v

    return ModelConfig(
        model_type=mt, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=sizes["intermediate_size"],
        moe_intermediate_size=sizes["moe_intermediate_size"],
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=int(head_dim), n_routed_experts=n_exp, num_experts_per_tok=top_k,
        n_shared_experts=sizes["n_shared_experts"], n_group=n_group, topk_group=topk_group,
        norm_topk_prob=g("norm_topk_prob", True, bool),
        routed_scaling_factor=rsf,
        rms_norm_eps=eps,
        rope_theta=float(rope_theta), partial_rotary_factor=float(prf), rope_type=rope_type,
        max_position_embeddings=mpe,
        attention_bias=g("attention_bias", False, bool),
        use_qk_norm=g("use_qk_norm", False, bool) if mt == "glm4_moe" else False,
        tie_word_embeddings=g("tie_word_embeddings", False, bool),
        num_nextn_predict_layers=nextn,
        mlp_layer_types=mlp_types, eos_token_ids=eos,
        bos_token_id=ids["bos_token_id"], pad_token_id=ids["pad_token_id"],
        hidden_act=act, rope_parameters=dict(rp) if rp else None, source=src, **kw,
    )


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

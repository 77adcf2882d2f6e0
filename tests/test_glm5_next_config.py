"""glm5_next (GLM-5.3) config parsing: flat and nested text_config, transformers' defaults and schedules."""

import pytest

from glm_jax.model.config import ConfigError, config_from_dict

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=0, v_head_dim=8, qk_nope_head_dim=8, index_topk=8,
            index_head_dim=8, index_n_heads=2, index_kpool=4, linear_head_dim=8, linear_num_heads=2)


def test_flat_equals_nested():
    flat = config_from_dict(dict(TEXT, model_type="glm5_next"))
    nested = config_from_dict({"model_type": "glm5_next", "text_config": dict(TEXT, model_type="glm5_next_text"),
                               "vision_config": {"depth": 1}})
    assert flat == nested and flat.model_type == "glm5_next"


def test_defaults_follow_transformers():
    c = config_from_dict(dict(TEXT, model_type="glm5_next", num_hidden_layers=8))
    # Glm5NextTextConfig: KDA where i % 4 != 3, the first 3 layers dense, freq 1 / offset 2: every layer "full"
    assert c.layer_types == ("linear_attention",) * 3 + ("indexed_attention",) + ("linear_attention",) * 3 + (
        "indexed_attention",)
    assert c.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 5
    assert c.indexer_types == ("full",) * 8
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.swiglu_limit, c.linear_lower_bound) == (4, 20, 10.0, -5.0)
    assert c.qk_rope_head_dim == 0 and c.index_kpool == 4 and c.index_kpool_always_select_tail


def test_schedules_and_aliases():
    c = config_from_dict(dict(TEXT, model_type="glm5_next", index_topk_pattern="SFSS",
                              layer_types=["linear_attention", "full_attention", "indexed_attention", "linear_attention"],
                              linear_attn_config={"num_heads": 3, "head_dim": 4, "gate_lower_bound": None,
                                                  "safe_gate": False}))
    assert c.indexer_types == ("shared", "full", "shared", "shared")
    assert c.layer_types[1] == "indexed_attention"
    assert (c.linear_num_heads, c.linear_head_dim, c.linear_lower_bound) == (3, 4, None)
    safe = config_from_dict(dict(TEXT, model_type="glm5_next", linear_attn_config={"gate_lower_bound": None}))
    assert safe.linear_lower_bound == -5.0


@pytest.mark.parametrize("over, field", [
    ({"qk_rope_head_dim": 8}, "qk_rope_head_dim"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"index_topk": 6}, "index_topk"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"indexer_types": ["full", "shared", "full", "full"],
      "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]},
     "indexer_types"),
    ({"hc_mult": 0}, "hc_mult"),
    ({"text_config": 3}, "text_config"),
])
def test_bad_fields_name_the_field(over, field):
    raw = dict(TEXT, model_type="glm5_next", **over)
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        config_from_dict(raw, "x/config.json")


def test_a_container_records_glm5_next_fields_and_no_other_family_gains_any():
    """A container's manifest records every math field of its config, so a container converted from another GLM-5.3
    variant (another hc_mult, KDA width or swiglu_limit) is refused instead of computed wrong; the fields absent from
    other families keep their manifests (and config hashes) as they were."""
    import dataclasses
    import json
    import os

    from glm_jax.experts.container import CONFIG_FIELDS_DEFAULTED, config_fields
    from glm_jax.model.config import load_config

    golden = os.path.join(os.path.dirname(__file__), "golden")
    nxt = config_fields(load_config(os.path.join(golden, "glm5next")))
    for f in ("layer_types", "hc_mult", "hc_sinkhorn_iters", "linear_num_heads", "linear_head_dim",
              "linear_conv_kernel_dim", "swiglu_limit", "index_kpool"):
        assert f in nxt, f
    other = load_config(os.path.join(golden, "dsa_sparse"))
    rec = config_fields(other)
    assert not set(rec) & (set(CONFIG_FIELDS_DEFAULTED) - {"rope_interleave"}), rec
    changed = dataclasses.replace(load_config(os.path.join(golden, "glm5next")), hc_mult=2)
    assert json.dumps(config_fields(changed), sort_keys=True) != json.dumps(nxt, sort_keys=True)

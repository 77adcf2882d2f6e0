"""Sanity checks of the golden fixtures written by tools/fixtures/make_golden.py (torch-free: numpy + safetensors only).

These check that the files are complete and self-consistent; engine parity against them lives elsewhere.
"""

from __future__ import annotations

import json
import os
import re

import ml_dtypes  # noqa: F401  (registers numpy bfloat16 so safetensors.numpy can read bf16 tensors)
import numpy as np
import pytest
from safetensors.numpy import load_file

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
FIXTURES = ["glm4moe_full", "glm4moe_plain", "glm4moe_fused"]
N_NEW = 32


def _dir(name):
    return os.path.join(GOLDEN, name)


def _config(name):
    with open(os.path.join(_dir(name), "config.json")) as f:
        return json.load(f)


def _expected(name):
    with np.load(os.path.join(_dir(name), "expected.npz")) as z:
        return {k: z[k] for k in z.files}


def _checkpoint(name):
    """All tensors of the fixture's checkpoint, plus {key: file} from where it came."""
    d = _dir(name)
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = ["model.safetensors"]
    tensors, origin = {}, {}
    for fn in files:
        for k, v in load_file(os.path.join(d, fn)).items():
            assert k not in tensors, f"{k} in two shards"
            tensors[k] = v
            origin[k] = fn
    return tensors, origin, weight_map


def _f32(a):
    return np.asarray(a, dtype=np.float32)


@pytest.mark.parametrize("name", FIXTURES)
def test_files_exist(name):
    d = _dir(name)
    for fn in ["config.json", "expected.npz", "expected.json"]:
        assert os.path.isfile(os.path.join(d, fn)), fn
    assert os.path.isfile(os.path.join(d, "model.safetensors")) or os.path.isfile(
        os.path.join(d, "model.safetensors.index.json"))
    with open(os.path.join(d, "expected.json")) as f:
        info = json.load(f)
    assert info["versions"]["transformers"].startswith("5.")
    assert "description" in info and "mtp_method" in info


def test_total_size_small():
    total = 0
    for root, _, files in os.walk(GOLDEN):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    assert total < 8 * 1024 * 1024, total


@pytest.mark.parametrize("name", FIXTURES)
def test_checkpoint_keys_and_shapes(name):
    cfg = _config(name)
    t, origin, weight_map = _checkpoint(name)
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    E, I, hd = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["head_dim"]
    nH, nKV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    fused = name == "glm4moe_fused"
    if weight_map is not None:
        assert weight_map == origin
        assert len(set(origin.values())) == 2
    assert t["model.embed_tokens.weight"].shape == (V, H)
    assert t["lm_head.weight"].shape == (V, H)
    assert t["model.norm.weight"].shape == (H,)
    for i in range(L + 1):  # + the MTP layer at index L (always MoE)
        p = f"model.layers.{i}."
        assert t[p + "self_attn.q_proj.weight"].shape == (nH * hd, H)
        assert t[p + "self_attn.k_proj.weight"].shape == (nKV * hd, H)
        assert t[p + "self_attn.v_proj.weight"].shape == (nKV * hd, H)
        assert t[p + "self_attn.o_proj.weight"].shape == (H, nH * hd)
        assert (p + "self_attn.q_proj.bias" in t) == cfg["attention_bias"]
        assert (p + "self_attn.q_norm.weight" in t) == cfg["use_qk_norm"]
        assert t[p + "input_layernorm.weight"].shape == (H,)
        assert t[p + "post_attention_layernorm.weight"].shape == (H,)
        if i < cfg["first_k_dense_replace"]:
            assert t[p + "mlp.gate_proj.weight"].shape == (cfg["intermediate_size"], H)
            continue
        assert t[p + "mlp.gate.weight"].shape == (E, H)
        bias = t[p + "mlp.gate.e_score_correction_bias"]
        assert bias.shape == (E,) and bias.dtype == np.float32
        assert np.abs(bias).max() > 0.01, "e_score_correction_bias should be non-zero"
        Is = I * cfg["n_shared_experts"]
        assert t[p + "mlp.shared_experts.gate_proj.weight"].shape == (Is, H)
        assert t[p + "mlp.shared_experts.up_proj.weight"].shape == (Is, H)
        assert t[p + "mlp.shared_experts.down_proj.weight"].shape == (H, Is)
        if fused:
            assert t[p + "mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
            assert t[p + "mlp.experts.down_proj"].shape == (E, H, I)
            assert not any(k.startswith(p + "mlp.experts.0.") for k in t)
        else:
            for e in range(E):
                assert t[p + f"mlp.experts.{e}.gate_proj.weight"].shape == (I, H)
                assert t[p + f"mlp.experts.{e}.up_proj.weight"].shape == (I, H)
                assert t[p + f"mlp.experts.{e}.down_proj.weight"].shape == (H, I)
            assert p + "mlp.experts.gate_up_proj" not in t
    assert not any(k.startswith(f"model.layers.{L + 1}.") for k in t)


@pytest.mark.parametrize("name", FIXTURES)
def test_mtp_keys(name):
    cfg = _config(name)
    assert cfg["num_nextn_predict_layers"] == 1
    t, _, _ = _checkpoint(name)
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    p = f"model.layers.{L}."
    assert t[p + "enorm.weight"].shape == (H,)
    assert t[p + "hnorm.weight"].shape == (H,)
    assert t[p + "eh_proj.weight"].shape == (H, 2 * H)
    assert t[p + "shared_head.norm.weight"].shape == (H,)
    if name in ("glm4moe_full", "glm4moe_fused"):  # copies of the main embedding / head, as on the hub
        np.testing.assert_array_equal(t[p + "shared_head.head.weight"], t["lm_head.weight"])
        np.testing.assert_array_equal(t[p + "embed_tokens.weight"], t["model.embed_tokens.weight"])
        assert t[p + "shared_head.head.weight"].shape == (V, H)
    else:
        assert p + "shared_head.head.weight" not in t and p + "embed_tokens.weight" not in t


def test_dtypes():
    for name in ("glm4moe_full", "glm4moe_plain"):
        t, _, _ = _checkpoint(name)
        assert {v.dtype for v in t.values()} == {np.dtype(np.float32)}
    t, _, _ = _checkpoint("glm4moe_fused")
    for k, v in t.items():
        want = np.float32 if k.endswith("e_score_correction_bias") else np.dtype("bfloat16")
        assert v.dtype == want, (k, v.dtype)
    assert _config("glm4moe_fused")["dtype"] == "bfloat16"


def test_fused_is_bf16_rounding_of_full():
    full, _, _ = _checkpoint("glm4moe_full")
    fused, _, _ = _checkpoint("glm4moe_fused")
    E = _config("glm4moe_full")["n_routed_experts"]
    bf16 = np.dtype("bfloat16")
    n_fused = 0
    for k, v in fused.items():
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", k)
        if m:
            pre = m.group(1)
            if m.group(2) == "gate_up_proj":
                ref = np.stack([np.concatenate([full[f"{pre}.{e}.gate_proj.weight"],
                                                full[f"{pre}.{e}.up_proj.weight"]]) for e in range(E)])
            else:
                ref = np.stack([full[f"{pre}.{e}.down_proj.weight"] for e in range(E)])
            n_fused += 1
        else:
            ref = full[k]
        np.testing.assert_array_equal(_f32(v), _f32(ref.astype(v.dtype)), err_msg=k)
    assert n_fused == 2 * 3  # layers 1, 2 and the MTP layer 3
    n_experts_full = sum(1 for k in full if re.search(r"\.mlp\.experts\.\d+\.", k))
    assert len(full) - n_experts_full + n_fused == len(fused)
    assert bf16.itemsize == 2


def test_rope_config_forms():
    full = _config("glm4moe_full")
    assert full["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert "rope_theta" not in full
    plain = _config("glm4moe_plain")  # legacy hub form
    assert "rope_parameters" not in plain
    assert plain["rope_theta"] == 50000.0 and plain["partial_rotary_factor"] == 0.5
    assert full["head_dim"] * full["num_attention_heads"] != full["hidden_size"]


@pytest.mark.parametrize("name", FIXTURES)
def test_expected_shapes(name):
    cfg = _config(name)
    z = _expected(name)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    ids = z["input_ids"]
    assert ids.ndim == 2 and ids.shape[0] == 2 and 12 <= ids.shape[1] <= 16
    T = ids.shape[1]
    assert not np.array_equal(ids[0], ids[1])
    assert ids.min() >= 0 and ids.max() < V
    np.testing.assert_array_equal(z["lengths"], [T, T])
    assert z["logits"].shape == (2, T, V) and z["logits"].dtype == np.float32
    assert np.isfinite(z["logits"]).all() and z["logits"].std() > 0.5
    assert z["hidden_last"].shape == (T, H) and z["hidden_last"].dtype == np.float32
    assert z["greedy_prompt"].ndim == 1 and len(z["greedy_prompt"]) >= 4
    g = z["greedy_tokens"]
    assert g.shape == (N_NEW,) and g.min() >= 0 and g.max() < V
    assert len(set(g.tolist())) >= 6
    assert z["mtp_logits"].shape == (T - 1, V) and np.isfinite(z["mtp_logits"]).all()
    assert z["mtp_hidden_out"].shape == (T - 1, H)
    np.testing.assert_array_equal(z["mtp_input_ids"], ids[0, 1:])
    np.testing.assert_array_equal(z["mtp_hidden_in"], z["hidden_last"][:-1])
    np.testing.assert_array_equal(z["mtp_position_ids"], np.arange(1, T))


@pytest.mark.parametrize("name", FIXTURES)
def test_head_reproduces_logits(name):
    """numpy: lm_head(hidden_last) == logits[0]; lm_head(mtp_hidden_out) == mtp_logits."""
    t, _, _ = _checkpoint(name)
    z = _expected(name)
    head = _f32(t["lm_head.weight"])
    np.testing.assert_allclose(z["hidden_last"] @ head.T, z["logits"][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(z["mtp_hidden_out"] @ head.T, z["mtp_logits"], rtol=1e-4, atol=1e-4)


def test_fused_shares_inputs_with_full():
    a, b = _expected("glm4moe_full"), _expected("glm4moe_fused")
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    np.testing.assert_array_equal(a["greedy_prompt"], b["greedy_prompt"])


def test_tokenizer_and_generation_config():
    from tokenizers import Tokenizer

    d = _dir("glm4moe_full")
    cfg = _config("glm4moe_full")
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    ids = {s: tok.token_to_id(s) for s in
           ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"]}
    assert all(i is not None for i in ids.values()), ids
    enc = tok.encode("[gMASK]<sop><|user|>Hello, world!<|assistant|>")
    assert enc.ids[:3] == [ids["[gMASK]"], ids["<sop>"], ids["<|user|>"]]
    assert enc.ids[-1] == ids["<|assistant|>"]
    assert tok.decode(tok.encode("The quick brown fox.").ids) == "The quick brown fox."
    with open(os.path.join(d, "generation_config.json")) as f:
        gen = json.load(f)
    eos = gen["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    assert ids["<|endoftext|>"] in eos
    # the golden greedy continuation never hits a special token, so eos-stopping engines emit all 32
    z = _expected("glm4moe_full")
    assert not set(z["greedy_tokens"].tolist()) & set(ids.values())

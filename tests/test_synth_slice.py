"""The real-scale slice generator (tools/fixtures/synth_slice.py): real widths in the config, shapes of what it writes
(checked on a scaled-down call), the Zipf router skew, and that glm-jax-convert accepts the result."""

import json
import os
import struct

import numpy as np
import pytest

from glm_jax.experts.convert import convert
from glm_jax.model.config import config_from_dict as load_config_dict
from glm_jax.model.config import load_config
from tools.fixtures import synth_slice

SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8)
SMALL_ARCH = {
    "glm45air": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "glm52": dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, qk_head_dim=24, head_dim=8, index_head_dim=16, index_n_heads=4,
                  index_topk=4),
    "glm47flash": dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}


def _headers(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                h = json.loads(fh.read(n))
            h.pop("__metadata__", None)
            for k, v in h.items():
                out[k] = (tuple(v["shape"]), v["dtype"], f)
    return out


def _read(d, key):
    from safetensors.numpy import load_file
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            t = load_file(os.path.join(d, f))
            if key in t:
                return t[key]
    raise KeyError(key)


def test_real_widths():
    a = synth_slice.slice_config("glm45air", 3)
    assert (a["hidden_size"], a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"]) == (4096, 96, 8, 128)
    assert (a["n_routed_experts"], a["moe_intermediate_size"], a["num_experts_per_tok"], a["n_shared_experts"],
            a["first_k_dense_replace"], a["intermediate_size"]) == (128, 1408, 8, 1, 1, 10944)
    ps = synth_slice.param_split(a)
    assert ps["expert"] == 3 * 4096 * 1408 and ps["routed"] == 2 * 128 * ps["expert"]
    g = synth_slice.slice_config("glm52", 2)
    assert (g["hidden_size"], g["num_attention_heads"], g["q_lora_rank"], g["kv_lora_rank"], g["qk_nope_head_dim"],
            g["qk_rope_head_dim"], g["v_head_dim"]) == (6144, 64, 2048, 512, 192, 64, 256)
    assert (g["n_routed_experts"], g["moe_intermediate_size"], g["num_experts_per_tok"], g["index_topk"],
            g["index_n_heads"], g["index_head_dim"]) == (256, 2048, 8, 2048, 32, 128)
    assert g["mlp_layer_types"] == ["dense", "sparse"] and g["indexer_types"] == ["full", "full"]
    f = synth_slice.slice_config("glm47flash", 2)                 # Glm4MoeLiteConfig's defaults
    assert (f["hidden_size"], f["num_attention_heads"], f["q_lora_rank"], f["kv_lora_rank"], f["qk_nope_head_dim"],
            f["qk_rope_head_dim"], f["v_head_dim"], f["intermediate_size"]) == (2048, 20, 768, 512, 192, 64, 256, 10240)
    assert (f["n_routed_experts"], f["moe_intermediate_size"], f["num_experts_per_tok"], f["routed_scaling_factor"],
            f["mlp_layer_types"]) == (64, 1536, 4, 1.8, ["dense", "sparse"]) and "indexer_types" not in f
    assert load_config_dict(f).model_type == "glm4_moe_lite"
    assert synth_slice.moe_layers(synth_slice.full_config("glm47flash")) == 46
    assert synth_slice.counts_config("glm47flash")["mlp_layer_types"].count("sparse") == 46
    # an int4 expert of GLM-5 is ~18.9 MB before scales (limits-and-peers.md §1)
    assert synth_slice.param_split(g)["expert"] / 2 == pytest.approx(18.9e6, rel=0.01)
    # the full models the projections use: 45 / 75 MoE layers, the real vocabularies
    assert synth_slice.moe_layers(synth_slice.full_config("glm45air")) == 45
    assert synth_slice.moe_layers(synth_slice.full_config("glm52")) == 75
    assert synth_slice.full_config("glm52")["vocab_size"] == 154880


def test_bad_arguments():
    with pytest.raises(ValueError, match="--arch=glm9"):
        synth_slice.slice_config("glm9", 3)
    with pytest.raises(ValueError, match="--layers=1"):
        synth_slice.slice_config("glm45air", 1)


@pytest.mark.parametrize("arch", ["glm45air", "glm52", "glm47flash"])
def test_slice_shapes_scaled_down(tmp_path, arch):
    d = str(tmp_path / arch)
    over = dict(SMALL, **SMALL_ARCH[arch])
    synth_slice.write_slice(d, arch, 3, vocab=256, log=lambda *a: None, **over)
    c = synth_slice.slice_config(arch, 3, vocab=256, **over)
    h = _headers(d)
    H, E, I = 64, 8, 32
    assert h["model.embed_tokens.weight"][0] == (256, H) and h["lm_head.weight"][0] == (256, H)
    assert h["model.layers.0.mlp.gate_proj.weight"][0] == (96, H)              # the first layer is dense
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in h)
    for L in (1, 2):                                                          # MoE layers: hub per-expert keys
        for e in range(E):
            assert h[f"model.layers.{L}.mlp.experts.{e}.gate_proj.weight"][:2] == ((I, H), "BF16")
            assert h[f"model.layers.{L}.mlp.experts.{e}.down_proj.weight"][:2] == ((H, I), "BF16")
        assert h[f"model.layers.{L}.mlp.gate.weight"][:2] == ((E, H), "F32")
        assert h[f"model.layers.{L}.mlp.shared_experts.up_proj.weight"][0] == (I, H)
    if arch == "glm45air":
        assert h["model.layers.1.self_attn.q_proj.weight"][0] == (4 * 16, H)
        assert h["model.layers.1.self_attn.k_proj.bias"][0] == (2 * 16,)
    else:
        assert h["model.layers.1.self_attn.q_b_proj.weight"][0] == (4 * (16 + 8), 32)
        assert h["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"][0] == (16 + 8, H)
        assert h["model.layers.1.self_attn.kv_b_proj.weight"][0] == (4 * (16 + 16), 16)
        assert h["model.layers.1.self_attn.o_proj.weight"][0] == (H, 4 * 16)
        if arch == "glm52":
            assert h["model.layers.2.self_attn.indexer.wq_b.weight"][0] == (4 * 16, 32)
            assert h["model.layers.2.self_attn.indexer.weights_proj.weight"][:2] == ((4, H), "F32")
        else:                                                                 # GLM-4.7-Flash: MLA without DSA
            assert not any(".indexer." in k for k in h)
    n = sum(int(np.prod(s)) for s, _, _ in h.values())
    assert n == synth_slice.param_split(c)["total"]
    # Zipf-skewed popularity: the router bias is -0.3 * zipf * log(rank) over a permutation of the experts
    b = np.sort(_read(d, "model.layers.1.mlp.gate.e_score_correction_bias"))[::-1]
    np.testing.assert_allclose(b, -0.3 * 1.1 * np.log(np.arange(1, E + 1)), rtol=1e-5, atol=1e-6)
    cfg = load_config(d)
    assert cfg.n_routed_experts == E and cfg.hidden_size == H
    man = convert(d, str(tmp_path / (arch + "_c")), progress=False)
    assert len(man["experts"]) == 2 * E


def test_slice_bench_box_limits_and_projection():
    from tools.bench import slice as bs
    # 24 GB box, 1500 MB OS, 1000 MB runtime, 14 GB dense in the full model, 45 MoE layers -> 166.7 MB per layer;
    # the slice (1 GB dense, 2 MoE layers) gets runtime + its dense + 2 layers of that
    lim, per = bs.box_limit_mb(24, 1000, 14000, 2, 45, 1500, 1000)
    assert per == pytest.approx(7500 / 45) and lim == pytest.approx(1000 + 1000 + 2 * 7500 / 45)
    assert bs.box_limit_mb(16, 1000, 14000, 2, 45, 1500, 1000) == (None, pytest.approx(-500 / 45))
    # compute scales with the bytes touched, the time beyond it with the MoE layers
    assert bs.project(0.5, 0.1, 20.0, 45.0) == pytest.approx(0.1 * 20 + 0.4 * 45)
    assert bs.project(0.08, 0.1, 20.0, 45.0) == pytest.approx(2.0)        # faster than t_c: no negative wait
    # disk bound: the slower of compute and the misses' bytes at the disk's rate
    assert bs.disk_bound_tok_s(0.01, 4, 10e6, 2.0) == pytest.approx(1 / 0.02)
    assert bs.disk_bound_tok_s(0.05, 4, 10e6, 2.0) == pytest.approx(1 / 0.05)


def test_full_counts_at_tiny_widths():
    c = synth_slice.counts_config("glm52")
    assert c["model_type"] == "glm_moe_dsa" and c["num_hidden_layers"] == 78
    assert c["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 75 and len(c["indexer_types"]) == 78
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["hidden_size"],
            c["moe_intermediate_size"]) == (256, 8, 64, 64)
    assert synth_slice.moe_layers(c) * c["n_routed_experts"] == 19200
    # the whole model stays small: ~236 M routed parameters (~0.5 GB of bf16)
    assert synth_slice.param_split(c)["total"] < 300e6
    a = synth_slice.counts_config("glm45air")
    assert synth_slice.moe_layers(a) * a["n_routed_experts"] == 45 * 128


def test_slice_bench_widens_the_gguf_only_where_the_converter_cannot_hold_a_layer():
    """llama.cpp's converter stacks a layer's experts in f32 (GLM-5.2: 256 x 6144 x 2048 x 4 B = 12.9 GB a
    projection, OOM-killed at 24 GB): the slice bench writes that GGUF from a twin with fewer experts instead
    (tools/bench/gguf_widen.py), and only there; and the FP8 source's blocks are the ones the quantizer wrote."""
    from tools.bench import slice as bs
    from tools.fixtures.synth_model import _fp8_quant
    gb = 1 << 30
    assert bs.widen_gguf(synth_slice.slice_config("glm52", 2), ram_bytes=24 * gb)
    assert not bs.widen_gguf(synth_slice.slice_config("glm52", 2), ram_bytes=64 * gb)
    assert not bs.widen_gguf(synth_slice.slice_config("glm52", 2, n_routed_experts=64), ram_bytes=24 * gb)
    assert not bs.widen_gguf(synth_slice.slice_config("glm45air", 3), ram_bytes=24 * gb)
    assert not bs.widen_gguf(synth_slice.slice_config("glm52", 2, n_routed_experts=bs.TWIN_EXPERTS), ram_bytes=gb)
    w = np.random.default_rng(0).standard_normal((200, 300)).astype(np.float32) * 3
    q, s, ref = _fp8_quant(w)
    assert q.shape == w.shape and s.shape == (2, 3)
    blocks = np.zeros((256, 384), np.float32)
    blocks[:200, :300] = np.abs(w)
    np.testing.assert_allclose(s, blocks.reshape(2, 128, 3, 128).max(axis=(1, 3)) / 448.0, rtol=1e-6)
    np.testing.assert_allclose(ref, w, rtol=0.07, atol=1e-6)     # e4m3: 3 mantissa bits
    assert _fp8_quant(w, want_ref=False)[2] is None


def test_slice_bench_rounds_are_medians_with_failures_named():
    from tools.bench import slice as bs

    def ok(dec, peak=100, pre=50.0):
        return ("ok", {"decode_tok_s": dec, "prefill_tok_s": pre}, {"peak": peak, "read_bytes": 1})

    a = bs.aggregate_runs([ok(30.0, pre=1.0), ok(20.0, peak=300, pre=2.0), ok(40.0, pre=3.0)])
    # the median round, with its own prefill (not a median of another round's numbers), the peak over all rounds
    assert (a["decode"], a["prefill"], a["peak"], a["runs"]) == (30.0, 1.0, 300, "30/20/40")
    assert a["result"] == "3 of 3 ok"
    assert bs.aggregate_runs([ok(30.0), ok(20.0)])["decode"] == 20.0          # even count: the lower middle
    failed = ("OOM-killed (while loading)", None, {"peak": 900, "read_bytes": 5})
    a = bs.aggregate_runs([ok(10.0), failed, ok(12.0)])
    assert a["decode"] == 10.0 and a["runs"] == "10/-/12" and a["peak"] == 900
    assert a["result"] == "2 of 3 ok; OOM-killed (while loading) x1"
    a = bs.aggregate_runs([failed])
    assert a["decode"] is None and a["result"] == "OOM-killed (while loading)"
    # round-by-round ratios: only rounds where both ran
    assert bs.pair_ratios([ok(30.0), ok(20.0), failed], [ok(20.0), ok(25.0), ok(10.0)]) == "0.80-1.50"
    assert bs.pair_ratios([failed], [ok(1.0)]) == "-"


def test_reskew_writes_the_same_container_with_another_router_skew(tmp_path):
    """tools/fixtures/reskew.py: the experts hard-linked, only the routers' biases rewritten (to what the generator
    writes at that --zipf), the manifest's dense checksum kept true (the container opens and verifies); at the
    generator's own skew it writes the dense file byte for byte; an existing destination is refused."""
    import filecmp

    from glm_jax.experts import container as C
    from tools.fixtures import reskew as R
    d = str(tmp_path / "hf")
    over = dict(SMALL, **SMALL_ARCH["glm45air"])
    synth_slice.write_slice(d, "glm45air", 3, vocab=256, log=lambda *a: None, **over)
    src = str(tmp_path / "c")
    convert(d, src, progress=False)
    same = str(tmp_path / "same")
    R.reskew(src, same, 1.1)
    assert filecmp.cmp(os.path.join(src, C.DENSE_NAME), os.path.join(same, C.DENSE_NAME), shallow=False)
    flat = str(tmp_path / "flat")
    changed = R.reskew(src, flat, 0.3)
    assert sorted(changed) == [1, 2]
    C.verify_dense(flat)
    C.open_container(flat, verify="all").close()
    for L in (1, 2):
        rec = os.path.join(C.EXPERT_DIR, f"layer_{L:03d}.bin")
        assert os.stat(os.path.join(src, rec)).st_ino == os.stat(os.path.join(flat, rec)).st_ino
    from safetensors.numpy import load_file
    a, b = load_file(os.path.join(src, C.DENSE_NAME)), load_file(os.path.join(flat, C.DENSE_NAME))
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    np.testing.assert_allclose(np.sort(b[key])[::-1], -0.3 * 0.3 * np.log(np.arange(1, 9)), rtol=1e-5, atol=1e-6)
    assert np.argmax(a[key]) == np.argmax(b[key])              # the same experts' order, a flatter skew
    assert all(np.array_equal(a[k], b[k]) for k in a if not k.endswith(R.BIAS))
    with pytest.raises(FileExistsError, match="--dst="):
        R.reskew(src, flat, 0.2)

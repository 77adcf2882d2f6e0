"""Synthetic glm4_moe checkpoints: tiny ones for tests, a large-expert one for the streaming benchmark.

    python -m glm_jax_tools.synth_model --out=DIR [--hidden=1024 --moe_inter=2048 --experts=64 --layers=5
                                         --top_k=8 --zipf=1.1] [--convert] [--expert_format=int4_g64]

writes DIR/hf (a Hugging Face glm4_moe checkpoint, bf16, hub per-expert keys, tensor by tensor: memory stays at
one tensor) and, with --convert, DIR/container (glm-jax-convert).  Expert popularity is made non-uniform (Zipf
over a random permutation of the experts of each layer) through the router's ``e_score_correction_bias``
(``bias_e = 0.3 * zipf * -log(rank_e)``) on top of router logits of unit scale, so selection is skewed but
still input dependent.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Optional

import numpy as np

import ml_dtypes


def tiny_config(**over) -> dict:
    c = dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=128, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        rms_norm_eps=1e-5, partial_rotary_factor=0.5, rope_theta=10000.0, max_position_embeddings=256,
        attention_bias=True, use_qk_norm=False, tie_word_embeddings=False, num_nextn_predict_layers=1,
        eos_token_id=1, bos_token_id=0, pad_token_id=0, hidden_act="silu", torch_dtype="float32")
    c.update(over)
    return c


def tensor_specs(c: dict, experts: str = "per_expert") -> list:
    """[(key, shape, role)] of a glm4_moe checkpoint; role in embed|norm|proj|router|bias|expert|fused
    (glm_moe_dsa configs: dsa_tensor_specs)."""
    if c.get("model_type") == "glm_moe_dsa":
        return dsa_tensor_specs(c, experts)
    H, V = c["hidden_size"], c["vocab_size"]
    nH, nKV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    E, I, Iff = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    ns = c.get("n_shared_experts", 1)
    out = [("model.embed_tokens.weight", (V, H), "embed"), ("model.norm.weight", (H,), "norm")]
    if not c.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (V, H), "embed"))
    n_layers = c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0)
    for L in range(n_layers):
        p = f"model.layers.{L}."
        out += [(p + "input_layernorm.weight", (H,), "norm"), (p + "post_attention_layernorm.weight", (H,), "norm")]
        for n, o, i in (("q", nH * hd, H), ("k", nKV * hd, H), ("v", nKV * hd, H), ("o", H, nH * hd)):
            out.append((p + f"self_attn.{n}_proj.weight", (o, i), "proj"))
            if c.get("attention_bias") and n != "o":
                out.append((p + f"self_attn.{n}_proj.bias", (o,), "bias"))
        if c.get("use_qk_norm"):
            out += [(p + "self_attn.q_norm.weight", (hd,), "norm"), (p + "self_attn.k_norm.weight", (hd,), "norm")]
        mtp = L >= c["num_hidden_layers"]
        if not mtp and L < c.get("first_k_dense_replace", 1):
            out += [(p + "mlp.gate_proj.weight", (Iff, H), "proj"), (p + "mlp.up_proj.weight", (Iff, H), "proj"),
                    (p + "mlp.down_proj.weight", (H, Iff), "proj")]
        else:
            out += [(p + "mlp.gate.weight", (E, H), "router"), (p + "mlp.gate.e_score_correction_bias", (E,), "router_bias")]
            if experts == "fused":
                out += [(p + "mlp.experts.gate_up_proj", (E, 2 * I, H), "fused"),
                        (p + "mlp.experts.down_proj", (E, H, I), "fused")]
            else:
                for e in range(E):
                    out += [(p + f"mlp.experts.{e}.gate_proj.weight", (I, H), "expert"),
                            (p + f"mlp.experts.{e}.up_proj.weight", (I, H), "expert"),
                            (p + f"mlp.experts.{e}.down_proj.weight", (H, I), "expert")]
            out += [(p + "mlp.shared_experts.gate_proj.weight", (I * ns, H), "proj"),
                    (p + "mlp.shared_experts.up_proj.weight", (I * ns, H), "proj"),
                    (p + "mlp.shared_experts.down_proj.weight", (H, I * ns), "proj")]
        if mtp:
            out += [(p + "enorm.weight", (H,), "norm"), (p + "hnorm.weight", (H,), "norm"),
                    (p + "eh_proj.weight", (H, 2 * H), "proj"), (p + "shared_head.norm.weight", (H,), "norm"),
                    (p + "shared_head.head.weight", (V, H), "embed"), (p + "embed_tokens.weight", (V, H), "embed")]
    return out


def _moe_specs(p: str, c: dict, experts: str) -> list:
    H, E, I, ns = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"], c.get("n_shared_experts", 1)
    out = [(p + "mlp.gate.weight", (E, H), "router"), (p + "mlp.gate.e_score_correction_bias", (E,), "router_bias")]
    if experts == "fused":
        out += [(p + "mlp.experts.gate_up_proj", (E, 2 * I, H), "fused"),
                (p + "mlp.experts.down_proj", (E, H, I), "fused")]
    else:
        for e in range(E):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (I, H), "expert"),
                    (p + f"mlp.experts.{e}.up_proj.weight", (I, H), "expert"),
                    (p + f"mlp.experts.{e}.down_proj.weight", (H, I), "expert")]
    return out + [(p + "mlp.shared_experts.gate_proj.weight", (I * ns, H), "proj"),
                  (p + "mlp.shared_experts.up_proj.weight", (I * ns, H), "proj"),
                  (p + "mlp.shared_experts.down_proj.weight", (H, I * ns), "proj")]


def dsa_tensor_specs(c: dict, experts: str = "per_expert") -> list:
    """[(key, shape, role)] of a glm_moe_dsa (GLM-5) checkpoint with hub key names: MLA attention
    (q_a/q_b/kv_a_proj_with_mqa/kv_b/o and their norms), the DSA indexer on layers whose indexer_types entry is
    "full", dense or MoE MLP from mlp_layer_types, and the MTP layers (num_nextn_predict_layers) after the last."""
    H, V = c["hidden_size"], c["vocab_size"]
    nH, qr, kr = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    nI, dI, Iff = c["index_n_heads"], c["index_head_dim"], c["intermediate_size"]
    n_main = c["num_hidden_layers"]
    kinds = c.get("mlp_layer_types") or (["dense"] * c.get("first_k_dense_replace", 1)
                                         + ["sparse"] * (n_main - c.get("first_k_dense_replace", 1)))
    idx_types = c.get("indexer_types") or ["full"] * n_main
    out = [("model.embed_tokens.weight", (V, H), "embed"), ("model.norm.weight", (H,), "norm")]
    if not c.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (V, H), "embed"))
    for L in range(n_main + c.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{L}."
        mtp = L >= n_main
        out += [(p + "input_layernorm.weight", (H,), "norm"), (p + "post_attention_layernorm.weight", (H,), "norm"),
                (p + "self_attn.q_a_proj.weight", (qr, H), "proj"),
                (p + "self_attn.q_a_layernorm.weight", (qr,), "norm"),
                (p + "self_attn.q_b_proj.weight", (nH * (dn + dr), qr), "proj"),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (kr + dr, H), "proj"),
                (p + "self_attn.kv_a_layernorm.weight", (kr,), "norm"),
                (p + "self_attn.kv_b_proj.weight", (nH * (dn + dv), kr), "proj"),
                (p + "self_attn.o_proj.weight", (H, nH * dv), "proj")]
        if mtp or idx_types[L] == "full":
            out += [(p + "self_attn.indexer.wq_b.weight", (nI * dI, qr), "proj"),
                    (p + "self_attn.indexer.wk.weight", (dI, H), "proj"),
                    (p + "self_attn.indexer.weights_proj.weight", (nI, H), "router"),
                    (p + "self_attn.indexer.k_norm.weight", (dI,), "norm"),
                    (p + "self_attn.indexer.k_norm.bias", (dI,), "bias")]
        if not mtp and kinds[L] == "dense":
            out += [(p + "mlp.gate_proj.weight", (Iff, H), "proj"), (p + "mlp.up_proj.weight", (Iff, H), "proj"),
                    (p + "mlp.down_proj.weight", (H, Iff), "proj")]
        else:
            out += _moe_specs(p, c, experts)
        if mtp:
            out += [(p + "enorm.weight", (H,), "norm"), (p + "hnorm.weight", (H,), "norm"),
                    (p + "eh_proj.weight", (H, 2 * H), "proj"), (p + "shared_head.norm.weight", (H,), "norm"),
                    (p + "shared_head.head.weight", (V, H), "embed"), (p + "embed_tokens.weight", (V, H), "embed")]
    return out


def _zipf_bias(E: int, L: int, seed: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + L)
    perm = rng.permutation(E)
    rank = np.empty(E)
    rank[perm] = np.arange(1, E + 1)
    return (-scale * np.log(rank)).astype(np.float32)


def make_tensor(key: str, shape: tuple, role: str, seed: int, zipf: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    if role == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if role == "router_bias":
        L = int(key.split(".")[2])
        return 0.3 * _zipf_bias(shape[0], L, seed, zipf) if zipf else (0.01 * rng.standard_normal(shape)).astype(np.float32)
    if role == "router":
        return ((1.0 if zipf else 0.5) * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    if role == "bias":
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1]
    std = 1.0 if role == "embed" else 1.0 / np.sqrt(fan_in)
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= std
    return w


def _fp8_quant(w: np.ndarray, block: int = 128):
    out, n_in = w.shape
    bo, bi = -(-out // block), -(-n_in // block)
    pad = np.zeros((bo * block, bi * block), np.float32)
    pad[:out, :n_in] = w
    blocks = pad.reshape(bo, block, bi, block)
    amax = np.abs(blocks).max(axis=(1, 3))
    s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = (pad / np.repeat(np.repeat(s, block, 0), block, 1))[:out, :n_in].astype(ml_dtypes.float8_e4m3fn)
    ref = q.astype(np.float32) * np.repeat(np.repeat(s, block, 0), block, 1)[:out, :n_in]
    return q, s, ref


def write_hf_checkpoint(out: str, config: dict, seed: int = 0, dtype: str = "float32", experts: str = "per_expert",
                        shards: int = 1, zipf: float = 0.0, keep_reference: bool = True) -> Optional[dict]:
    """Write a glm4_moe HF checkpoint; returns {key: float32 array as the model sees it} when keep_reference.

    dtype: float32 | bfloat16 | fp8 (proj/expert matrices as float8_e4m3fn + 128x128 ``weight_scale_inv``).
    experts: per_expert (hub keys) | fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]).
    """
    from glm_jax_tools.convert import write_safetensors_streaming
    os.makedirs(out, exist_ok=True)
    specs = tensor_specs(config, experts)
    ref = {} if keep_reference else None
    plan = []
    for key, shape, role in specs:
        def produce(key=key, shape=shape, role=role):
            if role == "fused":
                E = shape[0]
                base = key.rsplit(".", 1)[0]
                if key.endswith("gate_up_proj"):
                    w = np.stack([np.concatenate([make_tensor(f"{base}.{e}.gate_proj.weight", (shape[1] // 2, shape[2]), "expert", seed),
                                                  make_tensor(f"{base}.{e}.up_proj.weight", (shape[1] // 2, shape[2]), "expert", seed)], 0)
                                  for e in range(E)])
                else:
                    w = np.stack([make_tensor(f"{base}.{e}.down_proj.weight", shape[1:], "expert", seed) for e in range(E)])
            else:
                w = make_tensor(key, shape, role, seed, zipf)
            return w
        if dtype == "fp8" and role == "fused":     # fused FP8: per-expert 128x128 blocks, scales [E, out/128, in/128]
            cache = {}

            def qf(produce=produce, key=key, shape=shape, cache=cache):
                w = produce()
                parts = [_fp8_quant(w[e]) for e in range(w.shape[0])]
                cache["s"] = np.stack([p[1] for p in parts])
                if ref is not None:
                    base = key.rsplit(".", 1)[0]
                    half = shape[1] // 2
                    for e, (_, _, r) in enumerate(parts):
                        if key.endswith("gate_up_proj"):
                            ref[f"{base}.{e}.gate_proj.weight"], ref[f"{base}.{e}.up_proj.weight"] = r[:half], r[half:]
                        else:
                            ref[f"{base}.{e}.down_proj.weight"] = r
                return np.stack([p[0] for p in parts])

            def scf(cache=cache):
                return cache.pop("s")
            plan.append((key, "F8_E4M3", shape, qf))
            plan.append((key + "_scale_inv", "F32", (shape[0], -(-shape[1] // 128), -(-shape[2] // 128)), scf))
            continue
        if dtype == "fp8" and role in ("proj", "expert"):
            cache = {}

            def q(produce=produce, key=key, cache=cache):
                qq, s, r = _fp8_quant(produce())
                cache["s"] = s
                if ref is not None:
                    ref[key] = r
                return qq

            def sc(cache=cache):
                return cache.pop("s")
            bo, bi = -(-shape[0] // 128), -(-shape[1] // 128)
            plan.append((key, "F8_E4M3", shape, q))
            plan.append((key + "_scale_inv", "F32", (bo, bi), sc))
            continue
        low = dtype in ("bfloat16", "fp8") and role not in ("router", "router_bias", "norm")
        st_dt = "BF16" if low else "F32"

        def p2(produce=produce, key=key, low=low):
            w = produce()
            if low:
                w = w.astype(ml_dtypes.bfloat16)
            if ref is not None:
                ref[key] = w.astype(np.float32)
            return w
        plan.append((key, st_dt, shape, p2))
    # shards: contiguous chunks of the plan
    if shards <= 1:
        write_safetensors_streaming(os.path.join(out, "model.safetensors"), plan, {"format": "pt"})
    else:
        chunks = np.array_split(np.arange(len(plan)), shards)
        wmap = {}
        for i, idx in enumerate(chunks):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            sub = [plan[j] for j in idx]
            write_safetensors_streaming(os.path.join(out, name), sub, {"format": "pt"})
            for k, *_ in sub:
                wmap[k] = name
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wmap}, f, indent=1)
    cfg = dict(config)
    if dtype == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    cfg["torch_dtype"] = "bfloat16" if dtype != "float32" else "float32"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": config.get("eos_token_id", 1), "bos_token_id": config.get("bos_token_id", 0)}, f)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return ref


def bench_config(hidden=1024, moe_inter=2048, experts=64, layers=5, top_k=8, vocab=4096) -> dict:
    return tiny_config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       moe_intermediate_size=moe_inter, num_hidden_layers=layers, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=hidden // 8, n_routed_experts=experts,
                       num_experts_per_tok=top_k, first_k_dense_replace=1, num_nextn_predict_layers=0,
                       max_position_embeddings=4096, attention_bias=False, torch_dtype="bfloat16")


def main(argv):
    from absl import flags
    F = flags.FLAGS
    hf = os.path.join(F.out, "hf")
    cfg = bench_config(F.hidden, F.moe_inter, F.experts, F.layers, F.top_k)
    if not os.path.exists(os.path.join(hf, "config.json")):
        write_hf_checkpoint(hf, cfg, seed=F.seed, dtype="bfloat16", zipf=F.zipf, keep_reference=False,
                            shards=max(1, F.layers // 2))
        print(f"wrote {hf}")
    if F.convert:
        from glm_jax_tools.convert import convert
        man = convert(hf, os.path.join(F.out, "container"), expert_format=F.expert_format, progress=True)
        rl = next(iter(man["layers"].values()))["layout"]["record_len"]
        print(f"converted: {len(man['experts'])} expert records of {rl / 1e6:.2f} MB")


def run():
    from absl import app, flags
    flags.DEFINE_string("out", None, "output directory", required=True)
    flags.DEFINE_integer("hidden", 1024, "hidden size")
    flags.DEFINE_integer("moe_inter", 2048, "expert intermediate size")
    flags.DEFINE_integer("experts", 64, "routed experts per layer")
    flags.DEFINE_integer("layers", 5, "layers (the first is dense)")
    flags.DEFINE_integer("top_k", 8, "experts per token")
    flags.DEFINE_float("zipf", 1.1, "popularity skew (router bias scale)")
    flags.DEFINE_integer("seed", 0, "seed")
    flags.DEFINE_bool("convert", True, "also convert to DIR/container")
    flags.DEFINE_string("expert_format", "int4_g64", "container expert format")
    app.run(main)


if __name__ == "__main__":
    run()

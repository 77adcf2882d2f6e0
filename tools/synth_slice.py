"""Slices of the real GLM models: every width real, only the vocabulary and the layer count small.

    python -m glm_jax_tools.synth_slice --arch=glm45air|glm52 --layers=N --out=DIR [--vocab=2048] [--dtype=bfloat16]
                                        [--zipf=1.1] [--seed=0]

writes DIR (a Hugging Face checkpoint that ``glm-jax-convert`` and llama.cpp's converter through
../shared/tools/hf_to_gguf.py accept: hub per-expert keys, sharded safetensors with an index, the shipped model's
tokenizer), tensor by tensor (tools/convert.write_safetensors_streaming: one tensor in memory at a time, never the
whole model).  Random weights; expert popularity is Zipf-skewed per layer through the router's
``e_score_correction_bias`` (tools/synth_model.py), so an expert cache has something to hit.

* glm45air: Glm4MoeForCausalLM, H 4096, 96 heads / 8 KV heads of head_dim 128 (q/k/v biases, partial RoPE 0.5),
  128 routed experts of moe_intermediate 1408 (9.7 MB each at int4 before scales) top-8, 1 shared expert, the first
  layer dense (intermediate 10944), routed_scaling_factor 1.0 (glm-architecture.md §5).
* glm52: GlmMoeDsaForCausalLM (GLM-5 layout), H 6144, MLA with 64 heads (q_lora 2048, kv_lora 512, nope 192, rope
  64, v 256), DSA indexer (32 heads of 128, index_topk 2048) on every layer, 256 routed experts of moe_intermediate
  2048 (18.9 MB each at int4 before scales) top-8, 1 shared expert, the first layer dense (intermediate 12288),
  routed_scaling_factor 2.5 (glm-architecture.md §3, §5; limits-and-peers.md §1).

``FULL`` holds the full models' layer counts and vocabularies, for projecting a slice's numbers to the full model.
A bf16 slice costs about 4.4 GB per MoE layer (glm45air) or 19.3 GB (glm52; --dtype=fp8 halves it: 128x128 block
scales as in the FP8 releases); the dense first layer plus embeddings add about 0.5 / 1.2 GB.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from glm_jax_tools.synth_model import tensor_specs, tiny_config

ARCHS = ("glm45air", "glm52")

# full-model facts used to project a slice (glm-architecture.md §5): layers, first dense layers, vocabulary
FULL = {
    "glm45air": dict(num_hidden_layers=46, dense_layers=1, vocab_size=151552),
    "glm52": dict(num_hidden_layers=78, dense_layers=3, vocab_size=154880),
}


def slice_config(arch: str, layers: int, vocab: int = 2048, **over) -> dict:
    """The HF config of a slice: real widths, `layers` layers of which the first is dense, `vocab` tokens.
    ``over`` replaces any field (the tests shrink the widths with it)."""
    if arch not in ARCHS:
        raise ValueError(f"--arch={arch}: not one of {', '.join(ARCHS)}")
    if layers < 2:
        raise ValueError(f"--layers={layers}: a slice needs at least 2 layers (the dense first one and one MoE layer)")
    if arch == "glm45air":
        c = tiny_config(
            vocab_size=vocab, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=layers, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
            n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=1.0, partial_rotary_factor=0.5, rope_theta=1000000.0, max_position_embeddings=4096,
            attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0, torch_dtype="bfloat16")
    else:
        c = dict(
            architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=vocab, hidden_size=6144,
            intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=64,
            num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
            v_head_dim=256, qk_head_dim=256, head_dim=64, n_routed_experts=256, num_experts_per_tok=8,
            n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            first_k_dense_replace=1, index_topk=2048, index_head_dim=128, index_n_heads=32,
            rms_norm_eps=1e-5, max_position_embeddings=4096, attention_bias=False, tie_word_embeddings=False,
            num_nextn_predict_layers=0, hidden_act="silu", torch_dtype="bfloat16",
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    c.update(over)
    if c["model_type"] == "glm_moe_dsa":
        L, fd = c["num_hidden_layers"], c["first_k_dense_replace"]
        c.setdefault("mlp_layer_types", ["dense"] * fd + ["sparse"] * (L - fd))
        c.setdefault("indexer_types", ["full"] * L)
    # the shipped tokenizer's special ids (bench_peer._with_shipped_tokens) and the nested RoPE form
    c.update(eos_token_id=0, pad_token_id=0, bos_token_id=None)
    if c["model_type"] == "glm4_moe":
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_theta"],
                                "partial_rotary_factor": c["partial_rotary_factor"]}
    return c


def moe_layers(c: dict) -> int:
    if c.get("mlp_layer_types"):
        return sum(k == "sparse" for k in c["mlp_layer_types"])
    return c["num_hidden_layers"] - c.get("first_k_dense_replace", 1)


def param_split(c: dict) -> dict:
    """Parameters of a config by part: routed experts, everything else (dense), and one expert."""
    per_e = 3 * c["hidden_size"] * c["moe_intermediate_size"]
    routed = moe_layers(c) * c["n_routed_experts"] * per_e
    total = 0
    for _, shape, _ in tensor_specs(c):
        n = 1
        for s in shape:
            n *= s
        total += n
    return dict(total=total, routed=routed, dense=total - routed, expert=per_e)


def full_config(arch: str) -> dict:
    """The full model's config as far as widths, layer count and vocabulary go (for projections only)."""
    f = FULL[arch]
    c = slice_config(arch, f["num_hidden_layers"], vocab=f["vocab_size"], first_k_dense_replace=f["dense_layers"])
    if c["model_type"] == "glm_moe_dsa":
        L, fd = f["num_hidden_layers"], f["dense_layers"]
        c["mlp_layer_types"] = ["dense"] * fd + ["sparse"] * (L - fd)
        c["indexer_types"] = ["full"] * L
    return c


def write_slice(out: str, arch: str, layers: int, vocab: int = 2048, dtype: str = "bfloat16", zipf: float = 1.1,
                seed: int = 0, log=print, **over) -> str:
    """Write the slice's HF dir to `out` (skipped when out/config.json exists; written to out.tmp, then renamed)."""
    from glm_jax_tools.bench_peer import make_model
    c = slice_config(arch, layers, vocab, **over)
    return make_model(out, c, zipf=zipf, seed=seed, log=log, dtype=dtype)


def main(argv):
    from absl import flags
    F = flags.FLAGS
    if len(argv) > 1:
        print(f"synth_slice: error: unexpected arguments: {' '.join(argv[1:])}")
        return 2
    try:
        c = slice_config(F.arch, F.layers, F.vocab)
    except ValueError as e:
        print(f"synth_slice: error: {e}")
        return 2
    ps = param_split(c)
    bpp = 1 if F.dtype == "fp8" else (4 if F.dtype == "float32" else 2)
    need = ps["routed"] * bpp + ps["dense"] * 4
    free = _free_bytes(os.path.dirname(os.path.abspath(F.out)) or ".")
    if free is not None and need > free:
        print(f"synth_slice: error: --out={F.out}: needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
        return 2
    write_slice(F.out, F.arch, F.layers, F.vocab, F.dtype, F.zipf, F.seed)
    print(json.dumps({"out": F.out, "params": ps}))
    return 0


def _free_bytes(d: str) -> Optional[int]:
    try:
        st = os.statvfs(d)
        return st.f_bavail * st.f_frsize
    except OSError:
        return None


def run():
    from absl import app, flags
    flags.DEFINE_enum("arch", "glm45air", list(ARCHS), "which model's widths")
    flags.DEFINE_integer("layers", 3, "layers in the slice (the first dense)", lower_bound=2)
    flags.DEFINE_integer("vocab", 2048, "vocabulary size (the shipped tokenizer's ids are below 2048)")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "fp8", "float32"], "checkpoint dtype")
    flags.DEFINE_float("zipf", 1.1, "expert popularity skew (router bias scale)")
    flags.DEFINE_integer("seed", 0, "seed")
    flags.DEFINE_string("out", None, "output HF directory", required=True)
    app.run(main)


if __name__ == "__main__":
    run()

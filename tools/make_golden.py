"""Write the golden fixtures under ``tests/golden/`` using transformers as the numerical oracle.

Needs the ``oracle`` extra (torch + transformers); the test suite itself never imports torch, it only reads the
files written here.

    python tools/make_golden.py                      # all fixtures into tests/golden/
    python -m glm_jax_tools.make_golden --only=glm4moe_full --out=/tmp/golden

Fixtures (each ``<out>/<name>/``: HF checkpoint layout + ``expected.npz`` + ``expected.json``):

* ``glm4moe_full``  : qk-norm, attention bias, n_group=2/topk_group=1, dense first layer, norm_topk_prob,
                      routed_scaling_factor 2.5, non-zero e_score_correction_bias, explicit head_dim, partial rope,
                      an MTP layer (with its own ``shared_head.head`` / ``embed_tokens`` copies), a byte-level BPE
                      ``tokenizer.json`` with GLM special tokens and a ``generation_config.json``.
* ``glm4moe_plain`` : no qk-norm, no bias, n_group=1, norm_topk_prob=False, rsf 1.0, top-3, legacy top-level rope
                      keys in config.json, MTP layer without ``shared_head.head`` / ``embed_tokens``.
* ``glm4moe_fused`` : the weights of ``glm4moe_full`` rounded to bf16, written with fused expert tensors
                      (``mlp.experts.gate_up_proj`` / ``down_proj``), sharded into two files + index; expected
                      outputs come from transformers loading that bf16 checkpoint into an f32 model.

expected.npz keys: ``input_ids [2,T]``, ``lengths [2]``, ``logits [2,T,V] f32`` (each row run alone),
``hidden_last [T,H]`` (row 0, post final norm), ``greedy_prompt [P]``, ``greedy_tokens [32]``, and the MTP arrays
``mtp_input_ids [T-1]``, ``mtp_hidden_in [T-1,H]``, ``mtp_position_ids [T-1]``, ``mtp_hidden_out [T-1,H]``,
``mtp_logits [T-1,V]`` (row 0: draft logits for x_{t+2} from (h_t, x_{t+1})).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile

from absl import app, flags, logging

import numpy as np

FLAGS = flags.FLAGS


def _default_out() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(repo, "tests")):
        return os.path.join(repo, "tests", "golden")
    return os.path.join("tests", "golden")


flags.DEFINE_string("out", None, "output directory (default: <repo>/tests/golden)")
flags.DEFINE_list("only", [], "comma-separated fixture names to (re)write; default all")
flags.DEFINE_integer("seed", 1234, "base seed")
flags.DEFINE_integer("threads", 1, "torch CPU threads")

N_NEW = 32
MIN_GREEDY_MARGIN = 2e-3
MIN_ROUTER_GAP = 1e-4  # biased-score gap between last selected and best unselected expert
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.
All happy families are alike; each unhappy family is unhappy in its own way.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,
and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part
of the world. In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends
of worms and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on or to eat.
The sun shone, having no alternative, on the nothing new. It is a truth universally acknowledged, that a single
man in possession of a good fortune, must be in want of a wife. Hello, world! How are you today? I am fine,
thank you. What is the capital of France? The capital of France is Paris. Please write a short poem about the
sea. The sea is wide and deep and blue, and the waves come in and go out again, all day and all night.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Questions and answers, the user and the assistant, the system.
"""


# --------------------------------------------------------------------------------------------------- configs
def _base_cfg(**over):
    cfg = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    cfg.update(over)
    return cfg


FULL_CFG = _base_cfg(
    vocab_size=320,  # == trained tokenizer vocab (256 byte alphabet + 6 specials + merges)
    use_qk_norm=True,
    attention_bias=True,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
PLAIN_CFG = _base_cfg(
    vocab_size=256,
    use_qk_norm=False,
    attention_bias=False,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    num_experts_per_tok=3,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5},
)


# --------------------------------------------------------------------------------------------------- helpers
def _torch():
    import torch

    return torch


def _randomise(model, seed: int):
    """Weights with enough spread that logits are not flat (clear argmax margins)."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)

    def rn(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"(norm|layernorm)\.weight$", name):
                p.copy_(rn(p.shape, 0.1, 1.0))
            elif name.endswith(".bias"):
                p.copy_(rn(p.shape, 0.1))
            elif "embed_tokens" in name:
                p.copy_(rn(p.shape, 0.5))
            elif name.startswith("lm_head"):
                p.copy_(rn(p.shape, 0.3))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(rn(p.shape, 0.2))
            else:
                p.copy_(rn(p.shape, 0.12))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(rn(b.shape, 0.1))


def _new_model(cfg_kwargs: dict, seed: int):
    torch = _torch()
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(**cfg_kwargs)
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(cfg).to(torch.float32).eval()
    _randomise(model, seed)
    return model


def _mtp_tensors(cfg_kwargs: dict, seed: int, with_head: bool, main_embed, main_head) -> dict:
    """Hub-named MTP tensors for layer L = num_hidden_layers (per-expert keys, f32 numpy)."""
    from safetensors.numpy import load_file

    L = cfg_kwargs["num_hidden_layers"]
    H = cfg_kwargs["hidden_size"]
    donor_cfg = dict(cfg_kwargs, num_hidden_layers=1, first_k_dense_replace=0)
    donor = _new_model(donor_cfg, seed)
    with tempfile.TemporaryDirectory() as tmp:
        donor.save_pretrained(tmp)
        sd = load_file(os.path.join(tmp, "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if k.startswith("model.layers.0."):
            out[f"model.layers.{L}." + k[len("model.layers.0."):]] = np.ascontiguousarray(v)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in out), sorted(out)
    rng = np.random.default_rng(seed + 17)
    p = f"model.layers.{L}."
    out[p + "enorm.weight"] = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    out[p + "hnorm.weight"] = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    out[p + "eh_proj.weight"] = (0.12 * rng.standard_normal((H, 2 * H))).astype(np.float32)
    out[p + "shared_head.norm.weight"] = (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    if with_head:  # hub checkpoints carry copies of the main embedding / head here
        out[p + "shared_head.head.weight"] = np.array(main_head, np.float32)
        out[p + "embed_tokens.weight"] = np.array(main_embed, np.float32)
    return out


def _fuse_experts(sd: dict, n_experts: int) -> dict:
    """Per-expert hub keys -> transformers' fused [E,2I,H] / [E,H,I] keys."""
    out = {}
    prefixes = set()
    for k, v in sd.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m:
            prefixes.add(m.group(1))
        else:
            out[k] = v
    for pre in sorted(prefixes):
        gate = np.stack([sd[f"{pre}.{e}.gate_proj.weight"] for e in range(n_experts)])
        up = np.stack([sd[f"{pre}.{e}.up_proj.weight"] for e in range(n_experts)])
        down = np.stack([sd[f"{pre}.{e}.down_proj.weight"] for e in range(n_experts)])
        out[f"{pre}.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        out[f"{pre}.down_proj"] = down
    return out


def _save_st(path: str, sd: dict):
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in sorted(sd.items())}, path, metadata={"format": "pt"})


def _train_tokenizer(vocab_size: int, path: str) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, AddedToken

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = TRAIN_TEXT.splitlines()
    tok.train_from_iterator(lines * 4, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()} != {vocab_size}: enlarge TRAIN_TEXT")
    tok.save(path)
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _margin(logits_row) -> float:
    s = np.sort(np.asarray(logits_row, np.float64))
    return float(s[-1] - s[-2])


# ------------------------------------------------------------------------------------------- oracle outputs
class _RouterProbe:
    """Forward hooks on every router: the smallest gap between the last selected and the best unselected biased
    score (and between kept / dropped groups), i.e. how far routing is from a tie."""

    def __init__(self, model):
        self.min_expert_gap = float("inf")
        self.min_group_gap = float("inf")
        self.handles = []
        self.attach(model)

    def attach(self, model):
        for name, mod in model.named_modules():
            if type(mod).__name__.endswith("TopkRouter"):
                self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, mod, inputs, output):
        torch = _torch()
        router_logits = output[0].detach().to(torch.float64)
        sc = torch.sigmoid(router_logits) + mod.e_score_correction_bias.to(torch.float64)
        E, G, K = mod.num_experts, mod.num_group, mod.top_k
        gs = sc.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        if mod.topk_group < G:
            s = gs.sort(dim=-1, descending=True)[0]
            self.min_group_gap = min(self.min_group_gap,
                                     float((s[:, mod.topk_group - 1] - s[:, mod.topk_group]).min()))
            keep = gs.topk(mod.topk_group, dim=-1)[1]
            mask = torch.zeros_like(gs).scatter_(1, keep, 1).bool()
            mask = mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
            sc = sc.masked_fill(~mask, float("-inf"))
        s = sc.sort(dim=-1, descending=True)[0]
        self.min_expert_gap = min(self.min_expert_gap, float((s[:, K - 1] - s[:, K]).min()))

    def close(self):
        for h in self.handles:
            h.remove()


def _oracle(model, input_ids: np.ndarray, greedy_prompts, mtp_model, info: dict, avoid_ids=()) -> dict:
    torch = _torch()
    from transformers import GenerationConfig

    out = {"input_ids": input_ids.astype(np.int32),
           "lengths": np.full((input_ids.shape[0],), input_ids.shape[1], np.int32)}
    probe = _RouterProbe(model)
    logits = []
    with torch.no_grad():
        for row in input_ids:  # each row alone: no padding, no batch effects
            ids = torch.tensor(row[None], dtype=torch.long)
            logits.append(model(input_ids=ids).logits[0].float().numpy())
        out["logits"] = np.stack(logits).astype(np.float32)
        ids0 = torch.tensor(input_ids[:1], dtype=torch.long)
        h = model.model(input_ids=ids0).last_hidden_state  # post final norm
        out["hidden_last"] = h[0].float().numpy()
        # the head applied to hidden_last reproduces logits row 0
        np.testing.assert_allclose(model.lm_head(h)[0].numpy(), out["logits"][0], rtol=1e-5, atol=1e-5)

        # greedy: eos disabled (eos_token_id=None) so it always emits N_NEW tokens. Candidate prompts are tried in
        # order until the continuation has clear argmax margins, is not repetitive and avoids the special tokens
        # (so an engine that stops at eos still produces the same 32 tokens).
        gcfg = GenerationConfig(do_sample=False, max_new_tokens=N_NEW, min_new_tokens=0, eos_token_id=None,
                                pad_token_id=0, bos_token_id=None)
        model.generation_config = copy.deepcopy(gcfg)  # else generate() falls back to the checkpoint's eos ids
        best = None
        for attempt, greedy_prompt in enumerate(greedy_prompts):
            seq = [int(t) for t in greedy_prompt]
            margins = []
            for t in range(N_NEW):  # argmax of a full (uncached) forward at every step
                lg = model(input_ids=torch.tensor([seq], dtype=torch.long)).logits[0, -1].numpy()
                margins.append(_margin(lg))
                seq.append(int(np.argmax(lg)))
            cont = np.array(seq[len(greedy_prompt):])
            ok = (min(margins) >= MIN_GREEDY_MARGIN and len(set(cont.tolist())) >= 8
                  and not np.isin(cont, list(avoid_ids)).any())
            if best is None or min(margins) > best[2]:
                best = (greedy_prompt, cont, min(margins), attempt)
            if ok:
                best = (greedy_prompt, cont, min(margins), attempt)
                break
        else:
            logging.warning("no candidate prompt met the greedy criteria; using the best margin")
        greedy_prompt, uncached, min_margin, attempt = best
        info["greedy_prompt_attempt"] = attempt
        prompt = torch.tensor(greedy_prompt[None], dtype=torch.long)
        gen = model.generate(prompt, generation_config=copy.deepcopy(gcfg), attention_mask=torch.ones_like(prompt))
        greedy = gen[0, len(greedy_prompt):].numpy()
        if len(greedy) != N_NEW:
            raise RuntimeError(f"generate stopped early: {len(greedy)} tokens")
        if not np.array_equal(uncached, greedy):
            raise RuntimeError("cached greedy != uncached argmax loop")
        n_unique = len(set(greedy.tolist()))
        if n_unique < 6:
            raise RuntimeError(f"greedy continuation too repetitive ({n_unique} distinct tokens): {greedy}")
        info["greedy_contains_special_ids"] = bool(np.isin(greedy, list(avoid_ids)).any())
        out["greedy_prompt"] = np.asarray(greedy_prompt).astype(np.int32)
        out["greedy_tokens"] = greedy.astype(np.int32)
        # MTP greedy (assisted decoding) must equal plain greedy
        try:
            gen_mtp = model.generate(prompt, generation_config=copy.deepcopy(gcfg), use_mtp=True,
                                     attention_mask=torch.ones_like(prompt))
            info["generate_use_mtp_equals_greedy"] = bool(
                np.array_equal(gen_mtp[0, len(greedy_prompt):].numpy(), greedy))
        except Exception as e:  # noqa: BLE001  (diagnostic only)
            info["generate_use_mtp_equals_greedy"] = f"not run: {type(e).__name__}: {e}"[:300]
    info["min_router_expert_gap_main"] = probe.min_expert_gap
    info["min_logit_top2_margin_logits"] = float(min(_margin(r) for r in out["logits"].reshape(-1, out["logits"].shape[-1])))
    info["min_logit_top2_margin_greedy"] = float(min_margin)
    info["logits_std"] = float(out["logits"].std())
    info["greedy_distinct_tokens"] = n_unique

    if mtp_model is not None:
        probe.attach(mtp_model)
        out.update(_mtp_oracle(model, mtp_model, input_ids[0], out["hidden_last"], info))
    probe.close()
    info["min_router_expert_gap"] = probe.min_expert_gap  # over every router call above (main + MTP)
    info["min_router_group_gap"] = None if probe.min_group_gap == float("inf") else probe.min_group_gap
    return out


def _mtp_oracle(model, mtp, row: np.ndarray, hidden_last: np.ndarray, info: dict) -> dict:
    """Draft logits for x_{t+2} from (h_t, x_{t+1}), t = 0..T-2, over the whole row at once (causal)."""
    torch = _torch()
    T = len(row)
    ids = torch.tensor(row[None, 1:], dtype=torch.long)          # x_{t+1}
    h_in = torch.tensor(hidden_last[None, :-1])                    # h_t (post final norm)
    pos = torch.arange(1, T, dtype=torch.long)[None]              # HF: positions of x_{t+1}
    with torch.no_grad():
        g = mtp.forward_layer(0, h_in, pos, None, input_ids=ids)   # includes shared_head.norm (post_norm)
        logits = mtp._project_to_logits(g)
        # independent re-composition from the same modules (checks the HF path against the documented formula)
        lay = mtp.layers[0]
        e = model.model.embed_tokens(ids)
        u = lay.eh_proj(torch.cat([lay.enorm(e), lay.hnorm(h_in)], dim=-1))
        pe = model.model.rotary_emb(u, position_ids=pos)
        mask = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
        x = lay.mtp_block(u, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        if isinstance(x, tuple):
            x = x[0]
        logits2 = model.lm_head(lay.post_norm(x))
    np.testing.assert_allclose(logits2.numpy(), logits.numpy(), rtol=1e-4, atol=1e-4)
    info["mtp_method"] = (
        "transformers.modeling_layers.MtpModel.from_pretrained(main_model) (after setting "
        "main_model._keys_to_ignore_on_load_unexpected = [r'model\\.layers\\.{L}\\..*']); "
        "mtp_logits = MtpModel._project_to_logits(MtpModel.forward_layer(0, hidden_last[:-1], positions 1..T-1, "
        "cache=None, input_ids=input_ids[0,1:])), i.e. lm_head(shared_head.norm(Layer_L(eh_proj(concat[enorm("
        "embed(x_{t+1})), hnorm(h_t)])))) with causal attention over the T-1 MTP positions; embed/head are the "
        "main model's. Cross-checked against a manual composition of the same modules.")
    info["mtp_min_logit_top2_margin"] = float(min(_margin(r) for r in logits[0].numpy()))
    return {
        "mtp_input_ids": row[1:].astype(np.int32),
        "mtp_hidden_in": hidden_last[:-1].astype(np.float32),
        "mtp_position_ids": np.arange(1, T, dtype=np.int32),
        "mtp_hidden_out": g[0].float().numpy(),
        "mtp_logits": logits[0].float().numpy(),
    }


def _load(path: str, n_layers: int):
    torch = _torch()
    from transformers import Glm4MoeForCausalLM
    from transformers.modeling_layers import MtpModel

    model = Glm4MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n_layers}\..*"]
    mtp = MtpModel.from_pretrained(model).eval()
    mtp.to(torch.float32)
    return model, mtp


def _check_mtp_loaded(mtp, mtp_sd: dict, L: int, E: int):
    """The MTP module really holds the tensors we wrote (not fresh init)."""
    torch = _torch()
    lay = mtp.layers[0]
    p = f"model.layers.{L}."
    pairs = [
        (lay.enorm.weight, mtp_sd[p + "enorm.weight"]),
        (lay.hnorm.weight, mtp_sd[p + "hnorm.weight"]),
        (lay.eh_proj.weight, mtp_sd[p + "eh_proj.weight"]),
        (lay.post_norm.weight, mtp_sd[p + "shared_head.norm.weight"]),
        (lay.mtp_block.self_attn.q_proj.weight, mtp_sd[p + "self_attn.q_proj.weight"]),
        (lay.mtp_block.mlp.gate.weight, mtp_sd[p + "mlp.gate.weight"]),
        (lay.mtp_block.mlp.gate.e_score_correction_bias, mtp_sd[p + "mlp.gate.e_score_correction_bias"]),
    ]
    if p + "mlp.experts.gate_up_proj" in mtp_sd:
        pairs.append((lay.mtp_block.mlp.experts.gate_up_proj, mtp_sd[p + "mlp.experts.gate_up_proj"]))
    else:
        pairs.append((lay.mtp_block.mlp.experts.gate_up_proj[E - 1],
                      np.concatenate([mtp_sd[p + f"mlp.experts.{E - 1}.gate_proj.weight"],
                                      mtp_sd[p + f"mlp.experts.{E - 1}.up_proj.weight"]])))
    for t, a in pairs:
        np.testing.assert_array_equal(t.detach().to(torch.float32).numpy(), np.asarray(a, np.float32))


def _versions() -> dict:
    import safetensors
    import tokenizers
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__, "numpy": np.__version__}


def _write_expected(d: str, arrays: dict, info: dict):
    np.savez_compressed(os.path.join(d, "expected.npz"), **arrays)
    info["arrays"] = {k: f"{v.dtype}{list(v.shape)}" for k, v in arrays.items()}
    info["versions"] = _versions()
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")


GREEDY_NOTE = ("greedy_tokens = transformers generate(greedy_prompt, GenerationConfig(do_sample=False, "
               "max_new_tokens=32, eos_token_id=None)), eos disabled so exactly 32 tokens; checked equal to an "
               "uncached argmax loop over full forwards.")


# ------------------------------------------------------------------------------------------------ fixtures
def _make_main(name: str, out_dir: str, cfg_kwargs: dict, seed: int, **kw):
    """Builds the fixture; retries with another model seed while routing is too close to a tie."""
    for attempt in range(8):
        s = seed + 100 * attempt
        res = _make_main_once(name, out_dir, cfg_kwargs, s, **kw)
        if res[3] >= MIN_ROUTER_GAP:
            return res[:3]
        logging.warning("%s seed %d: router gap %.2e < %.0e, retrying", name, s, res[3], MIN_ROUTER_GAP)
    raise RuntimeError(f"{name}: no seed with router gap >= {MIN_ROUTER_GAP}")


def _make_main_once(name: str, out_dir: str, cfg_kwargs: dict, seed: int, *, with_mtp_head: bool,
                    tokenizer: bool, legacy_rope: bool, T: int):
    torch = _torch()
    from safetensors.numpy import load_file

    d = os.path.join(out_dir, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    cfg_kwargs = dict(cfg_kwargs)
    info = {"name": name, "seed": seed, "config_kwargs": cfg_kwargs}
    specials = None
    if tokenizer:
        specials = _train_tokenizer(cfg_kwargs["vocab_size"], os.path.join(d, "tokenizer.json"))
        eos = [specials["<|endoftext|>"], specials["<|user|>"]]
        cfg_kwargs.update(eos_token_id=eos, pad_token_id=specials["<|endoftext|>"])
        info["special_token_ids"] = specials

    model = _new_model(cfg_kwargs, seed)
    L = cfg_kwargs["num_hidden_layers"]
    E = cfg_kwargs["n_routed_experts"]
    model.save_pretrained(d)
    st = os.path.join(d, "model.safetensors")
    sd = load_file(st)
    mtp_sd = _mtp_tensors(cfg_kwargs, seed + 1000, with_mtp_head,
                          sd["model.embed_tokens.weight"], sd["lm_head.weight"])
    sd.update(mtp_sd)
    _save_st(st, sd)

    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg_json = json.load(f)
    if legacy_rope:
        rp = cfg_json.pop("rope_parameters")
        cfg_json["rope_theta"] = rp["rope_theta"]
        cfg_json["partial_rotary_factor"] = rp["partial_rotary_factor"]
    with open(cfg_path, "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
        f.write("\n")
    if tokenizer:
        gen = {"_from_model_config": False, "eos_token_id": cfg_kwargs["eos_token_id"],
               "pad_token_id": cfg_kwargs["pad_token_id"], "do_sample": True, "temperature": 0.6, "top_p": 0.95}
        with open(os.path.join(d, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
            f.write("\n")
        info["tokenizer"] = ("byte-level BPE (tokenizers) trained on a built-in English text; vocab == vocab_size; "
                             "generation_config eos_token_id = [<|endoftext|>, <|user|>]")

    # the oracle runs on the model re-loaded from the files we wrote
    model2, mtp = _load(d, L)
    with torch.no_grad():
        x = torch.arange(min(16, cfg_kwargs["vocab_size"]))[None]
        np.testing.assert_array_equal(model2(input_ids=x).logits.numpy(), model(input_ids=x).logits.numpy())
    _check_mtp_loaded(mtp, mtp_sd, L, E)
    if legacy_rope:
        rp = model2.config.rope_parameters
        assert rp["rope_theta"] == cfg_kwargs["rope_parameters"]["rope_theta"], rp
        assert rp["partial_rotary_factor"] == 0.5, rp

    rng = np.random.default_rng(seed + 7)
    lo = 6 if tokenizer else 0  # keep special tokens out of the random inputs
    V = cfg_kwargs["vocab_size"]
    input_ids = rng.integers(lo, V, size=(2, T))
    prompts = (rng.integers(lo, V, size=(10,)) for _ in range(40))
    arrays = _oracle(model2, input_ids, prompts, mtp, info, avoid_ids=range(lo))

    info["checkpoint"] = {
        "files": ["model.safetensors"], "dtype": "float32", "expert_keys": "per-expert (hub names)",
        "mtp_layer_index": L,
        "mtp_has_shared_head_head_and_embed_tokens": with_mtp_head,
        "rope_form": "legacy top-level rope_theta/partial_rotary_factor" if legacy_rope else "nested rope_parameters",
    }
    info["description"] = (
        f"Tiny random Glm4MoeForCausalLM ({name}); logits: each row of input_ids run alone through transformers "
        "(f32, eager python); hidden_last: model.model(...).last_hidden_state of row 0 (post final norm). "
        + GREEDY_NOTE)
    _write_expected(d, arrays, info)
    logging.info("%s: %s", name, {k: info[k] for k in info if k.startswith("min_") or k.startswith("greedy")})
    return sd, cfg_json, arrays, info["min_router_expert_gap"]


def _make_fused(out_dir: str, src_name: str, src_sd: dict, src_cfg_json: dict, src_arrays: dict, seed: int):
    import ml_dtypes  # noqa: F401  (ships with jax; gives numpy bfloat16)

    name = "glm4moe_fused"
    d = os.path.join(out_dir, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    E = src_cfg_json.get("n_routed_experts")
    L = src_cfg_json["num_hidden_layers"]
    fused = _fuse_experts(src_sd, E)
    bf16 = np.dtype("bfloat16")
    stored = {}
    for k, v in fused.items():
        # real GLM checkpoints keep e_score_correction_bias in f32, everything else bf16
        stored[k] = v.astype(np.float32) if k.endswith("e_score_correction_bias") else v.astype(bf16)
    keys = sorted(stored)
    # shard: main layers < 2 (+ embed) in file 1, the rest (later layers, norm, lm_head, MTP) in file 2
    def shard_of(k):
        m = re.match(r"model\.layers\.(\d+)\.", k)
        if k.startswith("model.embed_tokens") or (m and int(m.group(1)) < 2):
            return 1
        return 2
    files = {1: "model-00001-of-00002.safetensors", 2: "model-00002-of-00002.safetensors"}
    weight_map = {k: files[shard_of(k)] for k in keys}
    for i, fn in files.items():
        _save_st(os.path.join(d, fn), {k: stored[k] for k in keys if shard_of(k) == i})
    total = int(sum(v.nbytes for v in stored.values()))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        f.write("\n")
    cfg_json = dict(src_cfg_json)
    cfg_json["dtype"] = "bfloat16"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
        f.write("\n")

    info = {"name": name, "seed": seed, "source_fixture": src_name}
    model, mtp = _load(d, L)  # transformers loads the bf16 fused shards into an f32 model
    # sanity: the loaded f32 model holds exactly the bf16-rounded source weights
    upcast = {k: np.asarray(v, np.float32) for k, v in stored.items()}
    msd = model.state_dict()
    for k, t in msd.items():
        if k in upcast:
            np.testing.assert_array_equal(t.float().numpy(), upcast[k], err_msg=k)
    mtp_up = {k: v for k, v in upcast.items() if k.startswith(f"model.layers.{L}.")}
    _check_mtp_loaded(mtp, mtp_up, L, E)

    arrays = _oracle(model, src_arrays["input_ids"], [src_arrays["greedy_prompt"]], mtp, info,
                     avoid_ids=range(len(SPECIAL_TOKENS)))
    info["checkpoint"] = {
        "files": list(files.values()) + ["model.safetensors.index.json"],
        "dtype": "bfloat16 (e_score_correction_bias float32)",
        "expert_keys": "fused: mlp.experts.gate_up_proj [E,2I,H] (rows [:I] gate, [I:] up), "
                       "mlp.experts.down_proj [E,H,I]; also for the MTP layer",
        "mtp_layer_index": L,
        "sharding": "file 1: embed + layers 0-1; file 2: layers 2.., norm, lm_head, MTP layer",
    }
    info["description"] = (
        f"Weights of {src_name} rounded to bf16, written fused + sharded. Expected outputs: transformers "
        "Glm4MoeForCausalLM.from_pretrained(<this dir>, dtype=float32) (bf16 -> f32 upcast), same input_ids / "
        "greedy_prompt as the source fixture. " + GREEDY_NOTE)
    info["max_abs_logit_diff_vs_f32_source"] = float(np.abs(arrays["logits"] - src_arrays["logits"]).max())
    _write_expected(d, arrays, info)
    logging.info("%s: %s", name, {k: info[k] for k in info if k.startswith("min_") or k.startswith("greedy")})


def main(argv):
    del argv
    torch = _torch()
    torch.set_num_threads(FLAGS.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    out_dir = FLAGS.out or _default_out()
    os.makedirs(out_dir, exist_ok=True)
    only = set(FLAGS.only)
    known = {"glm4moe_full", "glm4moe_plain", "glm4moe_fused"}
    if only - known:
        raise app.UsageError(f"unknown fixture(s) {sorted(only - known)}; known: {sorted(known)}")
    want = lambda n: not only or n in only  # noqa: E731
    seed = FLAGS.seed

    if want("glm4moe_full") or want("glm4moe_fused"):
        full = _make_main("glm4moe_full", out_dir if want("glm4moe_full") else tempfile.mkdtemp(), FULL_CFG, seed,
                          with_mtp_head=True, tokenizer=True, legacy_rope=False, T=16)
        if want("glm4moe_fused"):
            _make_fused(out_dir, "glm4moe_full", *full, seed=seed)
    if want("glm4moe_plain"):
        _make_main("glm4moe_plain", out_dir, PLAIN_CFG, seed + 1, with_mtp_head=False, tokenizer=False,
                   legacy_rope=True, T=13)
    for n in sorted(os.listdir(out_dir)):
        p = os.path.join(out_dir, n)
        if os.path.isdir(p):
            size = sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p))
            print(f"{n}: {size / 1024:.0f} KiB")


def run():
    app.run(main)


if __name__ == "__main__":
    run()

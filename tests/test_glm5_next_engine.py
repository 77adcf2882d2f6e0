"""glm5_next through the Engine (resident experts, the one-jit step, the scheduler): transformers' greedy tokens,
rows reused by later requests (a KDA state starts afresh at position 0), what is refused, the cache's bytes."""

import json
import os

import jax
import numpy as np
import pytest

import glm_jax
from glm_jax import model as M
from glm_jax.errors import GlmJaxError
from glm_jax.model import glm5_next

FIX = os.path.join(os.path.dirname(__file__), "golden", "glm5next")


@pytest.fixture(scope="module")
def eng():
    # prefill chunks of 16 positions (the least): a longer prompt is prefilled in several forwards
    e = glm_jax.Engine.load(FIX, dtype="float32", kv_cache_dtype="float32", prefill_chunk=16)
    yield e
    e.close()


@pytest.fixture(scope="module")
def exp():
    with np.load(os.path.join(FIX, "expected.npz")) as z:
        return {k: z[k] for k in z.files}


def test_logits_match_transformers(eng, exp):
    assert np.abs(np.asarray(eng.logits(exp["input_ids"][0].tolist())) - exp["logits"][0]).max() <= 1e-4


def test_padded_batch_of_two(eng, exp):
    """Two sequences of different lengths in one right-padded forward: each row's logits as transformers' alone
    (the shorter row's padding positions change neither its KDA states nor the other row)."""
    a, b = exp["input_ids"][0].tolist(), exp["input_ids"][1].tolist()
    la, lb = eng.logits([a, b[:7]])
    assert np.abs(np.asarray(la) - exp["logits"][0]).max() <= 1e-4
    assert np.abs(np.asarray(lb) - exp["logits"][1][:7]).max() <= 1e-4


def test_greedy_matches_transformers_and_rows_start_afresh(eng, exp):
    prompt, want = exp["greedy_prompt"].tolist(), exp["greedy_tokens"].tolist()
    first = eng.generate(prompt, max_new_tokens=len(want), temperature=0.0, stop_on_eos=False)
    assert first.tokens == want
    # the same row again, its KDA state left by the first request: a prefill from position 0 starts it afresh
    assert eng.generate(prompt, max_new_tokens=len(want), temperature=0.0, stop_on_eos=False).tokens == want
    both = eng.generate([exp["input_ids"][1].tolist(), prompt], max_new_tokens=len(want), temperature=0.0,
                        stop_on_eos=False)
    assert both[1].tokens == want


def test_chunked_prompt_continues_the_state(eng, exp):
    """A 24-token prompt (the greedy prompt and its first 16 tokens) prefilled as 16 + 8 positions: the KDA states
    carry over from one chunk to the next, and the continuation is transformers' remaining tokens."""
    prompt, want = exp["greedy_prompt"].tolist(), exp["greedy_tokens"].tolist()
    res = eng.generate(prompt + want[:16], max_new_tokens=8, temperature=0.0, stop_on_eos=False)
    assert res.tokens == want[16:]


def test_prefix_reuse_only_of_the_whole_held_sequence(eng, exp):
    """A later turn that extends everything a finished row holds continues from its KDA state (cached_tokens), and
    gives transformers' tokens; one that shares only part of it prefills its whole prompt (never a state that is not
    exactly the shared prefix's)."""
    prompt, want = exp["greedy_prompt"].tolist(), exp["greedy_tokens"].tolist()
    kw = dict(temperature=0.0, stop_on_eos=False)
    assert eng.generate(prompt, max_new_tokens=8, **kw).tokens == want[:8]
    turn = eng.generate(prompt + want[:16], max_new_tokens=8, **kw)      # the row holds prompt + want[:7]
    assert turn.tokens == want[16:] and turn.stats["cached_tokens"] == len(prompt) + 7
    part = eng.generate(exp["input_ids"][0].tolist(), max_new_tokens=1, **kw)   # shares only the 8 prompt tokens
    assert part.stats["cached_tokens"] == 0
    assert part.tokens == [int(np.argmax(exp["logits"][0][-1]))]


def test_cache_bytes(eng, exp):
    cfg = eng.cfg
    eng.logits(exp["input_ids"][0].tolist())
    B, S = eng._cache_batch, eng._cache_len
    state = sum(v.nbytes for c in eng._cache for k, v in c.items() if k in M.STATE_KEYS)
    kv = sum(v.nbytes for c in eng._cache for k, v in c.items() if k not in M.STATE_KEYS)
    assert state == B * glm5_next.state_bytes_per_row(cfg) > 0
    assert kv == B * S * M.kv_bytes_per_token(cfg, 4) > 0


def test_converted_f32_container_matches_transformers(tmp_path, exp):
    """glm-jax-convert with float experts and dense weights: the text part under the flat names (no vision tower),
    every MoE layer's experts in a record file, and the container, loaded with every expert resident, gives
    transformers' logits and greedy tokens."""
    from glm_jax.experts.container import SafeTensorsDir
    from glm_jax.experts.convert import convert
    dst = str(tmp_path / "c")
    man = convert(FIX, dst, expert_format="f32", dense_format="f32", progress=False)
    assert sorted(int(L) for L in man["layers"]) == [1, 2, 3]
    assert all(v["num_experts"] == 4 for v in man["layers"].values())
    st = SafeTensorsDir(dst)
    keys = list(st.keys())
    st.close()
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" in keys
    assert not any("visual" in k or "language_model" in k or ".experts." in k for k in keys)
    e = glm_jax.Engine.load(dst, dtype="float32", kv_cache_dtype="float32")
    try:
        for b in range(2):
            assert np.abs(np.asarray(e.logits(exp["input_ids"][b].tolist())) - exp["logits"][b]).max() <= 1e-4
        want = exp["greedy_tokens"].tolist()
        got = e.generate(exp["greedy_prompt"].tolist(), max_new_tokens=len(want), temperature=0.0, stop_on_eos=False)
        assert got.tokens == want
        with pytest.raises(GlmJaxError, match="fetch") as err:
            glm_jax.Engine.load(dst, fetch="loop")
        assert "\n" not in str(err.value)
    finally:
        e.close()


def test_converted_int4_container_is_the_checkpoints_int4(tmp_path, exp):
    """int4_g64 experts (float dense): transformers' argmax at every position and its logits to int4's rounding
    (measured 0.070 / 0.115 of logits up to 3.7), and bitwise the HF checkpoint run with the same expert format."""
    from glm_jax.experts.convert import convert
    dst = str(tmp_path / "c4")
    convert(FIX, dst, expert_format="int4_g64", dense_format="f32", progress=False)
    engines = [glm_jax.Engine.load(d, dtype="float32", kv_cache_dtype="float32", **kw)
               for d, kw in ((dst, {}), (FIX, {"expert_format": "int4_g64"}))]
    try:
        for b in range(2):
            got, hf = (np.asarray(e.logits(exp["input_ids"][b].tolist())) for e in engines)
            assert np.array_equal(got, hf)
            assert np.abs(got - exp["logits"][b]).max() <= 0.2
            assert (got.argmax(-1) == exp["logits"][b].argmax(-1)).all()
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("opt, msg", [({"draft": 2}, "draft"), ({"fetch": "loop"}, "fetch"),
                                      ({"dense_format": "int8_row"}, "dense_format")])
def test_unsupported_options_are_one_line_errors(opt, msg):
    with pytest.raises(GlmJaxError, match=msg) as e:
        glm_jax.Engine.load(FIX, **opt)
    assert "\n" not in str(e.value) and "glm5_next" in str(e.value)
    jax.clear_caches()


def _wide_checkpoint(d: str, E: int = 288, K: int = 8) -> dict:
    """The golden checkpoint with E routed experts top-K in every MoE layer (GLM-5.3-Flash's count; random experts
    and router rows in the fused layout save_pretrained writes): returns the fused expert tensors by key."""
    from safetensors.numpy import load_file, save_file
    os.makedirs(d)
    t = load_file(os.path.join(FIX, "model.safetensors"))
    with open(os.path.join(FIX, "config.json")) as f:
        cfg = json.load(f)
    tc = cfg["text_config"]
    H, I = tc["hidden_size"], tc["moe_intermediate_size"]
    rng = np.random.default_rng(7)
    experts = {}
    for L in (1, 2, 3):
        p = f"model.language_model.layers.{L}.mlp."
        for k in [k for k in t if k.startswith(p + "experts.")]:
            del t[k]
        experts[p + "experts.gate_up_proj"] = (rng.normal(size=(E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
        experts[p + "experts.down_proj"] = (rng.normal(size=(E, H, I)) / np.sqrt(I)).astype(np.float32)
        t[p + "gate.weight"] = rng.normal(size=(E, H)).astype(np.float32)
        t[p + "gate.e_score_correction_bias"] = (0.1 * rng.normal(size=(E,))).astype(np.float32)
    mtp = "model.language_model.layers.4."          # an MTP layer past num_hidden_layers, as hub checkpoints carry
    t[mtp + "eh_proj.weight"] = np.zeros((H, 2 * H), np.float32)
    t[mtp + "mlp.experts.gate_up_proj"] = np.zeros((E, 2 * I, H), np.float32)
    save_file(dict(t, **experts), os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    tc.update(n_routed_experts=E, num_experts_per_tok=K)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return experts


def test_convert_writes_288_expert_layers_that_run_resident(tmp_path, exp):
    """GLM-5.3-Flash's 288 experts a MoE layer (top-8; tiny widths, fused expert tensors): every layer's record file
    holds all 288, each record the int4_g64 quantization of its source expert (within half a step), and the
    container runs as the checkpoint does with the same expert format."""
    from glm_jax.experts.container import SafeTensorsDir, open_container
    from glm_jax.experts.convert import convert
    from glm_jax.kernels import formats as quant
    src, dst = str(tmp_path / "hf"), str(tmp_path / "c")
    experts = _wide_checkpoint(src)
    man = convert(src, dst, expert_format="int4_g64", dense_format="f32", progress=False)
    assert {L: v["num_experts"] for L, v in man["layers"].items()} == {"1": 288, "2": 288, "3": 288}
    st = SafeTensorsDir(dst)
    assert not any(k.startswith("model.layers.4.") for k in st.keys())
    st.close()
    c = open_container(dst)
    try:
        for L in (1, 2, 3):
            for e in (0, 141, 287):
                r = c.load_expert(L, e)
                for name, part in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                    w = experts[f"model.language_model.layers.{L}.mlp.experts.{part}"][e]
                    got = quant.dequantize(r[name], r[name + "_scale"], "int4_g64")
                    amax = np.abs(w).max(-1, keepdims=True)       # rows of 32 / 16: one group each
                    assert (np.abs(got - w) <= amax / 7 * (1 + 2.0 ** -10) / 2 + 1e-6).all(), (L, e, name)
    finally:
        c.close()
    engines = [glm_jax.Engine.load(d, dtype="float32", kv_cache_dtype="float32", **kw)
               for d, kw in ((dst, {}), (src, {"expert_format": "int4_g64"}))]
    try:
        got, hf = (np.asarray(e.logits(exp["input_ids"][0].tolist())) for e in engines)
        assert np.isfinite(got).all() and np.array_equal(got, hf)
    finally:
        for e in engines:
            e.close()

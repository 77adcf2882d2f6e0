"""Engine vs transformers (golden fixtures written by tools/fixtures/make_golden.py; no torch needed here)."""

import json
import os
import shutil

import numpy as np
import pytest

import glm_jax
from glm_jax.experts.weights import WeightError
from glm_jax.model.config import ConfigError, load_config

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
NAMES = ["glm4moe_full", "glm4moe_plain", "glm4moe_fused", "dsa_dense", "dsa_sparse", "lite", "lite_direct_q"]


_ENGINES = {}


def _engine(name):
    """One engine per fixture for the whole module: every test reuses its compiled functions."""
    if name not in _ENGINES:
        # transformers' fixtures keep their K/V in float32: the parity here is the math's, at 1e-4
        _ENGINES[name] = glm_jax.Engine.load(os.path.join(GOLDEN, name), dtype="float32", kv_cache_dtype="float32")
    return _ENGINES[name]


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    path = os.path.join(GOLDEN, request.param)
    exp = dict(np.load(os.path.join(path, "expected.npz")))
    return request.param, _engine(request.param), exp


def test_logits_match_transformers(case):
    name, eng, exp = case
    for row in range(exp["input_ids"].shape[0]):
        n = int(exp["lengths"][row])
        got = eng.logits(exp["input_ids"][row, :n].tolist())
        assert got.shape == (n, eng.cfg.vocab_size)
        err = np.abs(got - exp["logits"][row, :n]).max()
        assert err < 1e-4, f"{name} row {row}: max abs diff {err}"


def test_greedy_matches_transformers(case):
    name, eng, exp = case
    res = eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=32, temperature=0.0, stop_on_eos=False)
    assert res.tokens == exp["greedy_tokens"].tolist(), name
    s = res.stats
    assert s["prefill_tokens"] == len(exp["greedy_prompt"]) and s["decode_tokens"] == 31
    assert s["decode_tok_s"] > 0 and s["prefill_s"] >= 0


@pytest.mark.parametrize("name", NAMES)
def test_default_f16_kv_cache_stays_within_its_rounding_of_transformers(name):
    """The default K/V cache is float16 (--kv_cache_dtype=auto with f32 activations, llama.cpp's default), MLA
    models' included: half the bytes of the f32 cache transformers keeps.  Each stored K/V value is rounded to 11
    significant bits, so the logits move by a few 1e-3 (2-5e-3 measured on these fixtures against < 1e-4 with an
    f32 cache); every position's top-1 and the 32 greedy tokens stay transformers'.  The cache really is f16 (the rows' arrays)."""
    path = os.path.join(GOLDEN, name)
    exp = dict(np.load(os.path.join(path, "expected.npz")))
    eng = glm_jax.Engine.load(path)
    try:
        assert eng.dtype == np.float32 and eng.kv_dtype == np.float16
        for row in range(exp["input_ids"].shape[0]):
            n = int(exp["lengths"][row])
            got, ref = eng.logits(exp["input_ids"][row, :n].tolist()), exp["logits"][row, :n]
            assert np.abs(got - ref).max() < 1e-2, (name, row, np.abs(got - ref).max())
            assert (got.argmax(-1) == ref.argmax(-1)).all(), (name, row)
        res = eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=32, temperature=0.0, stop_on_eos=False)
        assert res.tokens == exp["greedy_tokens"].tolist(), name
        assert {v.dtype for layer in eng._cache for v in layer.values()} == {np.dtype(np.float16)}
    finally:
        eng.close()


def test_prefill_plus_decode_equals_full_forward(case):
    name, eng, exp = case
    ids = exp["input_ids"][0].tolist()
    full = eng.logits(ids)
    P = 9
    eng._ensure_cache(1, len(ids) + 1)
    toks = np.zeros((1, 16), np.int32)
    toks[0, :P] = ids[:P]
    lg, _ = eng.forward(toks, np.zeros(1, np.int32), np.array([P], np.int32))
    rows = [np.asarray(lg)[0, :P]]
    for pos in range(P, len(ids)):
        lg, _ = eng.forward(np.array([[ids[pos]]], np.int32), np.array([pos], np.int32), np.array([1], np.int32))
        rows.append(np.asarray(lg)[0])
    inc = np.concatenate(rows)
    assert np.abs(inc - full).max() < 1e-4
    assert (inc.argmax(-1) == full.argmax(-1)).all()


def test_batch_of_two_equals_two_singles(case):
    name, eng, exp = case
    a = exp["input_ids"][0].tolist()
    b = exp["input_ids"][1].tolist()[:-3]           # different lengths: exercises right padding
    ba, bb = eng.batch_logits([a, b])
    assert np.abs(ba - eng.logits(a)).max() < 1e-5
    assert np.abs(bb - eng.logits(b)).max() < 1e-5


def test_sampling_is_seeded_and_respects_top_k():
    eng = _engine("glm4moe_full")
    p = [7, 8, 9, 10]
    r1 = eng.generate(p, max_new_tokens=12, temperature=0.9, top_k=5, top_p=0.9, seed=3, stop_on_eos=False)
    r2 = eng.generate(p, max_new_tokens=12, temperature=0.9, top_k=5, top_p=0.9, seed=3, stop_on_eos=False)
    assert r1.tokens == r2.tokens
    # top_k=1 sampling is greedy
    g = eng.generate(p, max_new_tokens=12, temperature=0.0, stop_on_eos=False)
    k1 = eng.generate(p, max_new_tokens=12, temperature=1.3, top_k=1, seed=5, stop_on_eos=False)
    assert k1.tokens == g.tokens


def test_eos_stops_generation():
    path = os.path.join(GOLDEN, "glm4moe_full")
    eng = _engine("glm4moe_full")
    exp = np.load(os.path.join(path, "expected.npz"))
    greedy = exp["greedy_tokens"].tolist()
    # make the 5th greedy token an eos id: generation must stop right after it
    saved = eng.cfg
    eng.cfg = eng.cfg.__class__(**{**eng.cfg.__dict__, "eos_token_ids": (greedy[4],)})
    try:
        res = eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=32)
    finally:
        eng.cfg = saved
    assert res.tokens == greedy[: greedy.index(greedy[4]) + 1]


def test_tokenizer_and_chat_format():
    eng = _engine("glm4moe_full")
    ids = eng.encode("hello world")
    assert ids and eng.decode(ids) == "hello world"
    chat = eng.encode("hi", chat=True)
    tok = eng.tokenizer
    assert chat[:3] == [tok.token_id("[gMASK]"), tok.token_id("<sop>"), tok.token_id("<|user|>")]
    assert tok.token_id("<|assistant|>") in chat
    res = eng.generate("hello", max_new_tokens=4, chat=True, stop_on_eos=False)
    assert len(res.tokens) == 4 and isinstance(res.text, str)


# ----------------------------------------------------------------------------- errors
def _copy(tmp_path, name="glm4moe_plain"):
    dst = tmp_path / name
    shutil.copytree(os.path.join(GOLDEN, name), dst)
    return dst


def test_unsupported_model_type_is_one_line_error(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: field 'model_type': unsupported model_type 'llama'"):
        load_config(str(d))


@pytest.mark.parametrize("field,value,msg", [
    ("num_key_value_heads", 3, "does not divide"),
    ("num_experts_per_tok", 99, "num_experts_per_tok"),
    ("n_group", 3, "n_group"),
    ("hidden_size", "big", "expected an integer"),
    ("partial_rotary_factor", 1.5, "partial_rotary_factor"),
])
def test_inconsistent_config_names_the_field(tmp_path, field, value, msg):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as ei:
        load_config(str(d))
    text = str(ei.value)
    assert f"'{field}'" in text and msg in text and "\n" not in text


def test_both_rope_forms_parse_the_same():
    full = load_config(os.path.join(GOLDEN, "glm4moe_full"))     # nested rope_parameters
    plain = load_config(os.path.join(GOLDEN, "glm4moe_plain"))   # legacy top-level fields
    assert full.partial_rotary_factor == 0.5 and full.rotary_dim == 16
    raw = json.load(open(os.path.join(GOLDEN, "glm4moe_plain", "config.json")))
    assert "rope_parameters" not in raw and plain.rope_theta == raw["rope_theta"]


def _rewrite_tensors(d, fn):
    from safetensors.numpy import load_file, save_file

    path = str(d / "model.safetensors")
    t = load_file(path)
    fn(t)
    save_file(t, path)


def test_missing_key_names_key_and_shape(tmp_path):
    d = _copy(tmp_path)
    _rewrite_tensors(d, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(WeightError, match=r"missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight' "
                                          r"\(expected shape \[32, 64\]\)"):
        glm_jax.Engine.load(str(d))


def test_wrong_shape_names_key_and_expected_shape(tmp_path):
    d = _copy(tmp_path)

    def bad(t):
        t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((7, 64), np.float32)
    _rewrite_tensors(d, bad)
    with pytest.raises(WeightError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \[7, 64\], "
                                          r"expected \[128, 64\]"):
        glm_jax.Engine.load(str(d))


def test_unknown_option_is_rejected():
    with pytest.raises(glm_jax.GlmJaxError, match="option 'no_such_flag': unknown"):
        glm_jax.Engine.load(os.path.join(GOLDEN, "glm4moe_plain"), no_such_flag=1)


def test_env_alias_and_flag_precedence():
    from glm_jax import options as O

    on = {"colibri_env": True}          # the aliases are read only when asked for (issue 22)
    assert O.resolve(dict(on), {"EXPERT_BUDGET": "4"})["expert_budget"] == 4
    assert O.resolve({}, {"EXPERT_BUDGET": "4"})["expert_budget"] == 0
    assert O.resolve({"expert_budget": 6, **on}, {"EXPERT_BUDGET": "4"})["expert_budget"] == 6
    with pytest.raises(O.OptionError, match="environment variable TOPP"):
        O.resolve(dict(on), {"TOPP": "abc"})

"""glm4_moe_lite (GLM-4.7-Flash: MLA without the DSA indexer) against transformers: the config, a real-width check,
the MTP layer through speculation, bf16 / sharded / FP8 sources, and a converted container streamed below its size
through every fetch mode and glm-jax.  Fixtures: tools/fixtures/make_golden_lite.py (no torch here)."""

import json
import os
import shutil

import numpy as np
import pytest

import glm_jax
from glm_jax.model import mla
from glm_jax.model.config import ConfigError, config_from_dict, load_config
from tools.fixtures.synth_model import write_hf_checkpoint

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
LITE = os.path.join(GOLDEN, "lite")


def _exp(name="lite"):
    return dict(np.load(os.path.join(GOLDEN, name, "expected.npz")))


def _raw(name="lite"):
    with open(os.path.join(GOLDEN, name, "config.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- config
def test_config_reads_the_lite_fields():
    c = load_config(LITE)
    assert c.model_type == "glm4_moe_lite" and c.is_mla and c.indexer_types == () and c.index_topk is None
    assert c.mlp_layer_types == ("dense", "sparse", "sparse") and c.rope_interleave
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.head_dim, c.rotary_dim) == (32, 16, 8, 8, 8)
    assert c.routed_scaling_factor == 1.8 and c.num_experts_per_tok == 4 and c.has_mtp
    assert mla.indexer_type(c, 0) == mla.indexer_type(c, c.num_hidden_layers) == "none"
    assert {mla.variant_layer(c, i) for i in range(c.num_hidden_layers + 1)} == {0}   # one program for all layers
    d = load_config(os.path.join(GOLDEN, "lite_direct_q"))
    assert d.q_lora_rank is None and not d.rope_interleave


def test_cache_bytes_match_kv_bytes_per_token():
    """The memory plan's K/V bytes are the latent cache's (kv_lora + rope a layer, the MTP layer's too; no indexer
    keys): GLM-4.7-Flash keeps 576 values a position a layer where a plain cache of its 20 heads would keep 10,240."""
    import jax.numpy as jnp

    from glm_jax.model.attention import init_cache, kv_bytes_per_token

    cfg = load_config(LITE)
    cache = init_cache(cfg, 1, 1, jnp.float32, with_mtp=True)
    assert [sorted(c) for c in cache] == [["ckv", "kpe"]] * (cfg.num_hidden_layers + 1)
    assert sum(a.size * 4 for c in cache for a in c.values()) == kv_bytes_per_token(cfg, 4) == 4 * 24 * 4
    real = config_from_dict(json.load(open(os.path.join(GOLDEN, "lite_real_width", "config.json"))), "x")
    kb = mla.kv_bytes_per_token(real, 1)
    assert kb["per_layer_full"] == kb["per_layer_shared"] == 576 and kb["per_layer_uncompressed"] == 20 * (256 + 256)


def test_config_defaults_and_refusals():
    raw = _raw()
    for k in ("mlp_layer_types", "rope_interleave", "q_lora_rank"):
        raw.pop(k, None)
    c = config_from_dict(dict(raw, first_k_dense_replace=2), "x.json")
    assert c.mlp_layer_types == ("dense", "dense", "sparse") and c.rope_interleave and c.q_lora_rank is None
    assert config_from_dict(raw, "x.json").mlp_layer_types == ("dense", "sparse", "sparse")   # transformers' default
    with pytest.raises(ConfigError, match="x.json: field 'partial_rotary_factor'"):
        config_from_dict(dict(raw, partial_rotary_factor=0.5), "x.json")
    with pytest.raises(ConfigError, match="field 'rope_interleave': expected true/false"):
        config_from_dict(dict(raw, rope_interleave="yes"), "x.json")
    with pytest.raises(ConfigError, match="field 'kv_lora_rank': missing"):
        config_from_dict({k: v for k, v in raw.items() if k != "kv_lora_rank"}, "x.json")
    with pytest.raises(ConfigError, match="field 'q_lora_rank': must be positive"):
        config_from_dict(dict(raw, q_lora_rank=0), "x.json")
    with pytest.raises(ConfigError, match="supported: glm4_moe, glm_moe_dsa, glm4_moe_lite"):
        config_from_dict(dict(raw, model_type="glm4_moe_heavy"), "x.json")


# ----------------------------------------------------------------------------- real widths
def test_real_width_two_layers_match_transformers(tmp_path):
    """Two layers (dense + MoE) at GLM-4.7-Flash's real widths (H 2048, 20 heads, q LoRA 768, kv LoRA 512, nope 192,
    rope 64, v 256), 4 experts, a 512-token vocabulary: the checkpoint is regenerated from its seed, transformers'
    logits are the fixture's (4.4e-6 max abs measured, native kernels)."""
    d = os.path.join(GOLDEN, "lite_real_width")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    info = json.load(open(os.path.join(d, "expected.json")))
    exp = _exp("lite_real_width")
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, cfg, seed=info["seed"], keep_reference=False, head_role="proj")
    eng = glm_jax.Engine.load(src, dtype="float32", kv_cache_dtype="float32")
    try:
        got = eng.logits(exp["input_ids"].tolist())
    finally:
        eng.close()
    assert np.abs(got - exp["logits"]).max() <= 5e-5, np.abs(got - exp["logits"]).max()
    assert (got.argmax(-1) == exp["logits"].argmax(-1)).all()


# ----------------------------------------------------------------------------- MTP through speculation
def test_mtp_drafts_keep_greedy_and_the_layer_matches_transformers():
    """The checkpoint's nextn layer (MLA, no indexer) gives transformers' MTP logits, and greedy with MTP drafts is
    greedy without them (drafts verified by the main model)."""
    import jax
    import jax.numpy as jnp

    from glm_jax import model as M

    exp = _exp()
    eng = glm_jax.Engine.load(LITE, dtype="float32", kv_cache_dtype="float32")
    try:
        cfg, params = eng.cfg, eng.params
        assert params["mtp"] is not None
        cache = M.init_cache(cfg, 1, 32, jnp.float32, with_mtp=True)
        start = jnp.asarray([int(exp["mtp_position_ids"][0]) - 1], jnp.int32)
        lg = jax.jit(lambda p, c, t, h, s: M.mtp_forward(cfg, p, c, t, h, s)[0])(
            params, cache, jnp.asarray(exp["mtp_input_ids"])[None], jnp.asarray(exp["mtp_hidden_in"])[None], start)
        assert np.abs(np.asarray(lg[0]) - exp["mtp_logits"]).max() < 1e-4
        prompt = exp["greedy_prompt"].tolist()
        runs = []
        for opts in (dict(draft=0), dict(mtp=True, mtp_guard_pct=0.0)):   # read per generate call (test_mtp.py)
            saved = dict(eng.opts)
            eng.opts.update(opts)
            try:
                runs.append(eng.generate(prompt, max_new_tokens=8, stop_on_eos=False, temperature=0.0))
            finally:
                eng.opts.clear()
                eng.opts.update(saved)
        plain, spec = runs
    finally:
        eng.close()
    assert plain.tokens == spec.tokens == exp["greedy_tokens"][:8].tolist()
    assert spec.stats["drafts_proposed"] > 0


# ----------------------------------------------------------------------------- sources
@pytest.mark.parametrize("dtype,shards", [("bfloat16", 3), ("fp8", 1)])
def test_bf16_sharded_and_fp8_sources_load_as_their_values(tmp_path, dtype, shards):
    """A lite checkpoint stored bf16 in 3 shards, or FP8 with 128x128 block scales, loads as the float32 values it
    holds (the same checkpoint written in f32 from the writer's reference)."""
    from safetensors.numpy import save_file

    cfg = dict(_raw(), q_lora_rank=None, hidden_size=128, intermediate_size=128, moe_intermediate_size=128)
    src, ref_dir = str(tmp_path / "src"), str(tmp_path / "ref")
    ref = write_hf_checkpoint(src, cfg, seed=3, dtype=dtype, shards=shards)
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json")) == (shards > 1)
    os.makedirs(ref_dir)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in ref.items()}, os.path.join(ref_dir, "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), ref_dir)
    ids = [3, 9, 27, 81, 4]
    got = [glm_jax.Engine.load(d, dtype="float32", kv_cache_dtype="float32", kernels="xla").logits(ids)
           for d in (src, ref_dir)]
    assert np.abs(got[0] - got[1]).max() < 1e-5


# ----------------------------------------------------------------------------- converted, streamed
@pytest.fixture(scope="module")
def container(tmp_path_factory):
    from glm_jax.experts.convert import convert

    dst = str(tmp_path_factory.mktemp("lite") / "c")
    convert(LITE, dst, expert_format="int8_row", mtp_format="int8_row", dense_format="f32", progress=False)
    return dst


@pytest.mark.parametrize("fetch", ["loop", "callback", "fused"])
def test_container_streams_in_every_fetch_mode(container, fetch):
    """The int8-expert container with 2 experts a layer cached of 8: every fetch mode reads experts from disk and
    stays within int8's rounding of transformers (top-1 of every position kept)."""
    exp = _exp()
    ids = exp["input_ids"][0].tolist()
    eng = glm_jax.Engine.load(container, fetch=fetch, cache_cap=2, kv_cache_dtype="float32")
    try:
        assert eng.opts["fetch"] == fetch
        lg = eng.logits(ids)
        res = eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=4, stop_on_eos=False)
        assert res.stats["bytes_read"] > 0 and res.stats["expert_loads"] > 0
    finally:
        eng.close()
    assert np.abs(lg - exp["logits"][0]).max() < 0.05
    assert (lg.argmax(-1) == exp["logits"][0].argmax(-1)).all()


def test_glm_jax_generates_from_the_container_below_its_size(container, capsys, tmp_path):
    """glm-jax on the converted container with an expert cache of 1 expert a layer of the 8 its files hold: it
    streams, reads and evicts experts, and writes its tokens."""
    from cli_inprocess import run

    exp = _exp()
    out = tmp_path / "o.json"
    prompt = ",".join(str(t) for t in exp["greedy_prompt"])
    rc, _, err = run(["glm-jax", f"--model={container}", f"--prompt_ids={prompt}", "--max_new_tokens=6",
                      "--ignore_eos", "--cache_cap=1", f"--output_json={out}"], capsys)
    assert rc == 0, err
    d = json.loads(out.read_text())
    assert len(d["tokens"]) == 6 and d["stats"]["bytes_read"] > 0 and d["stats"]["evictions"] > 0
    assert d["stats"]["cache_cap"] == 1 < load_config(container).n_routed_experts


# ----------------------------------------------------------------------------- chat template and tool calls
# the shape of GLM-4.7-Flash's template: tools rendered by the template, calls written without newlines
GLM47_STYLE = ("[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
               "{% endfor %}</tools>{% endif %}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
               "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function.name }}"
               "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}"
               "</arg_value>{% endfor %}</tool_call>{% endfor %}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>\n<think></think>{% endif %}")


def test_chat_template_jinja_wins_and_glm47_tool_calls_parse(tmp_path):
    """transformers 5 saves a tokenizer's template as chat_template.jinja (GLM-4.7-Flash's hub repo ships one): it is
    read, and wins over tokenizer_config.json's; GLM-4.7's compact call format (no newlines) parses."""
    from glm_jax import chat as C
    from glm_jax.serve.toolcalls import parse

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old", "eos_token": "<|user|>"}))
    (tmp_path / "chat_template.jinja").write_text(GLM47_STYLE)
    t = C.load_template(str(tmp_path))
    assert t["template"] == GLM47_STYLE and t["path"].endswith("chat_template.jinja")
    assert t["tokens"]["eos_token"] == "<|user|>"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    text = C.render(t, [{"role": "user", "content": "Paris?"}], tools=[tool])
    assert text.startswith("[gMASK]<sop><|system|>") and '"get_weather"' in text and text.endswith("<think></think>")
    content, calls, _ = parse(
        "ok<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
        "<arg_value>3</arg_value></tool_call>", [tool])
    assert content == "ok" and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}]
    (tmp_path / "tokenizer_config.json").unlink()                  # the file alone is enough
    assert C.load_template(str(tmp_path))["template"] == GLM47_STYLE
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{")
    with pytest.raises(glm_jax.GlmJaxError, match="chat_template.jinja: cannot read"):
        C.load_template(str(tmp_path))


def test_constrained_tool_calls_follow_the_templates_form():
    """tool_choice required / named forces a call in the form the checkpoint's template writes: GLM-4.7's compact
    form where the template has ``</arg_key><arg_value>``, GLM-4.5's lines elsewhere (before: always lines, a form
    GLM-4.7-Flash was not trained to write)."""
    import llguidance

    from glm_jax import chat as C
    from glm_jax.serve.constrain import ll_tokenizer, tool_call_grammar
    from glm_jax.serve.toolcalls import parse
    from glm_jax.engine import Tokenizer

    assert C.compact_tool_calls({"template": GLM47_STYLE}) and not C.compact_tool_calls(None)
    tok = Tokenizer(os.path.join(os.path.dirname(glm_jax.__file__), "default_model", "tokenizer.json"))
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}}, "required": ["a", "n"]}}}
    args = {"a": "x y", "n": 3}

    def accepts(grammar, text):
        m = llguidance.LLMatcher(ll_tokenizer(tok, tok.tok.get_vocab_size(), ()), grammar, log_level=0)
        return not m.is_error() and m.try_consume_tokens(tok.encode(text)) == len(tok.encode(text)) and m.is_accepting()

    for compact in (False, True):
        g = tool_call_grammar([tool], "f", compact=compact)
        assert accepts(g, C.format_tool_call("f", args, compact=compact))
        assert not accepts(g, C.format_tool_call("f", args, compact=not compact))
        assert [c["function"] for c in parse(C.format_tool_call("f", args, compact=compact), [tool])[1]] == [
            {"name": "f", "arguments": json.dumps(args)}]


def test_container_records_rope_interleave_where_it_is_not_the_default(container, tmp_path):
    """rope_interleave changes the math: a container converted with the default (true) does not record it (older
    containers, which never did, still open), and refuses a config.json that says false."""
    from glm_jax.experts.container import ConfigMismatchError, open_container

    with open(os.path.join(container, "manifest.json")) as f:
        assert "rope_interleave" not in json.load(f)["config_fields"]
    d = str(tmp_path / "c")
    shutil.copytree(container, d)
    raw = json.load(open(os.path.join(d, "config.json")))
    json.dump(dict(raw, rope_interleave=False), open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigMismatchError, match="'rope_interleave' is True in the container but False"):
        open_container(d, load_config(d))


def test_streamed_mtp_drafts_keep_greedy(container):
    """The container's MTP layer (its experts streamed too): greedy with MTP drafts is greedy without them."""
    exp = _exp()
    eng = glm_jax.Engine.load(container, cache_cap=2)
    try:
        assert eng.params["mtp"] is not None and eng.opts["fetch"] != "resident"
        runs = []
        for opts in (dict(draft=0), dict(mtp=True, mtp_guard_pct=0.0)):
            saved = dict(eng.opts)
            eng.opts.update(opts)
            try:
                runs.append(eng.generate(exp["greedy_prompt"].tolist(), max_new_tokens=6, stop_on_eos=False))
            finally:
                eng.opts.clear()
                eng.opts.update(saved)
    finally:
        eng.close()
    assert runs[0].tokens == runs[1].tokens and runs[1].stats["drafts_proposed"] > 0
    assert runs[1].stats["bytes_read"] > 0


def test_a_lite_checkpoint_serves_a_tool_call_in_its_templates_form(tmp_path, monkeypatch):
    """glm-jax-serve on a GLM-4.7-Flash-layout checkpoint (random weights, the shipped tokenizer, a GLM-4.7-style
    chat_template.jinja): a named tool_choice is forced in the template's compact form and comes back as
    tool_calls."""
    import openai
    import serving

    from glm_jax.serve import app as A

    shipped = os.path.join(os.path.dirname(glm_jax.__file__), "default_model")
    d = str(tmp_path / "hf")
    cfg = dict(_raw(), vocab_size=2048, eos_token_id=0, max_position_embeddings=512, num_nextn_predict_layers=0)
    write_hf_checkpoint(d, cfg, seed=5, keep_reference=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(shipped, f), d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(GLM47_STYLE)
    forms = []
    real = A.tool_call_grammar
    monkeypatch.setattr(A, "tool_call_grammar", lambda *a, **k: forms.append(k.get("compact")) or real(*a, **k))
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Rome", "Verona"]}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}}, "required": ["city", "days"]}}}
    eng = glm_jax.Engine.load(d, max_batch=2, prefill_chunk=16)
    srv = A.Server(eng, api_key="k", max_queue=4)
    with serving.running(srv):
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="k", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="hf", messages=[{"role": "user", "content": "Weather in Verona?"}], max_tokens=200, temperature=0,
            tools=[tool], tool_choice={"type": "function", "function": {"name": "weather"}})
    assert forms == [True]
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "weather" and args["city"] in ("Rome", "Verona") and 1 <= args["days"] <= 7

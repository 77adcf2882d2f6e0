"""glm5_next (GLM-5.3) through what a user runs: glm-jax on the golden checkpoint (transformers' greedy tokens) and
glm-jax-serve on a tiny GLM-5.3 checkpoint with a tokenizer and a GLM-5-style chat_template.jinja: a chat answer and
a named tool call in the template's compact form."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import glm_jax

FIX = os.path.join(os.path.dirname(__file__), "golden", "glm5next")

# transformers' glm5_next processor has no template of its own and the fixture's save_pretrained writes none; GLM-5's
# hub template (the glm_moe_dsa family's, which GLM-5.x shares with GLM-4.7) renders tools between <tools> tags in
# the system turn and writes calls without newlines: this is its shape
GLM5_STYLE = ("[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
              "{% endfor %}</tools>{% endif %}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
              "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function.name }}"
              "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}"
              "</arg_value>{% endfor %}</tool_call>{% endfor %}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n<think></think>{% endif %}")


def _exp():
    with np.load(os.path.join(FIX, "expected.npz")) as z:
        return {k: z[k] for k in z.files}


def test_glm_jax_generates_transformers_greedy_tokens(capsys, tmp_path):
    from cli_inprocess import run

    exp = _exp()
    out = tmp_path / "o.json"
    prompt = ",".join(str(t) for t in exp["greedy_prompt"])
    rc, _, err = run(["glm-jax", f"--model={FIX}", f"--prompt_ids={prompt}", "--max_new_tokens=24", "--ignore_eos",
                      "--dtype=float32", "--kv_cache_dtype=float32", f"--output_json={out}"], capsys)
    assert rc == 0, err
    assert json.loads(out.read_text())["tokens"] == exp["greedy_tokens"].tolist()


def _chat_checkpoint(d: str):
    """The golden checkpoint's weights with a 2048-token vocabulary (random embedding and head rows), the shipped
    model's tokenizer and GLM5_STYLE as chat_template.jinja."""
    os.makedirs(d)
    shipped = os.path.join(os.path.dirname(glm_jax.__file__), "default_model")
    t = load_file(os.path.join(FIX, "model.safetensors"))
    rng = np.random.default_rng(0)
    V = 2048
    for k, s in (("model.language_model.embed_tokens.weight", 1.0), ("lm_head.weight", 0.2)):
        t[k] = (s * rng.normal(size=(V, t[k].shape[1]))).astype(np.float32)
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(FIX, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"].update(vocab_size=V, eos_token_id=0, max_position_embeddings=1024)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(shipped, f), d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(GLM5_STYLE)


def test_glm5_next_serves_a_chat_and_a_named_tool_call(tmp_path, monkeypatch):
    """glm-jax-serve on a GLM-5.3 checkpoint: a chat request is answered (its prompt rendered by the checkpoint's
    template), and a tool_choice naming a function is forced in the template's compact call form and comes back as
    tool_calls with arguments matching the schema."""
    import openai
    import serving

    from glm_jax.serve import app as A

    d = str(tmp_path / "hf")
    _chat_checkpoint(d)
    forms = []
    real = A.tool_call_grammar
    monkeypatch.setattr(A, "tool_call_grammar", lambda *a, **k: forms.append(k.get("compact")) or real(*a, **k))
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Rome", "Verona"]}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}}, "required": ["city", "days"]}}}
    eng = glm_jax.Engine.load(d, max_batch=2, prefill_chunk=16)
    assert eng.cfg.model_type == "glm5_next"
    srv = A.Server(eng, api_key="k", max_queue=4)
    try:
        with serving.running(srv):
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="k", max_retries=0, timeout=120)
            chat = client.chat.completions.create(model="hf", messages=[{"role": "user", "content": "Hello there"}],
                                                  max_tokens=8, temperature=0)
            r = client.chat.completions.create(
                model="hf", messages=[{"role": "user", "content": "Weather in Verona?"}], max_tokens=200,
                temperature=0, tools=[tool], tool_choice={"type": "function", "function": {"name": "weather"}})
    finally:
        eng.close()
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    assert chat.usage.prompt_tokens == len(eng.tokenizer.encode(
        "[gMASK]<sop><|user|>\nHello there<|assistant|>\n<think></think>"))
    assert forms == [True]
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "weather" and args["city"] in ("Rome", "Verona") and 1 <= args["days"] <= 7

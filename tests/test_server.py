"""glm-jax-serve in-process on a free port, driven by the official `openai` client and by raw HTTP (every error case);
the scheduler: batch invariance of greedy output, chunked prefill, disconnects freeing their row, the context limit;
the CLI's streamed output and Ctrl-C.  One engine (the shipped model, 4 rows) and one server for the module."""

import time

import httpx
import pytest
import serving

import glm_jax
from glm_jax.runtime import scheduler as SCH
from glm_jax.runtime.scheduler import Request, Sampling, TextStream

KEY = "test-key"
ROMEO = "ROMEO:\n"


@pytest.fixture(scope="module")
def eng():
    e = glm_jax.Engine.load(max_batch=4, prefill_chunk=16)
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(eng):
    from glm_jax.serve.app import Server

    srv = Server(eng, api_key=KEY, max_queue=16)
    with serving.running(srv) as th:
        yield srv
    assert not th.is_alive()
    assert srv.thread is not None and not srv.thread.is_alive()      # lifespan shutdown stopped the engine thread


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _alone(eng, prompt, n=24, **kw):
    return eng.generate(prompt, max_new_tokens=n, **kw)


# ----------------------------------------------------------------------------- the openai client
def test_completions_and_chat_stream_and_not(server, client, eng):
    assert [m.id for m in client.models.list().data] == ["glm-jax-default"]
    ref = _alone(eng, ROMEO, 24)
    r = client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_tokens), 24)
    pieces = [c.choices[0].text for c in client.completions.create(model="glm-jax-default", prompt=ROMEO,
                                                                       max_tokens=24, temperature=0, stream=True)]
    assert len(pieces) > 1 and "".join(pieces) == ref.text
    # chat: the checkpoint's template; streamed == not streamed; usage in the last chunk when asked
    msgs = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who are you?"}]
    cref = eng.generate(msgs, chat=True, max_new_tokens=20)
    c = client.chat.completions.create(model="glm-jax-default", messages=msgs, max_tokens=20, temperature=0)
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content == cref.text
    assert c.usage.prompt_tokens == len(cref.prompt_tokens) == len(eng.encode(msgs, chat=True))
    chunks = list(client.chat.completions.create(model="glm-jax-default", messages=msgs, max_tokens=20,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == cref.text
    assert chunks[-1].usage.completion_tokens == len(cref.tokens) and not chunks[-1].choices


def test_a_chats_later_turn_reuses_its_prefix_through_the_client(client, eng):
    """Through the official client, streamed as a chat tool resends it: the second turn (the first turn's prompt,
    its reply, a new user line) reports the first turn's prompt as cached and prefills only the rest; its greedy
    text is the same with the prefix cache off (cached 0)."""
    sched = eng.scheduler
    first = ROMEO + "Whither away so fast, good sir? "
    r1 = client.completions.create(model="glm-jax-default", prompt=first, max_tokens=6, temperature=0)
    second = first + r1.choices[0].text + "\nJULIET:\nAnd what of thee?\n"

    def turn():
        chunks = list(client.completions.create(model="glm-jax-default", prompt=second, max_tokens=12,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage

    on, u_on = turn()
    try:
        sched.prefix_cache = False
        off, u_off = turn()
    finally:
        sched.prefix_cache = True
    n_first = len(eng.encode(first))
    assert u_on.prompt_tokens_details.cached_tokens >= n_first - 1      # (a token may merge across the seam)
    assert u_on.prompt_tokens_details.cached_tokens < u_on.prompt_tokens
    assert u_off.prompt_tokens_details.cached_tokens == 0
    assert on == off and u_on.completion_tokens == u_off.completion_tokens == 12


def test_stop_strings_across_token_boundaries(client, eng):
    ref = _alone(eng, ROMEO, 40).text
    # a stop string that spans tokens: the two characters around the first token boundary inside the text
    toks = _alone(eng, ROMEO, 40).tokens
    cut = len(eng.decode(toks[:3]))
    stop = ref[cut - 1:cut + 2]
    assert len(stop) == 3 and stop in ref
    want = ref[:ref.index(stop)]
    r = client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="glm-jax-default", prompt=ROMEO, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed == want


def test_seeds(client):
    def gen(seed):
        return client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=24, temperature=0.9,
                                         top_p=0.95, seed=seed).choices[0].text
    a, b, c = gen(5), gen(5), gen(6)
    assert a == b and a != c


# ----------------------------------------------------------------------------- the OpenAI surface tools use
# small tools: the shipped model's context is 256 tokens and its vocabulary spells JSON out in short pieces
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Rome", "Verona"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Weather in Verona?"}]


def test_models_retrieve_and_404s(client):
    import openai

    m = client.models.retrieve("glm-jax-default")
    assert (m.id, m.object, m.owned_by) == ("glm-jax-default", "model", "glm-jax")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=ROMEO, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


@pytest.mark.parametrize("chat,kw,param", [
    (False, dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (True, dict(extra_body={"functions": [{"name": "f"}]}), "functions"),
    (True, dict(frequency_penalty=0.5), "frequency_penalty"),
    (False, dict(echo=True, logprobs=1), "echo"),
    (True, dict(tools=[dict(WEATHER, function=dict(WEATHER["function"], strict="yes"))]), "tools"),
    (False, dict(suffix="x"), "suffix"),
    (False, dict(best_of=3), "best_of"),
    (True, dict(response_format={"type": "xml"}), "response_format"),
    (True, dict(tool_choice="required"), "tool_choice"),
    (True, dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (True, dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    (True, dict(top_logprobs=3), "top_logprobs"),
    (True, dict(logit_bias={"99999": 5}), "logit_bias"),
    (True, dict(logit_bias={"5": 101}), "logit_bias"),
    (False, dict(extra_body={"response_format": {"type": "json_object"}}), "response_format"),
    (True, dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": [1]}}}), "response_format"),
    (True, dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "array", "maxItems": "x"}}}}}], tool_choice="required"), "tools"),
])
def test_unsupported_parameters_are_400_naming_them(client, chat, kw, param):
    """Before: tools, response_format, logit_bias and unknown fields were silently ignored (a 200 with plain text)."""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=2, **kw)
        else:
            client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=2, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_logit_bias(client, eng):
    ref = _alone(eng, ROMEO, 6)
    r = client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=6, temperature=0,
                                  logit_bias={str(ref.tokens[0]): -100})
    first = eng.encode(r.choices[0].text)[:1] if r.choices[0].text else []
    assert r.choices[0].text != ref.text and first != ref.tokens[:1]
    x = eng.encode(" the")[0]
    r = client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=5, temperature=0,
                                  logit_bias={str(x): 100})
    assert r.choices[0].text == eng.decode([x] * 5) and r.usage.completion_tokens == 5


def test_logprobs_are_the_engines_log_softmax(client, eng):
    """logprobs / top_logprobs: the log-softmax of the logits the sampler saw, equal (to float32 rounding) to a
    teacher-forced forward of the prompt and the generated tokens; greedy: the sampled token is the top one."""
    import numpy as np

    r = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    ch = r.choices[0]
    ents = ch.logprobs.content
    ids = eng.encode(USER, chat=True)
    out = eng.generate(USER, chat=True, max_new_tokens=8).tokens
    assert len(ents) == r.usage.completion_tokens == len(out)
    lg = np.asarray(eng.logits(ids + out[:-1]), np.float64)[len(ids) - 1:]
    lsm = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
    for k, (e, t) in enumerate(zip(ents, out)):
        assert e.token == eng.decode([t])
        assert abs(e.logprob - lsm[k, t]) < 2e-3, (k, e.logprob, lsm[k, t])
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        top = np.argsort(-lsm[k])[:3]
        assert [abs(a.logprob - lsm[k, j]) < 2e-3 for a, j in zip(e.top_logprobs, top)] == [True] * 3
    # completions: the legacy shape
    c = client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0
    # streamed: the same entries, chunk by chunk
    chunks = list(client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=8,
                                                 temperature=0, logprobs=True, stream=True))
    got = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert got == [e.logprob for e in ents]


def test_n_choices_with_seeds(client):
    """n=2: choice i is sampled with seed + i, so a request with that seed alone gives it again."""
    def gen(**kw):
        return client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=16, temperature=0.9,
                                         top_p=0.95, **kw)
    r = gen(n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text != r.choices[1].text
    assert [c.text for c in gen(n=2, seed=7).choices] == [c.text for c in r.choices]
    assert gen(seed=7).choices[0].text == r.choices[0].text and gen(seed=8).choices[0].text == r.choices[1].text
    assert r.usage.completion_tokens == 32
    chat = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=6, n=2, seed=3,
                                          temperature=1.0, stream=True)
    texts = ["", ""]
    for c in chat:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    ref = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=6, n=2, seed=3,
                                         temperature=1.0)
    assert texts == [c.message.content for c in ref.choices]


def test_tool_call_round_trip(client, eng):
    """tools rendered into the prompt (the shipped template does not render tools: a compact tools block goes into
    the system turn), tool_choice named / required enforced by constrained decoding, the GLM-format call parsed
    into tool_calls (streamed as deltas too), then the conversation sent back with the call and its result."""
    import json

    named = {"type": "function", "function": {"name": "weather"}}
    plain = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=1)
    r = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=100, temperature=0,
                                       tools=[WEATHER], tool_choice=named)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50          # the tools are in the prompt
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and args["city"] in ("Rome", "Verona") and isinstance(args["days"], int)
    assert 1 <= args["days"] <= 7
    # streamed: the same call as deltas
    deltas = [c.choices[0] for c in client.chat.completions.create(
        model="glm-jax-default", messages=USER, max_tokens=100, temperature=0, tools=[WEATHER], stream=True,
        tool_choice=named) if c.choices]
    tcs = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert (tcs[0].index, tcs[0].function.name, tcs[0].function.arguments, tcs[0].id[:5]) == (0, "weather", "", "call_")
    assert len(tcs) > 3 and {t.index for t in tcs} == {0} and all(t.function.name is None for t in tcs[1:])
    assert "".join(t.function.arguments for t in tcs) == call.function.arguments      # incremental pieces
    assert deltas[-1].finish_reason == "tool_calls" and not "".join(d.delta.content or "" for d in deltas)
    # required: any of the tools, one call (parallel_tool_calls false)
    for seed in (1, 2):
        r2 = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=80, temperature=1.0,
                                            seed=seed, tools=[CLOCK, PING], tool_choice="required",
                                            parallel_tool_calls=False)
        assert r2.choices[0].finish_reason == "tool_calls"
        (c2,) = r2.choices[0].message.tool_calls
        assert (c2.function.name, set(json.loads(c2.function.arguments))) in (("time", {"utc"}), ("ping", set()))
    # the round trip: the call and its result go back, the model answers (auto: whatever it writes is parsed)
    r3 = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=80, temperature=0,
                                        tools=[CLOCK], tool_choice="required")
    (c3,) = r3.choices[0].message.tool_calls
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [c3.model_dump()]},
                   {"role": "tool", "tool_call_id": c3.id, "content": '{"utc": "12:00"}'}]
    r4 = client.chat.completions.create(model="glm-jax-default", messages=msgs, max_tokens=8, temperature=0,
                                        tools=[CLOCK])
    assert r4.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r4.usage.prompt_tokens > r3.usage.prompt_tokens + r3.usage.completion_tokens - 5
    # auto, streamed: the text the model writes arrives as content, the same as not streamed
    kw = dict(model="glm-jax-default", messages=USER, max_tokens=12, temperature=0, tools=[CLOCK])
    whole = client.chat.completions.create(**kw).choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices) == whole
    # tool_choice none: tools shown, nothing parsed
    r5 = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=4, tools=[CLOCK],
                                        tool_choice="none")
    assert r5.choices[0].message.tool_calls is None


def test_glm_tool_calls_are_parsed():
    from glm_jax import chat as C
    from glm_jax.serve.toolcalls import parse

    text = ("Let me look.<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Verona</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>time\n"
            "<arg_key>utc</arg_key>\n<arg_value>true</arg_value>\n</tool_call>")
    content, calls, _ = parse(text, [WEATHER, CLOCK])
    assert content == "Let me look."
    assert [c["function"] for c in calls] == [{"name": "weather", "arguments": '{"city": "Verona", "days": 3}'},
                                              {"name": "time", "arguments": '{"utc": true}'}]
    assert parse("no calls here", [WEATHER]) == ("no calls here", [], False)
    # a string parameter stays a string even when it looks like JSON
    t = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"s": {"type": "string"}}}}}
    assert parse("<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>12</arg_value>\n</tool_call>",
                 [t])[1][0]["function"] == {"name": "f", "arguments": '{"s": "12"}'}
    assert C.format_tool_call("weather", {"city": "Verona", "days": 3}) in text


def test_response_format_json(client, eng):
    """response_format json_schema / json_object: the output is JSON valid against the schema (llguidance)."""
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "who": {"type": "string", "enum": ["ROMEO", "JULIET"]}},
              "required": ["ok", "n", "who"], "additionalProperties": False}
    for temp in (0, 1.0):
        r = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=60, temperature=temp,
                                           seed=2, response_format={"type": "json_schema", "json_schema": {
                                               "name": "answer", "schema": schema, "strict": True}})
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        v = json.loads(ch.message.content)
        assert set(v) == {"ok", "n", "who"} and isinstance(v["ok"], bool) and v["who"] in ("ROMEO", "JULIET")
        assert isinstance(v["n"], int) and 0 <= v["n"] <= 9
    # json_object: any object; the tiny model writes long keys, so within a small budget the text is a valid prefix
    import llguidance

    from glm_jax.serve.constrain import json_schema_grammar, ll_tokenizer

    r = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=30, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    m = llguidance.LLMatcher(ll_tokenizer(eng.tokenizer, eng.cfg.vocab_size, eng.cfg.eos_token_ids),
                             json_schema_grammar({"type": "object"}), log_level=0)
    assert m.consume_tokens(eng.encode(text)) and not m.is_error()
    m = llguidance.LLMatcher(ll_tokenizer(eng.tokenizer, eng.cfg.vocab_size, eng.cfg.eos_token_ids),
                             json_schema_grammar({"type": "object"}), log_level=0)
    assert not m.consume_tokens(eng.encode("Hello {")) or m.is_error()          # the check can fail


def test_required_calls_end_the_turn_and_markup_never_reaches_content(client):
    """tool_choice required with parallel calls allowed (what agent libraries send) ends the turn after its calls
    (before: the grammar allowed call after call, every try ran to length with '<tool_' in content); a call cut
    off by max_tokens ends with finish_reason length, no tool_calls and no markup."""
    import json

    for seed in (1, 2, 3):
        r = client.chat.completions.create(model="glm-jax-default", messages=USER, temperature=1.0, seed=seed,
                                           tools=[CLOCK, PING], tool_choice="required", max_tokens=120)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and not ch.message.content, ch
        assert 1 <= len(ch.message.tool_calls) <= 4
        for c in ch.message.tool_calls:
            assert c.function.name in ("time", "ping") and isinstance(json.loads(c.function.arguments), dict)
    named = {"type": "function", "function": {"name": "weather"}}
    for stream in (False, True):
        kw = dict(model="glm-jax-default", messages=USER, max_tokens=6, temperature=0, tools=[WEATHER],
                  tool_choice=named)
        if stream:
            chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
            text = "".join(c.delta.content or "" for c in chunks)
            reason = chunks[-1].finish_reason
        else:
            ch = client.chat.completions.create(**kw).choices[0]
            text, reason = ch.message.content or "", ch.finish_reason
            assert ch.message.tool_calls is None
        assert reason == "length" and "<" not in text and "arg_" not in text


def test_a_forced_tool_choice_beside_a_response_format_calls_the_tool(client):
    """An agent with tools and a structured output type sends both tool_choice required and a json_schema format
    (openai-agents does on its first turn): the turn is the call (before: a 400 naming response_format)."""
    import json

    rf = {"type": "json_schema", "json_schema": {"name": "ok", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    r = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=60, temperature=0,
                                       tools=[CLOCK], tool_choice="required", response_format=rf)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    (call,) = ch.message.tool_calls
    assert call.function.name == "time" and isinstance(json.loads(call.function.arguments)["utc"], bool)


def test_tool_choice_auto_beside_a_response_format_can_still_call(client):
    """tools (auto) and a json_schema format, as an agent with a structured output type sends them: the reply is a
    call or the JSON (before: the JSON grammar alone, a call could never start).  A bias toward "<" (the
    call's first token in the shipped vocabulary) takes the call branch; without it, the greedy reply is JSON."""
    import json

    rf = {"type": "json_schema", "json_schema": {"name": "ok", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    kw = dict(model="glm-jax-default", messages=USER, max_tokens=60, temperature=0, tools=[CLOCK],
              response_format=rf)
    ch = client.chat.completions.create(logit_bias={"33": 100}, **kw).choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content, ch
    assert [c.function.name for c in ch.message.tool_calls][0] == "time"
    ch = client.chat.completions.create(**kw).choices[0]
    assert ch.message.tool_calls or isinstance(json.loads(ch.message.content)["ok"], bool)


def test_pydantic_style_schemas_and_json_object_close(client):
    """Structured output with a schema as pydantic writes it (no additionalProperties) and json_object: JSON that
    parses, within max_tokens (before: an extra key whose string never ended; 0 of 5 json_object replies parsed)."""
    import json

    person = {"type": "object", "title": "Person", "properties": {"name": {"type": "string"},
                                                                  "age": {"type": "integer"}},
              "required": ["name", "age"]}
    for seed in (1, 2):
        for rf in ({"type": "json_schema", "json_schema": {"name": "Person", "schema": person}},
                   {"type": "json_object"}):
            r = client.chat.completions.create(model="glm-jax-default", messages=USER, max_tokens=40, seed=seed,
                                               temperature=1.0, response_format=rf)
            ch = r.choices[0]
            assert ch.finish_reason == "stop", ch
            v = json.loads(ch.message.content)
            assert isinstance(v, dict)
            if rf["type"] == "json_schema":
                assert set(v) == {"name", "age"} and isinstance(v["name"], str) and isinstance(v["age"], int)


def test_one_log_line_per_request(client, caplog):
    with caplog.at_level("INFO", logger="glm_jax.server"):
        r = client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=5, temperature=0)
    lines = [x.getMessage() for x in caplog.records if r.id in x.getMessage()]
    assert len(lines) == 1, lines
    cached = r.usage.prompt_tokens_details.cached_tokens       # the prefix cache may hold this prompt already
    for part in ("completions status=200", "prompt_tokens=", f"cached_tokens={cached}", "generated_tokens=5",
                 "ttft_ms=", "tok_s=", "finish_reason=length"):
        assert part in lines[0], lines[0]


# ----------------------------------------------------------------------------- raw HTTP: every error case
def _post(server, path, body, key=KEY, raw=None):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(server.base + path, content=raw, headers=h, timeout=60)
    return httpx.post(server.base + path, json=body, headers=h, timeout=60)


@pytest.mark.parametrize("path,body,raw,status,param,text", [
    ("/v1/completions", None, b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", None, b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, None, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, None, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, None, 400, "max_tokens", "out of range"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature", "out of range"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "top_p", "out of range"),
    ("/v1/completions", {"prompt": "x", "top_k": 10 ** 6}, None, 400, "top_k", "out of range"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, None, 400, "seed", "integer"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, None, 400, "stop", "strings"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400, "stream", "boolean"),
    ("/v1/completions", {"prompt": "x", "n": 17}, None, 400, "n", "out of range"),
    ("/v1/completions", {"prompt": 5}, None, 400, "prompt", "string or a list of token ids"),
    ("/v1/completions", {"prompt": [1, 99999]}, None, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": "ROMEO " * 300}, None, 400, "prompt", "context limit is 256 tokens"),
    ("/v1/chat/completions", {}, None, 400, "messages", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages", "list"),
])
def test_errors_are_openai_style(server, path, body, raw, status, param, text):
    r = _post(server, path, body, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"
    assert "\n" not in err["message"]


def test_health_answers_503_loading_during_the_warm_up(eng):
    """The server listens before its warm-up (before: nothing answered during a first start's warm-up); /health
    says 503 {"status": "loading"} and generation requests are 503s until the engine thread has warmed up."""
    import threading
    import types

    from glm_jax.serve.app import Server

    srv = Server(eng, max_queue=16, warmup=True)
    go, stop = threading.Event(), threading.Event()

    def serve_forever(ev):
        stop.wait(30)
    srv.sched = types.SimpleNamespace(warmup=lambda: (go.wait(30), (0.0, 0.0))[1], serve_forever=serve_forever,
                                      running=0, waiting=0, lock=threading.Condition(), queue=[], rows=[])
    with serving.running(srv):
        h = httpx.get(srv.base + "/health")
        assert (h.status_code, h.json()) == (503, {"status": "loading"})
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        r = httpx.post(srv.base + "/v1/responses", json={"input": "x"})
        assert r.status_code == 503
        go.set()
        for _ in range(100):
            if httpx.get(srv.base + "/health").status_code == 200:
                break
            time.sleep(0.05)
        assert httpx.get(srv.base + "/health").json()["status"] == "ok"
        stop.set()


def test_auth_queue_full_and_metrics(server, eng, monkeypatch):
    r = _post(server, "/v1/completions", {"prompt": "x"}, key="")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _post(server, "/v1/completions", {"prompt": "x"}, key="wrong").status_code == 401
    assert httpx.get(server.base + "/health").json()["status"] == "ok"          # no key needed
    assert httpx.get(server.base + "/metrics").status_code == 401
    # a full queue -> 429 (the scheduler's own refusal, tested below, mapped to HTTP)
    sched = eng.scheduler

    def full(req):
        raise SCH.QueueFull("the queue is full (16 requests waiting; --max_queue)")
    monkeypatch.setattr(sched, "submit", full)
    r = _post(server, "/v1/completions", {"prompt": "x"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    monkeypatch.undo()
    m = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("glmjax_requests_total", "glmjax_generated_tokens_total", "glmjax_queue_depth",
                 "glmjax_running_requests", "glmjax_time_to_first_token_seconds_bucket",
                 "glmjax_generated_tokens_per_second", "glmjax_expert_hit_rate", "glmjax_mtp_acceptance"):
        assert name in m
    assert 'glmjax_requests_total{endpoint="completions",status="429"} 1.0' in m


def test_scheduler_queue_limit(eng):
    s = SCH.Scheduler(eng, max_batch=1, max_queue=1)
    s.submit(Request([1, 2], Sampling(max_new_tokens=1)))
    with pytest.raises(SCH.QueueFull, match="max_queue"):
        s.submit(Request([1, 2], Sampling(max_new_tokens=1)))


def test_disconnect_frees_the_row(server, eng, monkeypatch):
    sched = eng.scheduler
    slow = sched._decode

    def decode(dec, n):          # slow the engine down so that the request cannot finish before the client leaves
        time.sleep(0.2)
        return slow(dec, n)
    monkeypatch.setattr(sched, "_decode", decode)
    before = sched.counters["finished_cancelled"]
    with httpx.stream("POST", server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": ROMEO, "max_tokens": 240, "temperature": 0, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
        assert sched.running == 1
    t0 = time.time()
    while sched.counters["finished_cancelled"] == before and time.time() - t0 < 20:
        time.sleep(0.05)
    assert sched.counters["finished_cancelled"] == before + 1
    assert sched.running == 0 and sched.waiting == 0


# ----------------------------------------------------------------------------- the scheduler
def test_batch_invariance_of_greedy_output(eng):
    """A request's greedy tokens (and a seeded sample's) are the same alone and beside others: other rows of other
    lengths (a long one widens the attention window), chunked prefills interleaved with decode, admitted at another
    time and row."""
    heldout = open(glm_jax.default_model_path() + "/heldout.txt").read()
    long_ids = eng.encode(heldout[:4000])[:150]              # 10 prefill chunks of 16
    a, b = "JULIET:\n", "To be, or not"
    alone = [_alone(eng, p, 30).tokens for p in (ROMEO, a, b)]
    alone_long = eng.generate(long_ids, max_new_tokens=30).tokens
    alone_sampled = _alone(eng, ROMEO, 30, temperature=0.8, seed=3).tokens
    sched = eng.scheduler
    reqs = [eng.request(long_ids, max_new_tokens=30), eng.request(b, max_new_tokens=30),
            eng.request(ROMEO, max_new_tokens=30, temperature=0.8, seed=3), eng.request(a, max_new_tokens=30)]
    late = eng.request(ROMEO, max_new_tokens=30)
    with sched.step_lock:            # the module's server thread, once started, steps too: it waits meanwhile
        for r in reqs:
            sched.submit(r)
        for _ in range(3):
            sched._step()
        assert sched.running == 4
        sched.submit(late)                                     # waits for a free row, then joins the others
    sched.run(reqs + [late])
    assert reqs[0].out == alone_long
    assert reqs[1].out == alone[2] and reqs[3].out == alone[1] and late.out == alone[0]
    assert reqs[2].out == alone_sampled        # a seeded sample beside greedy rows: its keys advance as alone
    assert len({r.row for r in reqs}) == 4                     # four rows: not all where they ran alone


def test_a_processor_row_beside_plain_rows(eng):
    """A row with a host-side processor (logit_bias here) is sampled on the host path; the rows beside it stay on the
    fused path with the same greedy tokens as alone, and the processor row follows its bias."""
    from glm_jax.serve.constrain import Processor

    x = eng.encode(" the")[0]
    alone = [_alone(eng, p, 12).tokens for p in ("JULIET:\n", "To be, or not")]
    sched = eng.scheduler
    a = eng.request(ROMEO, max_new_tokens=12)
    a.processor = Processor(eng.cfg.vocab_size, bias={x: 100.0}, top_logprobs=2)
    others = [eng.request("JULIET:\n", max_new_tokens=12), eng.request("To be, or not", max_new_tokens=12)]
    for r in [others[0], a, others[1]]:
        sched.submit(r)
    sched.run([a] + others)
    assert a.out == [x] * 12 and len(a.processor.logprobs) == 12
    assert [r.out for r in others] == alone


def test_a_dispatch_runs_what_fits_in_dispatch_ms(eng, monkeypatch):
    """Resident decode runs several steps per compiled dispatch; tokens reach the stream (and a cancel lands) only
    between dispatches, so a dispatch runs what fits in --dispatch_ms at the measured step time: on a model whose
    step takes 20 ms, 2 steps of 50 ms, not 32 (a client would see 640 ms bursts, a disconnect would hold its row
    as long).  Same greedy tokens as one long dispatch."""
    ref = _alone(eng, ROMEO, 24)
    sched = eng.scheduler
    assert sched.dispatch_s == 0.05 and SCH.FUSED_CHUNK == 32
    monkeypatch.setattr(sched, "step_s", 0.02)                 # as if each decode step took 20 ms ...
    monkeypatch.setattr(sched, "observe_step", lambda s: None)  # ... and kept taking it
    monkeypatch.setattr(sched, "stream_interval", 0)           # tokens only between dispatches (--stream_interval=0)
    sizes = []
    req = eng.request(ROMEO, max_new_tokens=24, on_event=lambda r, text, toks, done: sizes.append(len(toks)))
    sched.submit(req)
    sched.run([req])
    assert req.out == ref.tokens
    assert max(sizes) == 2 and sum(sizes) == len(ref.tokens) == 24
    assert sched.steps_per_dispatch() == 2
    monkeypatch.setattr(sched, "step_s", 0.0001)
    assert sched.steps_per_dispatch() == SCH.FUSED_CHUNK
    monkeypatch.setattr(sched, "dispatch_s", 0.0)
    assert sched.steps_per_dispatch() == 1


def test_context_limit(eng):
    limit = eng.context_limit
    assert limit == eng.cfg.max_position_embeddings == 256
    with pytest.raises(SCH.ContextLengthError, match="prompt is 256 tokens but the context limit is 256 tokens"):
        eng.generate([7] * 256, max_new_tokens=4)
    r = eng.generate([7] * 250, max_new_tokens=20, stop_on_eos=False)
    assert len(r.tokens) == 6 and r.finish_reason == "length"


def test_text_stream_is_utf8_safe_and_holds_stop_prefixes(eng):
    tok = eng.tokenizer
    text = "O Romeo — é ü"
    ids = tok.encode(text)
    pieces = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)                # a character split over tokens
    ts = TextStream(eng.decode)
    out = []
    for t in ids:
        ts.add([t])
        out.append(ts.delta())
    out.append(ts.delta(final=True))
    assert "".join(out) == tok.decode(ids) and not any("\ufffd" in p for p in out)
    ts = TextStream(eng.decode, stop=("meo —",))
    got = ""
    for t in ids:
        n = ts.add([t])
        got += ts.delta()
        assert "meo" not in got
        if ts.stopped:
            break
    assert ts.stopped and n == 1 and got + ts.delta(final=True) == "O Ro"


def test_engine_stream_and_cancel(eng):
    ref = _alone(eng, ROMEO, 24)
    st = eng.stream(ROMEO, max_new_tokens=24)
    assert "".join(st) == ref.text and st.result.tokens == ref.tokens
    st = eng.stream(ROMEO, max_new_tokens=200)
    for _ in st:
        break
    st = None
    import gc

    gc.collect()
    assert eng.scheduler.running == 0


def test_cli_streams_and_ctrl_c(monkeypatch, capsys):
    from glm_jax import cli

    cli.FLAGS.unparse_flags()
    cli.parse_flags(["glm-jax", "--max_new_tokens=200", "--ignore_eos"])
    calls = [0]
    real = SCH.Scheduler.step

    def step(self):
        calls[0] += 1
        if calls[0] == 6:      # admit + prefill, 2 one-step dispatches (timing the step), then dispatches of many
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(SCH.Scheduler, "step", step)
    closed = []
    real_close = glm_jax.Engine.close
    monkeypatch.setattr(glm_jax.Engine, "close", lambda self: (closed.append(1), real_close(self)))
    try:
        assert cli.main(["glm-jax"]) == 130
    finally:
        cli.FLAGS.unparse_flags()
    out, err = capsys.readouterr()
    assert out.startswith(ROMEO) and len(out) > len(ROMEO) + 20          # what was generated before Ctrl-C stays
    assert "interrupted" in err and "decode" in err and "Traceback" not in err
    assert closed


def test_cli_interactive_chat_and_stdin_prompt(monkeypatch, capsys, eng):
    """glm-jax --chat without --prompt: a chat session (history kept, /exit ends it); Ctrl-C mid-reply stops that
    reply and the next turn runs as on a fresh engine; --prompt=- reads the prompt from stdin."""
    import io

    from glm_jax import cli

    lines = iter(["Who are you?", "And then?", "/exit"])
    monkeypatch.setattr(cli, "_read_line", lambda p: next(lines))
    shown, real_emit = [], cli._emit

    def emit(text):
        shown.append(text)
        if len(shown) == 1:                          # the first piece of the first reply
            raise KeyboardInterrupt
        return real_emit(text)
    monkeypatch.setattr(cli, "_emit", emit)
    cli.FLAGS.unparse_flags()
    cli.parse_flags(["glm-jax", "--chat", "--max_new_tokens=6"])
    try:
        assert cli.main(["glm-jax"]) == 0
    finally:
        cli.FLAGS.unparse_flags()
    out, err = capsys.readouterr()
    first, second = out.split("\n")[:2]
    assert first.endswith(" [stopped]") and "Traceback" not in err
    history = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": first[:-10]},
               {"role": "user", "content": "And then?"}]
    assert second == eng.generate(history, chat=True, max_new_tokens=6).text
    monkeypatch.setattr("sys.stdin", io.StringIO("JULIET:\n"))
    cli.parse_flags(["glm-jax", "--prompt=-", "--max_new_tokens=3"])
    try:
        assert cli.main(["glm-jax"]) == 0
    finally:
        cli.FLAGS.unparse_flags()
    out, _ = capsys.readouterr()
    assert out == "JULIET:\n" + eng.generate("JULIET:\n", max_new_tokens=3).text + "\n"


def test_sigterm_drains_in_flight_requests_and_exits_0():
    """glm-jax-serve as a process: SIGTERM mid-stream lets the stream finish (finish_reason, [DONE]) and the process
    exits 0.  Before, sse-starlette cut the open stream at shutdown and uvicorn re-raised the signal (exit -15)."""
    import http.client
    import json
    import re
    import signal
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.argv[0] = 'glm-jax-serve'; "
                          "from glm_jax.serve.app import run; run()", "--port=0", "--max_batch=2", "--nowarmup"],
                         stderr=subprocess.PIPE, text=True)
    try:
        port = None
        while port is None:
            line = p.stderr.readline()
            assert line, "the server exited before serving"
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(m.group(1)) if m else None
        for _ in range(300):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/completions", json.dumps({"prompt": ROMEO, "max_tokens": 200, "stream": True}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        line = r.readline()
        while line.startswith(b": ping"):         # sse-starlette's keep-alive, every 15 s (a loaded machine compiling)
            line = r.readline()
        assert line.startswith(b"data: ")
        p.send_signal(signal.SIGTERM)
        rest = r.read().decode()
        assert '"finish_reason": "length"' in rest and rest.rstrip().endswith("data: [DONE]")
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()


# ----------------------------------------------------------------------------- the Responses API
WEATHER_R = dict(WEATHER["function"], type="function")          # the Responses API's flat function tools


def test_responses_api_text_tools_and_json(client, eng):
    """POST /v1/responses through the official client: text (greedy: the chat path's text), a forced tool call
    as a function_call item, its output sent back as items, a json_schema text format, and the 400s."""
    import json

    import openai

    r = client.responses.create(model="glm-jax-default", input="Weather in Verona?", instructions="Speak verse.",
                                max_output_tokens=8, temperature=0)
    ref = client.chat.completions.create(model="glm-jax-default", max_tokens=8, temperature=0, messages=[
        {"role": "developer", "content": "Speak verse."}, {"role": "user", "content": "Weather in Verona?"}])
    assert r.output_text == ref.choices[0].message.content and r.status == "incomplete"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens == ref.usage.prompt_tokens
    r = client.responses.create(model="glm-jax-default", input=USER, tools=[WEATHER_R], max_output_tokens=100,
                                tool_choice={"type": "function", "name": "weather"}, temperature=0)
    (call,) = r.output
    assert (call.type, call.name, r.status) == ("function_call", "weather", "completed")
    assert set(json.loads(call.arguments)) == {"city", "days"}
    clock = dict(CLOCK["function"], type="function")
    r = client.responses.create(model="glm-jax-default", input=USER, tools=[clock], tool_choice="required",
                                max_output_tokens=60, temperature=0)
    (call,) = r.output
    back = USER + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                   {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    r2 = client.responses.create(model="glm-jax-default", input=back, tools=[clock], max_output_tokens=4)
    assert r2.usage.input_tokens > r.usage.input_tokens and r2.status in ("completed", "incomplete")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r3 = client.responses.create(model="glm-jax-default", input="Yes?", max_output_tokens=20, text={"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert isinstance(json.loads(r3.output_text)["ok"], bool)
    for kw, param in ((dict(store=True), "store"), (dict(previous_response_id="resp_1"), "previous_response_id"),
                      (dict(extra_body={"frobnicate": 1}), "frobnicate")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="glm-jax-default", input="Hi", max_output_tokens=2, **kw)
        assert e.value.body["param"] == param


def test_responses_api_streams_its_events(client):
    import json

    kw = dict(model="glm-jax-default", input=USER, tools=[WEATHER_R], max_output_tokens=100, temperature=0,
              tool_choice={"type": "function", "name": "weather"})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and "".join(deltas) == whole.output[0].arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output[0].arguments == whole.output[0].arguments and json.loads(done.output[0].arguments)
    text = list(client.responses.create(model="glm-jax-default", input="Hi", max_output_tokens=6, temperature=0,
                                        stream=True))
    pieces = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    assert text[-1].type == "response.incomplete" and pieces == text[-1].response.output_text


def test_completions_with_prompt_lists_and_echo(client, eng):
    r = client.completions.create(model="glm-jax-default", prompt=[ROMEO, "JULIET:\n"], max_tokens=4, temperature=0,
                                  echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, [ROMEO, "JULIET:\n"]):
        assert c.text == p + _alone(eng, p, 4).text
    assert r.usage.prompt_tokens == len(eng.encode(ROMEO)) + len(eng.encode("JULIET:\n"))
    texts = ["", ""]
    for c in client.completions.create(model="glm-jax-default", prompt=[ROMEO, "JULIET:\n"], max_tokens=4,
                                       temperature=0, echo=True, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in r.choices]

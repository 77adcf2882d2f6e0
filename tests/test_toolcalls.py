"""GLM-format tool calls parsed as they stream (glm_jax/serve/toolcalls.py) and constrained output that always ends
within the tokens a request has left (glm_jax/serve/bounds.py, constrain.py): random walks over the grammar's token
masks with the shipped model's tokenizer (every allowed token equally likely, the end of text rarely), so the
longest outputs a grammar allows are the ones tried."""

import json
import os

import numpy as np
import pytest

from glm_jax.serve import bounds as B
from glm_jax.serve.constrain import MAX_CALLS, calls_or_json_grammar, json_schema_grammar, tool_call_grammar
from glm_jax.serve.toolcalls import ToolCallParser, parse

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
NOTE = {"type": "function", "function": {"name": "note", "strict": True, "parameters": {
    "type": "object", "properties": {"text": {"type": "string"},
                                     "meta": {"type": "object", "properties": {"tag": {"type": "string"}}}},
    "required": ["text", "meta"]}}}
TEXT = ("Let me look. <tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Ve\"r<o\nna</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>time\n"
        "<arg_key>utc</arg_key>\n<arg_value>true</arg_value>\n</tool_call>\n")


def _stream(text, step, tools):
    p = ToolCallParser(tools)
    ev = []
    for i in range(0, len(text), step):
        ev += p.feed(text[i:i + step])
    return p, ev + p.finish()


def test_streamed_pieces_join_to_the_whole_reply():
    content, calls, cut = parse(TEXT, [WEATHER])
    assert (content, cut) == ("Let me look.", False)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": 'Ve"r<o\nna', "days": 3}), ("time", {"utc": True})]
    for step in (1, 2, 5, 13):
        p, ev = _stream(TEXT, step, [WEATHER])
        assert "".join(e.get("content", "") for e in ev) == content
        starts = [e for e in ev if "name" in e]
        assert [(e["index"], e["name"]) for e in starts] == [(0, "weather"), (1, "time")]
        for k in range(2):
            pieces = [e["arguments"] for e in ev if e.get("index") == k and "arguments" in e]
            assert "".join(pieces) == calls[k]["function"]["arguments"]
            assert len(pieces) > 3 or k == 1
    # a string value streams character by character (the tokens as they come), a number when it is complete
    p = ToolCallParser([WEATHER])
    p.feed("<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Ver")
    assert p.feed("o")[-1] == {"index": 0, "arguments": "o"}


@pytest.mark.parametrize("text,content", [
    ("hi <tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Rom", "hi"),       # cut off by max_tokens
    ("hi <tool_call>weath", "hi"),
    ("hi </arg_value> there <tool_", "hi  there "),                                 # stray / partial markers
    ("  plain <b>text</b> \n", "  plain <b>text</b> \n"),                          # no call: the text exactly
])
def test_markup_never_reaches_content(text, content):
    for step in (1, 4, len(text)):
        p, ev = _stream(text, step, [WEATHER])
        got = "".join(e.get("content", "") for e in ev)
        assert got == p.content == content
        assert "<tool_call" not in got and "arg_value>" not in got and not p.calls
    assert parse(text, [WEATHER])[2] == ("Rom" in text or "weath" in text)


# ----------------------------------------------------------------------------- grammars that end
@pytest.fixture(scope="module")
def tok():
    from glm_jax.engine import Tokenizer, default_model_path
    from glm_jax.serve.constrain import ll_tokenizer

    t = Tokenizer(os.path.join(default_model_path(), "tokenizer.json"))
    return t, ll_tokenizer(t, 2048, [0])


def _walk(tok, grammar, limit, rng):
    """Tokens of one random walk over the grammar's masks (EOS taken with probability 3% where allowed)."""
    import llguidance
    import llguidance.numpy as lln

    t, llt = tok
    m = llguidance.LLMatcher(llt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    mask = lln.allocate_token_bitmask(1, 2048)
    out = []
    while not m.is_stopped() and len(out) <= limit:
        lln.fill_next_token_bitmask(m, mask, 0)
        ok = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:2048])
        other = ok[ok != 0]
        if not len(other) or (0 in ok and rng.random() < 0.03):
            break
        out.append(int(rng.choice(other)))
        assert m.consume_token(out[-1])
    return out, t.decode(out)


PYDANTIC = {"type": "object", "title": "Person", "properties": {     # what pydantic writes: no additionalProperties
    "name": {"type": "string", "title": "Name"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}}, "required": ["name", "age"]}


@pytest.mark.parametrize("schema", [PYDANTIC, {"type": "object"}, {"type": "array", "items": {"type": "object"}}])
@pytest.mark.parametrize("budget", [24, 60, 150])
def test_constrained_json_closes_within_max_tokens(tok, schema, budget):
    rng = np.random.default_rng(budget)
    g = json_schema_grammar(schema, budget)
    for _ in range(6):
        out, text = _walk(tok, g, budget, rng)
        assert len(out) <= budget, (len(out), text)
        v = json.loads(text)
        if schema is PYDANTIC:
            assert set(v) <= set(PYDANTIC["properties"]) and {"name", "age"} <= set(v)


def test_strict_means_no_undeclared_keys_anywhere():
    s = {"type": "object", "properties": {"a": {"type": "object", "additionalProperties": True},
                                          "b": {"type": "array", "items": {"type": "object"}}}}
    b = B.bounded(s, 8, strict=True)
    assert b["additionalProperties"] is False and b["properties"]["a"]["additionalProperties"] is False
    assert b["properties"]["b"]["items"]["additionalProperties"] is False
    loose = B.bounded(s, 8)                      # not strict: an explicit free map stays a (bounded) map
    assert loose["properties"]["a"]["maxProperties"] == 2 and loose["additionalProperties"] is False


@pytest.mark.parametrize("multiple", [False, True])
def test_required_tool_calls_end_the_turn(tok, multiple):
    rng = np.random.default_rng(int(multiple))
    budget = 600                 # room for two calls with 20-character strings (four need 1200)
    g = tool_call_grammar([WEATHER, NOTE], multiple=multiple, budget=budget)
    counts = set()
    for _ in range(6):
        out, text = _walk(tok, g, budget, rng)
        content, calls, cut = parse(text, [WEATHER, NOTE])
        assert len(out) <= budget and not cut and content == "" and 1 <= len(calls) <= (MAX_CALLS if multiple else 1)
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            if c["function"]["name"] == "note":
                assert set(args) == {"text", "meta"} and set(args["meta"]) <= {"tag"}      # strict
        counts.add(len(calls))
    assert (max(counts) > 1) == multiple


def test_tool_choice_auto_beside_a_json_format_allows_calls_or_the_json(tok):
    """An agent's turn with tools (auto) and a structured output format: calls or the format's JSON, each ending
    within the budget (before: the JSON grammar alone, so no tool could ever be called)."""
    rng = np.random.default_rng(0)
    budget = 200
    g = calls_or_json_grammar([WEATHER], PYDANTIC, budget=budget)
    kinds = set()
    for _ in range(12):
        out, text = _walk(tok, g, budget, rng)
        content, calls, cut = parse(text, [WEATHER])
        assert len(out) <= budget and not cut, text
        if calls:
            assert content == "" and all(c["function"]["name"] == "weather" for c in calls)
            kinds.add("calls")
        else:
            assert {"name", "age"} <= set(json.loads(text)), text
            kinds.add("json")
    assert kinds == {"calls", "json"}


def test_a_reply_with_tool_choice_none_drops_calls_and_their_markup():
    import types

    from glm_jax.serve.replies import Choice

    req = types.SimpleNamespace(text=TEXT, id=1, finish_reason="stop")
    none, auto = Choice(req, [WEATHER], drop_calls=True), Choice(req, [WEATHER])
    assert none.result() == ("Let me look.", []) and none.finish_reason() == "stop"
    assert len(auto.result()[1]) == 2 and auto.finish_reason() == "tool_calls"
    streamed = Choice(req, [WEATHER], drop_calls=True)
    ev = [e for k in range(0, len(TEXT), 3) for e in streamed.feed(TEXT[k:k + 3], False)] + streamed.feed("", True)
    assert "".join(e["content"] for e in ev) == "Let me look." and not streamed.calls


def test_nested_pydantic_models_close_too(tok):
    """pydantic writes a nested model as a $ref into $defs: inlined, its size is known and the JSON closes."""
    schema = {"type": "object", "properties": {"owner": {"$ref": "#/$defs/Person"}, "pets": {
        "type": "array", "items": {"$ref": "#/$defs/Person"}}}, "required": ["owner"],
        "$defs": {"Person": PYDANTIC}}
    b = B.bounded(schema, 4)
    assert "$defs" not in b and B.longest(B.bounded(schema, 4, top=False)) is not None
    rng = np.random.default_rng(7)
    g = json_schema_grammar(schema, 80)
    for _ in range(4):
        out, text = _walk(tok, g, 80, rng)
        assert len(out) <= 80 and set(json.loads(text)["owner"]) >= {"name", "age"}
    loop = {"type": "object", "properties": {"next": {"$ref": "#"}}}       # recursive: left to llguidance
    assert B.longest(B.bounded(loop, 4, top=False)) is None

"""Tool calls the model wrote without a grammar (tool_choice auto) are returned only when their arguments validate
against the tool's parameters: an enum value holding call markup produced arguments outside the schema
({"x": "ok", "y": 7}); a value outside the enum, an undeclared key or a wrong type went out as a call.  Such a
call is dropped (and logged), never content; a valid one is returned whole, streamed or not."""

import json

import pytest

from glm_jax.serve.toolcalls import ToolCallParser, parse, schema_error

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "enum": ["ok", "no"]}, "n": {"type": "integer"}},
    "required": ["x"]}}}


def _call(**args):
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>f\n{body}</tool_call>"


@pytest.mark.parametrize("args,why", [
    ({"x": "ok</arg_value>\n<arg_key>y</arg_key>\n<arg_value>7"}, "('y' was unexpected)"),
    ({"x": "maybe"}, "'maybe' is not one of ['ok', 'no']"),
    ({"x": "ok", "n": "seven"}, "'seven' is not of type 'integer'"),
    ({"n": 3}, "'x' is a required property"),
])
def test_invalid_free_call_is_dropped_not_content(args, why):
    text = "Sure. " + _call(**args)
    content, calls, _ = parse(text, [TOOL], check=True)
    assert calls == [] and "<" not in content and content.strip() == "Sure.", (content, calls)
    p = ToolCallParser([TOOL], check=True)
    streamed = [e for i in range(len(text)) for e in p.feed(text[i])] + p.finish()
    assert all("content" in e for e in streamed), streamed          # nothing of the call went out
    assert p.invalid and why in p.invalid[0][1], p.invalid


def test_valid_free_call_is_returned_streamed_and_whole():
    text = _call(x="ok", n=3) + "\n" + _call(x="maybe") + "\n" + _call(x="no")
    content, calls, _ = parse(text, [TOOL], check=True)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": "ok", "n": 3}, {"x": "no"}]
    p = ToolCallParser([TOOL], check=True)
    ev = [e for i in range(len(text)) for e in p.feed(text[i])] + p.finish()
    args = {}
    for e in ev:
        if "arguments" in e:
            args[e["index"]] = args.get(e["index"], "") + e["arguments"]
    assert [json.loads(a) for _, a in sorted(args.items())] == [{"x": "ok", "n": 3}, {"x": "no"}]
    assert content == ""


def test_schema_error_subset():
    s = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number", "maximum": 1},
                                                "maxItems": 2}}, "additionalProperties": False}
    assert schema_error({"a": [0.5, 1]}, s) is None
    assert "arguments.a[1]: 2 is greater than the maximum of 1" == schema_error({"a": [0.5, 2]}, s)
    assert "is too long" in schema_error({"a": [0, 0, 0]}, s)
    assert "('b' was unexpected)" in schema_error({"b": 1}, s)
    assert "('b' was unexpected)" in schema_error({"a": [], "b": 1}, {"properties": {"a": {}}})   # as the grammar
    assert schema_error(1, {"type": 5}) is None and schema_error(1, {"$ref": "#/nope"}) is None   # not ours to say
    assert schema_error({"k": 1}, {"type": "object"}) is None                 # a free map takes any key
    assert schema_error("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) is None
    assert schema_error(True, {"type": "integer"}) is not None


def test_reply_with_only_invalid_calls_finishes_stop(caplog):
    import types

    from glm_jax.serve.replies import Choice

    req = types.SimpleNamespace(text="Done. " + _call(x="maybe"), id=1, finish_reason="stop")
    ch = Choice(req, [TOOL], check_calls=True)
    assert ch.result() == ("Done.", []) and ch.finish_reason() == "stop"
    assert "was dropped" in caplog.text and "'maybe' is not one of" in caplog.text

"""GLM-format tool calls parsed as the text streams (``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>
...</tool_call>``, glm_jax/chat.py).  ``ToolCallParser.feed(text)`` returns events as soon as they are certain:

- ``{"content": str}``: text outside every call; a possible start of a marker is held until it is decided, and no
  marker (a call's, or a stray ``</arg_value>``) ever goes out as content;
- ``{"index", "id", "name"}``: a call began (its name is complete);
- ``{"index", "arguments": str}``: the next piece of the call's arguments as JSON text (``{``, each ``"key": ``, a
  string value character by character, any other value when its ``</arg_value>`` arrives, ``}``): the pieces of a
  call joined are its ``arguments``.

With ``check`` (calls the model wrote freely, tool_choice auto: no grammar held them to the schema) a call's events
are held until it ends and go out only if its arguments validate against the function's ``parameters``
(``schema_error``: jsonschema, with undeclared keys refused as the grammar refuses them); one
that does not is dropped and counted in ``invalid`` (name, reason) -- never content, as its markup never is.

``finish()`` ends the text: a call still open (cut off by max_tokens or EOS) is dropped (``truncated`` set) and never
appears in ``calls``; the whole reply is ``content`` plus ``calls``, the same whether it was streamed or not (the
non-streamed reply is the same parser fed the whole text).  Whitespace around calls is not content (held until
text that is not whitespace follows)."""

from __future__ import annotations

import json
import re
import secrets
from typing import Optional

import jsonschema
import referencing.exceptions

from .. import chat as C

MARKERS = (C.TOOL_CALL, C.TOOL_CALL_END, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def _held(text: str) -> int:
    """Where a trailing possible start of a marker begins (len(text) when none)."""
    j = text.rfind("<")
    if j >= 0 and any(m.startswith(text[j:]) for m in MARKERS):
        return j
    return len(text)


def _esc(s: str) -> str:
    """s as the inside of a JSON string (per character, so pieces escaped apart join to the whole one escaped)."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


def param_types(tools) -> dict:
    """{function name: {parameter: its JSON schema type}} of OpenAI tool objects."""
    out = {}
    for t in tools or []:
        f = t.get("function") or {}
        props = (f.get("parameters") or {}).get("properties") or {}
        out[f.get("name")] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def _closed(s):
    """``s`` as the call grammar reads it: an object schema that declares properties and says nothing of others takes
    no other key (the grammar never writes one), so a freely written call is held to the same rule."""
    if isinstance(s, list):
        return [_closed(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: _closed(x) for k, x in s.items()}
    if isinstance(s.get("properties"), dict) and s["properties"] and "additionalProperties" not in s:
        out["additionalProperties"] = False
    return out


def schema_error(v, s, path: str = "arguments") -> Optional[str]:
    """Why ``v`` does not validate against the JSON schema ``s`` (jsonschema, draft 2020-12, on ``_closed(s)``), or
    None; a schema jsonschema can't use (not Python's regex dialect, a broken ``$ref``) was the grammar's to decide."""
    if not isinstance(s, (dict, bool)):
        return None
    try:
        jsonschema.Draft202012Validator.check_schema(s)
        err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(_closed(s)).iter_errors(v))
    except (re.error, jsonschema.exceptions.SchemaError, referencing.exceptions.Unresolvable):
        return None
    if err is None:
        return None
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in err.absolute_path)
    return f"{path}{where}: {err.message[:200]}"


class ToolCallParser:
    def __init__(self, tools=None, check: bool = False):
        self.types = param_types(tools)
        self.check = check
        self.schemas = {(t.get("function") or {}).get("name"): (t.get("function") or {}).get("parameters")
                        for t in tools or [] if isinstance(t, dict)}
        self.invalid = []            # (name, reason) of complete calls whose arguments did not validate (check)
        self.buf = ""
        self.state = "text"          # text | name | between | key | after_key | value
        self.ws = ""                 # whitespace held in text (sent once other text follows)
        self.calls = []              # complete calls, OpenAI shape
        self.content = ""
        self.cur = None              # the call under way
        self.truncated = False       # finish() dropped an unfinished call
        self.stray = 0               # markers outside a call, dropped
        self.after_call = False      # whitespace right after a call is not content

    # ------------------------------------------------------------------ text outside calls
    def _text(self, out: list, final: bool) -> bool:
        b = self.buf
        j = b.find("<")
        while j >= 0:
            m = next((m for m in MARKERS if b.startswith(m, j)), None)
            if m is not None:
                break
            if any(m.startswith(b[j:]) for m in MARKERS):      # a possible marker start ends the buffer
                self._say(out, b[:j])
                self.buf = "" if final else b[j:]                # at the end: dropped, never content
                return False
            j = b.find("<", j + 1)
        if j < 0:
            self._say(out, b)
            self.buf = ""
            return False
        self._say(out, b[:j])
        self.buf = b[j + len(m):]
        if m == C.TOOL_CALL:
            self.ws = ""                             # whitespace before a call is not content
            self.state, self.cur = "name", {"index": len(self.calls), "args": "", "n": 0, "held": []}
        else:
            self.stray += 1
        return True

    def _say(self, out: list, s: str):
        if self.after_call:
            s = s.lstrip()
        body = s.rstrip()
        if not body:
            self.ws += s
            return
        text, self.ws, self.after_call = self.ws + body, s[len(body):], False
        self.content += text
        out.append({"content": text})

    # ------------------------------------------------------------------ inside a call
    def _emit(self, out: list, ev: dict):
        (self.cur["held"] if self.check else out).append(ev)

    def _args(self, out: list, s: str):
        if s:
            self.cur["args"] += s
            self._emit(out, {"index": self.cur["index"], "arguments": s})

    def _end_call(self, out: list):
        cur = self.cur
        self._args(out, "}")
        why = None
        if self.check:
            try:
                why = schema_error(json.loads(cur["args"]), self.schemas.get(cur["name"]) or {})
            except ValueError as e:
                why = f"arguments: not JSON ({e})"
            if cur["name"] not in self.schemas:
                why = "no such tool"
        if why:
            self.invalid.append((cur["name"], why))
        else:
            out.extend(cur["held"])
            self.calls.append({"id": cur["id"], "type": "function",
                               "function": {"name": cur["name"], "arguments": cur["args"]}})
        self.cur, self.state, self.after_call = None, "text", True

    def _wait_for(self, *markers) -> bool:
        """The buffer could still become one of markers (after whitespace): wait."""
        b = self.buf.lstrip()
        return any(m.startswith(b) for m in markers)

    def _call(self, out: list) -> bool:
        cur, b = self.cur, self.buf
        if self.state == "name":
            ends = [j for j in (b.find("\n"), b.find("<arg_key>"), b.find(C.TOOL_CALL_END)) if j >= 0]
            if not ends:
                return False
            j = min(ends)
            cur.update(name=b[:j].strip(), id="call_" + secrets.token_hex(12))
            self._emit(out, {"index": cur["index"], "id": cur["id"], "name": cur["name"]})
            self._args(out, "{")
            self.buf, self.state = b[j + (b[j] == "\n"):], "between"
            return True
        if self.state in ("between", "after_key"):
            want = ("<arg_key>", C.TOOL_CALL_END) if self.state == "between" else ("<arg_value>",)
            s = b.lstrip()
            m = next((m for m in want if s.startswith(m)), None)
            if m is None:
                if not s or self._wait_for(*want):
                    return False
                self.buf = s[1:]                     # not the format: skipped
                return True
            self.buf = s[len(m):]
            if m == C.TOOL_CALL_END:
                self._end_call(out)
            elif m == "<arg_key>":
                self.state = "key"
            else:
                cur["string"] = self.types.get(cur["name"], {}).get(cur["key"]) == "string"
                self._args(out, (", " if cur["n"] else "") + json.dumps(cur["key"], ensure_ascii=False) + ": " +
                           ('"' if cur["string"] else ""))
                cur["n"] += 1
                self.state = "value"
            return True
        if self.state == "key":
            j = b.find("</arg_key>")
            if j < 0:
                return False
            cur["key"], self.buf, self.state = b[:j].strip(), b[j + len("</arg_key>"):], "after_key"
            return True
        j, e = b.find("</arg_value>"), b.find(C.TOOL_CALL_END)     # value (a call ended inside it ends it too)
        if e >= 0 and (j < 0 or e < j):
            j = e
        if j < 0:
            if cur["string"]:
                k = _held(b)
                self._args(out, _esc(b[:k]))
                self.buf = b[k:]
            return False
        v, self.state = b[:j], "between"
        self.buf = b[j + len("</arg_value>"):] if b.startswith("</arg_value>", j) else b[j:]
        if cur["string"]:
            self._args(out, _esc(v) + '"')
        else:
            try:
                val = json.loads(v)
            except ValueError:
                val = v
            self._args(out, json.dumps(val, ensure_ascii=False))
        return True

    # ------------------------------------------------------------------ the interface
    def feed(self, text: str) -> list:
        self.buf += text
        out = []
        while self.buf and (self._text(out, False) if self.state == "text" else self._call(out)):
            pass
        return out

    def finish(self) -> list:
        out = self.feed("")
        if self.state == "text":
            self._text(out, True)
        else:
            self.truncated = True
            self.cur, self.state, self.buf = None, "text", ""
        if self.ws and not self.calls:           # a reply without calls keeps its text exactly
            self.content += self.ws
            out.append({"content": self.ws})
        self.ws = ""
        return out


def parse(text: str, tools=None, check: bool = False):
    """(content, complete calls, truncated) of a whole reply."""
    p = ToolCallParser(tools, check)
    p.feed(text)
    p.finish()
    return p.content, p.calls, p.truncated

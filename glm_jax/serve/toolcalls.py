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
(``schema_error``: types, enum / const, required and undeclared keys, lengths, ranges, items, anyOf / allOf); one
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


_TYPES = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
          "null": lambda v: v is None, "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or
          (isinstance(v, float) and v.is_integer())}


def schema_error(v, s, path: str = "arguments") -> Optional[str]:
    """Why ``v`` does not validate against JSON schema ``s`` (the subset the call grammar constrains), or None."""
    if s is False:
        return f"{path}: not allowed"
    if not isinstance(s, dict):
        return None
    if "const" in s and v != s["const"]:
        return f"{path}: not the const value"
    if isinstance(s.get("enum"), list) and v not in s["enum"]:
        return f"{path}: {json.dumps(v, ensure_ascii=False)[:80]} is not one of the enum values"
    for k in ("anyOf", "oneOf"):
        if isinstance(s.get(k), list) and s[k] and all(schema_error(v, b, path) for b in s[k]):
            return f"{path}: matches none of {k}"
    for b in s.get("allOf") or [] if isinstance(s.get("allOf"), list) else []:
        if schema_error(v, b, path):
            return schema_error(v, b, path)
    t = s.get("type")
    types = [t] if isinstance(t, str) else t if isinstance(t, list) else []
    if types and not any(_TYPES.get(x, lambda v: True)(v) for x in types):
        return f"{path}: expected {' or '.join(map(str, types))}"
    if isinstance(v, str):
        return _string_error(v, s, path)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        lo, hi = s.get("minimum"), s.get("maximum")
        if (isinstance(lo, (int, float)) and v < lo) or (isinstance(hi, (int, float)) and v > hi):
            return f"{path}: {v} is out of range"
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0) or len(v) > s.get("maxItems", len(v)):
            return f"{path}: {len(v)} items is out of range"
        return next((e for i, x in enumerate(v) if (e := schema_error(x, s.get("items"), f"{path}[{i}]"))), None)
    if isinstance(v, dict):
        return _object_error(v, s, path)
    return None


def _string_error(v: str, s: dict, path: str) -> Optional[str]:
    if len(v) < s.get("minLength", 0) or len(v) > s.get("maxLength", len(v)):
        return f"{path}: length {len(v)} is out of range"
    try:
        if isinstance(s.get("pattern"), str) and not re.search(s["pattern"], v):
            return f"{path}: does not match the pattern"
    except re.error:                                  # not Python's dialect: the grammar's compiler decided
        pass
    return None


def _object_error(v: dict, s: dict, path: str) -> Optional[str]:
    props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
    req = s.get("required") if isinstance(s.get("required"), list) else []
    miss = [k for k in req if k not in v]
    if miss:
        return f"{path}: missing required {miss[0]!r}"
    extra = s.get("additionalProperties")
    for k, x in v.items():
        if k in props:
            e = schema_error(x, props[k], f"{path}.{k}")
        elif props and not isinstance(extra, dict) or extra is False:   # the grammar takes no undeclared key
            e = f"{path}: undeclared key {k!r}"
        else:
            e = schema_error(x, extra, f"{path}.{k}")
        if e:
            return e
    return None


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

"""JSON schemas bounded so that constrained output always closes within the tokens a request has left.

A grammar only ends if every string, number, array and map in it is bounded: a weak model asked for an object with
a free ``name: str`` writes a string that never ends (or, where extra keys are allowed, adds a key whose value never
ends) and the request runs to ``length`` with broken JSON.  ``bounded(schema, scale, strict)`` rewrites a schema
(a copy) at one size ``scale``:

- objects with declared ``properties`` and no ``additionalProperties`` take no other key (as xgrammar does by
  default); with ``strict`` (OpenAI's ``strict: true``) no object takes a key it does not declare;
- an object with no declared properties (``json_object``, a free map) takes up to ``scale // 4`` keys (at most 16) of
  at most ``scale`` word characters, each a bounded scalar;
- a string without ``enum`` / ``const`` / ``pattern`` / ``format`` gets ``maxLength`` <= ``scale``; integers and
  numbers get bounds of ``scale`` digits (at most 15) and numbers 6 decimals (``multipleOf``); arrays
  ``maxItems`` <= ``scale // 4`` (at most 16);
- no ``\\uXXXX`` escapes and no free whitespace (``x-guidance``), so every character costs at most 4 bytes.

``longest(schema)`` is the most UTF-8 bytes a JSON text valid for a bounded schema can have (None where it cannot
tell: a recursive ``$ref`` -- local ones are inlined first --, ``allOf``, ``pattern``); a token is at least one byte, so output of that many bytes fits that many
tokens.  ``fit(size_of, budget)`` is the largest scale whose size fits the budget (binary search: sizes grow with
the scale)."""

from __future__ import annotations

import copy
import json
import sys

if sys.version_info >= (3, 11):
    from re import _parser as _re_parser
else:                                                  # pragma: no cover - before 3.11
    import sre_parse as _re_parser

MAX_SCALE = 1 << 16          # the largest string bound given (a longer string needs the schema's own maxLength)
MAX_ITEMS = 16               # arrays and free maps: the most items / keys a bound allows
MAX_DIGITS = 15
DECIMALS = 6
GUIDANCE = {"whitespace_flexible": False, "json_allowed_escapes": "nrbtf\\\""}
_COMPOSITE = ("anyOf", "oneOf", "allOf", "prefixItems")
_FREE = {"type": ["string", "integer", "number", "boolean", "null"]}


def _types(s: dict) -> list:
    t = s.get("type")
    return t if isinstance(t, list) else [t] if isinstance(t, str) else []


def _is_free(s) -> bool:
    return s is True or (isinstance(s, dict) and not ({"type", "enum", "const", "$ref", "properties", "items"} |
                                                      set(_COMPOSITE)) & set(s))


def inline_refs(schema, depth: int = 8):
    """Local ``$ref``s (``#/$defs/X``, ``#/definitions/X``: what pydantic writes for nested models) replaced by what
    they point at, so that their sizes can be told; a recursive or deeper reference is left as it is."""
    if not isinstance(schema, dict):
        return schema
    defs = {f"#/{k}/{n}": v for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)
            for n, v in schema[k].items()}

    def sub(s, seen):
        if isinstance(s, list):
            return [sub(v, seen) for v in s]
        if not isinstance(s, dict):
            return s
        ref = s.get("$ref")
        if isinstance(ref, str) and ref in defs and ref not in seen and len(seen) < depth:
            rest = {k: v for k, v in s.items() if k != "$ref"}
            return sub(dict(defs[ref], **rest), seen | {ref})
        return {k: (v if k in ("$defs", "definitions", "enum", "const") else sub(v, seen)) for k, v in s.items()}

    out = sub(schema, frozenset())
    if not _has_ref(out):
        out.pop("$defs", None)
        out.pop("definitions", None)
    return out


def _has_ref(s) -> bool:
    if isinstance(s, dict):
        return "$ref" in s or any(_has_ref(v) for k, v in s.items() if k not in ("$defs", "definitions"))
    return isinstance(s, list) and any(_has_ref(v) for v in s)


def bounded(schema, scale: int, strict: bool = False, top: bool = True, lean: bool = False):
    """The schema bounded at ``scale``; ``lean``: objects keep only their required properties."""
    s = _walk(inline_refs(copy.deepcopy(schema)), max(0, int(scale)), (bool(strict), bool(lean)))
    if top and isinstance(s, dict):
        s["x-guidance"] = dict(GUIDANCE)
    return s


def _walk(s, L: int, mode):
    if _is_free(s):
        s = dict(_FREE, **(s if isinstance(s, dict) else {}))
    if not isinstance(s, dict):
        return s
    for k in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(s.get(k), dict):
            s[k] = {n: _walk(v, L, mode) for n, v in s[k].items()}
    for k in _COMPOSITE:
        if isinstance(s.get(k), list):
            s[k] = [_walk(v, L, mode) for v in s[k]]
    if isinstance(s.get("items"), (dict, bool)):
        s["items"] = _walk(s["items"], L, mode)
    types = _types(s)
    if "object" in types or "properties" in s:
        _object(s, L, mode)
    if "array" in types or "items" in s:
        s["maxItems"] = max(min(s.get("maxItems", MAX_ITEMS), MAX_ITEMS, L // 4), s.get("minItems", 0))
        s.setdefault("items", _walk(True, L, mode))
    if "string" in types and not {"enum", "const", "pattern", "format"} & set(s):
        s["maxLength"] = max(min(s.get("maxLength", MAX_SCALE), L), s.get("minLength", 0))
    if "integer" in types or "number" in types:
        d = min(max(L, 1), MAX_DIGITS)
        s.setdefault("minimum", min(-(10 ** d - 1), s.get("maximum", 0)))
        s.setdefault("maximum", max(10 ** d - 1, s["minimum"]))
        if "number" in types:
            s.setdefault("multipleOf", 10.0 ** -DECIMALS)
    return s


def _object(s: dict, L: int, mode):
    props = s.get("properties") or {}
    if mode[1] and props:
        req = s.get("required") if isinstance(s.get("required"), list) else []
        props = s["properties"] = {k: v for k, v in props.items() if k in req}
    extra = s.get("additionalProperties")
    if props or mode[0] or extra is False or s.get("patternProperties"):
        if mode[0] or extra is None or extra is True:
            s["additionalProperties"] = False
        elif isinstance(extra, dict):
            s["additionalProperties"] = _walk(extra, L, mode)
        return
    value = _walk(extra if isinstance(extra, dict) else True, L, mode)
    s["patternProperties"] = {"^[A-Za-z0-9_]{1,%d}$" % max(1, min(L, 64)): value}
    s["additionalProperties"] = False
    s["maxProperties"] = max(min(s.get("maxProperties", MAX_ITEMS), MAX_ITEMS, L // 4), s.get("minProperties", 0))


def _key_bytes(s: dict):
    for p in s.get("patternProperties") or {}:
        try:
            return 2 + int(p.rsplit(",", 1)[1].split("}")[0])
        except (IndexError, ValueError):
            return None
    return None


def longest(s):
    """The most UTF-8 bytes of a compact JSON text valid for the bounded schema s, or None (unknown)."""
    if s is False:
        return 0
    if not isinstance(s, dict) or "$ref" in s or "allOf" in s or "not" in s:
        return None
    if "const" in s:
        return len(json.dumps(s["const"]).encode())
    if "enum" in s:
        return max((len(json.dumps(v).encode()) for v in s["enum"]), default=0)
    if "anyOf" in s or "oneOf" in s:
        sizes = [longest(v) for v in s.get("anyOf", s.get("oneOf")) or []]
        return None if None in sizes or not sizes else max(sizes)
    sizes = [_longest_of(s, t) for t in _types(s) or ["object" if "properties" in s else ""]]
    return None if None in sizes or not sizes else max(sizes)


def _longest_of(s: dict, t: str):
    if t == "null":
        return 4
    if t == "boolean":
        return 5
    if t in ("integer", "number"):
        lo, hi = s.get("minimum"), s.get("maximum")
        if not isinstance(lo, (int, float)) or not isinstance(hi, (int, float)):
            return None
        digits = len(str(int(max(abs(lo), abs(hi)))))
        return 1 + digits + (0 if t == "integer" else 1 + DECIMALS)
    if t == "string":
        n = s.get("maxLength")
        return None if "pattern" in s or "format" in s or not isinstance(n, int) else 2 + 4 * n
    if t == "array":
        n, item = s.get("maxItems"), longest(s.get("items", True))
        if not isinstance(n, int) or item is None or "prefixItems" in s:
            return None
        return 2 + n * (item + 1)
    if t == "object":
        total = 2
        for k, v in (s.get("properties") or {}).items():
            size = longest(v)
            if size is None:
                return None
            total += len(json.dumps(k, ensure_ascii=False).encode()) + 2 + size
        if s.get("patternProperties"):
            n, key = s.get("maxProperties"), _key_bytes(s)
            vals = [longest(v) for v in s["patternProperties"].values()]
            if not isinstance(n, int) or key is None or None in vals:
                return None
            total += n * (key + 2 + max(vals))
        if s.get("additionalProperties") not in (False, None):
            return None
        return total
    return None


def fit(size_of, budget: int):
    """The largest scale in [0, MAX_SCALE] with size_of(scale) <= budget (size_of: scale -> bytes, None where
    unknown), or None where even scale 0 does not fit or its size is unknown."""
    lo = size_of(0)
    if lo is None or lo > budget:
        return None
    a, b = 0, MAX_SCALE
    while a < b:
        m = (a + b + 1) // 2
        size = size_of(m)
        if size is not None and size <= budget:
            a = m
        else:
            b = m - 1
    return a


def fitted(schema, budget: int, strict: bool = False):
    """The schema bounded at the largest scale whose longest JSON fits ``budget`` tokens; where none does, with only
    the required properties; where that does not fit either, at scale 0 (the shortest it can be); where the size is
    unknown ($ref, allOf, pattern), at scale ``budget`` (each string still ends within it)."""
    for lean in (False, True):
        L = fit(lambda L: longest(bounded(schema, L, strict, top=False, lean=lean)), budget)
        if L is not None:
            return bounded(schema, L, strict, lean=lean)
    if longest(bounded(schema, 0, strict, top=False)) is None:
        return bounded(schema, min(max(0, int(budget)), MAX_SCALE), strict)
    return bounded(schema, 0, strict, lean=True)


TOKEN_BYTES_MAX = 1024   # more bytes than any one token of a real vocabulary holds (the longest are a few hundred)


def shortest(s) -> int:
    """The fewest UTF-8 bytes of a compact JSON text valid for schema s -- 0 where it cannot tell, so that a schema
    is only ever refused for sure: ``minLength`` / a ``pattern``'s shortest match (Python's own regex parser) /
    ``minItems`` / required properties, through anyOf (the shortest branch) and allOf (the longest)."""
    if not isinstance(s, dict) or "$ref" in s:
        return 0
    if "const" in s:
        return len(json.dumps(s["const"]).encode())
    if isinstance(s.get("enum"), list) and s["enum"]:
        return min(len(json.dumps(v).encode()) for v in s["enum"])
    own = [0]
    for k, pick in (("anyOf", min), ("oneOf", min), ("allOf", max)):
        if isinstance(s.get(k), list) and s[k]:
            own.append(pick(shortest(v) for v in s[k]))
    types = _types(s) or (["object"] if "properties" in s else [])
    if types:
        own.append(min(_shortest_of(s, t) for t in types))
    return max(own)


def _shortest_of(s: dict, t: str) -> int:
    if t == "string":
        n = s.get("minLength") if isinstance(s.get("minLength"), int) else 0
        if isinstance(s.get("pattern"), str):
            try:
                n = max(n, _re_parser.parse(s["pattern"]).getwidth()[0])
            except (Exception, RecursionError):       # not Python's dialect: the grammar compiler decides
                pass
        return 2 + max(0, n)
    if t == "array":
        n = s.get("minItems") if isinstance(s.get("minItems"), int) else 0
        return 2 + max(0, n) * (shortest(s.get("items")) + 1) - (1 if n > 0 else 0)
    if t == "object":
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        req = s.get("required") if isinstance(s.get("required"), list) else []
        req = [k for k in req if isinstance(k, str)]
        return 2 + max(0, len(req) - 1) + sum(len(json.dumps(k, ensure_ascii=False).encode()) + 1 +
                                              shortest(props.get(k)) for k in req)
    return {"null": 4, "boolean": 4}.get(t, 1)


def unfit(schema, budget: int):
    """Why no JSON valid for ``schema`` fits ``budget`` tokens even at the most bytes a token can hold, or None."""
    n = shortest(inline_refs(schema))
    if n > max(0, int(budget)) * TOKEN_BYTES_MAX:
        return f"its shortest valid JSON is {n} bytes, more than {budget} tokens can hold"
    return None

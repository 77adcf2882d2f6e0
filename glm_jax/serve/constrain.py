"""Host-side logits processors for glm-jax-serve: ``logit_bias``, constrained decoding through llguidance (JSON
schema, ``json_object``, the GLM tool-call format for ``tool_choice`` required / a named function) and logprobs.

A ``Processor`` belongs to one request; the scheduler samples a row that has one on its host path
(``Scheduler._sample_hosted``): each step the row's logits [V] come to the host, ``process`` adds the bias and sets
the tokens the grammar forbids to -inf, the row's usual sampler (``generate.sample_rows``, same key and settings)
picks the token, and ``accept`` advances the grammar and records the logprobs of the processed logits (their
log-softmax at temperature 1: the engine's distribution after bias and mask).  Rows without a processor stay on the
fused on-device path."""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from .. import fileio
from ..errors import GlmJaxError
from . import bounds as B

_TOKENIZERS = {}


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """llguidance's tokenizer for an engine's tokenizer.json (cached per file)."""
    import llguidance

    key = (tokenizer.path, vocab_size, tuple(sorted(eos_ids)))
    t = _TOKENIZERS.get(key)
    if t is None:
        text = fileio.read_bounded(tokenizer.path, fileio.TOKENIZER_MAX).decode("utf-8")
        t = _TOKENIZERS[key] = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)
    return t


def json_schema_grammar(schema, budget: int = 1 << 20, strict: bool = False) -> str:
    """A llguidance grammar for JSON matching ``schema`` that always closes within ``budget`` tokens (bounds.py:
    every string, number, array and map bounded; compact, no free whitespace), ``strict``: no undeclared keys."""
    import llguidance

    if not isinstance(schema, dict):
        raise GlmJaxError("invalid JSON schema (expected an object)")
    why = B.unfit(schema, budget)
    if why:
        raise GlmJaxError(f"the schema cannot be satisfied within the request's tokens ({why})")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(B.fitted(schema, budget, strict),
                                                             defaults={"whitespace_flexible": False})
    except (ValueError, TypeError, RecursionError) as e:
        raise GlmJaxError(f"invalid JSON schema ({e})") from None


def _lit(s: str) -> str:
    return json.dumps(s)


MAX_CALLS = 4        # parallel calls a required / named tool_choice allows (then the turn ends)
MIN_SCALE = 16       # fewer calls rather than argument strings shorter than this


def _call(f: dict, L: int, lean: bool, mk, compact: bool = False):
    """(the Lark rule body of one call of function f at scale L, the most bytes it can take or None); ``compact``:
    GLM-4.7's form, without the newlines between a call's parts (chat.compact_tool_calls)."""
    nl = "" if compact else "\n"
    sep = "" if compact else " " + _lit(nl)           # Lark has no empty literal: the newline term left out
    params = f.get("parameters") or {}
    props = params.get("properties") or {}
    strict = f.get("strict") is True
    req = params.get("required") or []
    if not isinstance(props, dict) or not isinstance(req, list) or not all(isinstance(p, str) for p in req):
        raise GlmJaxError(f"tool {f['name']}: parameters: 'properties' must be an object and 'required' a list of "
                          f"names")
    req = [p for p in req if p in props]
    opt = [] if lean else [p for p in props if p not in req]
    parts = [f'{mk("<tool_call>")} {_lit(f["name"] + nl)}']
    size = len(f"<tool_call>{f['name']}\n</tool_call>".encode())      # the newlines counted either way: a bound
    for j, p in enumerate(req + opt):
        sch = props[p] if isinstance(props[p], dict) else {}
        if sch.get("type") == "string" and isinstance(sch.get("enum"), list) and sch["enum"]:
            if any("<" in str(v) for v in sch["enum"]):     # the call's markup: a value would end the argument
                raise GlmJaxError(f"tool {f['name']}: parameter {p}: an enum value contains '<', which GLM's "
                                  f"tool-call format cannot hold inside a string argument")
            val = "(" + " | ".join(_lit(str(v)) for v in sch["enum"]) + ")"
            vsize = max(len(str(v).encode()) for v in sch["enum"])
        elif sch.get("type") == "string" and not {"pattern", "format", "const"} & set(sch):
            n = sch.get("maxLength")
            n = min(n, L) if isinstance(n, int) and n >= 0 else L
            val, vsize = f"/[^<]{{0,{n}}}/", 4 * n
        else:
            b = B.bounded(sch, L, strict, lean=lean)
            val, vsize = "%json " + json.dumps(b), B.longest(B.bounded(sch, L, strict, top=False, lean=lean))
        arg = f'{mk("<arg_key>")} {_lit(p)} {mk("</arg_key>")}{sep} {mk("<arg_value>")} {val} ' \
              f'{mk("</arg_value>")}{sep}'
        parts.append(f"({arg})" + ("" if j < len(req) else "?"))
        size = None if size is None or vsize is None else \
            size + vsize + len(f"<arg_key>{p}</arg_key>\n<arg_value></arg_value>\n".encode())
    parts.append(mk("</tool_call>"))
    return " ".join(parts), size


def _fit_calls(fns: list, budget: int, multiple: bool):
    """(calls allowed, scale, lean): as many calls (up to MAX_CALLS) as fit ``budget`` with argument strings of at
    least MIN_SCALE characters, else one call at the largest scale that fits (or only its required arguments)."""
    def size(L, lean, k):
        sizes = [_call(f, L, lean, _lit)[1] for f in fns]
        return None if None in sizes else k * (max(sizes) + 1)

    for lean in (False, True):
        for k in ((MAX_CALLS, 2, 1) if multiple else (1,)):
            L = B.fit(lambda L: size(L, lean, k), budget)
            if L is not None and (L >= MIN_SCALE or k == 1):
                return k, L, lean
    if size(0, False, 1) is None:
        return 1, min(max(0, int(budget)), B.MAX_SCALE), False
    return 1, 0, True


def _check_fits(fns: list, budget: int):
    """Refuse where no call fits ``budget`` tokens: each function's required arguments (raw strings: no quotes)
    at their shortest (bounds.shortest) exceed what the tokens can hold even at the most bytes a token takes."""
    need = []
    for f in fns:
        params = f.get("parameters") if isinstance(f.get("parameters"), dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        req = params.get("required") if isinstance(params.get("required"), list) else []
        need.append(sum(max(0, B.shortest(B.inline_refs(props[p])) - 2) for p in req
                        if isinstance(p, str) and p in props))
    if min(need) > max(0, int(budget)) * B.TOKEN_BYTES_MAX:
        raise GlmJaxError(f"tool {fns[need.index(min(need))]['name']}: parameters: the required arguments' shortest "
                          f"values take {min(need)} bytes, more than the request's {budget} tokens can hold")


def tool_call_grammar(tools: list, name: Optional[str] = None, marker=None, multiple: bool = True,
                      budget: int = 1 << 20, compact: bool = False, must_fit: bool = True) -> str:
    """A Lark grammar (llguidance) for GLM-format tool calls of ``tools`` (OpenAI tool objects), then the end of
    the turn: one call of the function ``name``, or (``name`` None) one call of any of them, or with ``multiple``
    one or more (at most MAX_CALLS).  Each call is ``<tool_call>NAME\\n`` then, per argument,
    ``<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n``, then ``</tool_call>``: the required arguments in the
    schema's order, then the optional ones (each optional); a string value is raw text (an ``enum``: one of its
    values), any other value JSON matching its schema (bounds.py; ``strict`` functions: no undeclared keys).  All
    of it fits ``budget`` tokens (_fit_calls).  ``compact``: GLM-4.7's form, the same without those newlines
    (chat.compact_tool_calls).  ``marker(text)`` may map a marker to a special-token reference (``<[id]>``)."""
    mk = marker or _lit
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not fns:
        raise GlmJaxError(f"no tool named {name!r}")
    if must_fit:                 # the calls are the whole reply: refuse where none can fit
        _check_fits(fns, budget)
    k, L, lean = _fit_calls(fns, budget, multiple)
    rules = [f"call_{i}: " + _call(f, L, lean, mk, compact)[0] for i, f in enumerate(fns)]
    body = " | ".join(f"call_{i}" for i in range(len(fns)))
    start = f"start: ({body})" + (f" (\"\\n\"? ({body})){{0,{k - 1}}}" if k > 1 else "")
    return "\n".join([start] + rules)


def calls_or_json_grammar(tools: list, schema, strict: bool = False, marker=None, multiple: bool = True,
                          budget: int = 1 << 20, compact: bool = False) -> str:
    """tool_choice auto beside a JSON response format: the reply is either tool calls (``tool_call_grammar``) or
    the format's JSON (``json_schema_grammar``), each fitting ``budget``; the model's first token picks which."""
    why = B.unfit(schema, budget)
    if why:                      # refused only where neither the JSON nor any call fits
        _check_fits([t["function"] for t in tools], budget)
    calls = tool_call_grammar(tools, marker=marker, multiple=multiple, budget=budget, compact=compact,
                              must_fit=False)
    answer = json.dumps(B.fitted(schema, budget, strict))
    return f"start: calls | answer\nanswer: %json {answer}\n" + calls.replace("start:", "calls:", 1)


class ConstraintError(GlmJaxError):
    """A grammar that failed while the reply was generated (a schema no text satisfies past some point)."""


class Processor:
    """One request's host-side logits processing: ``bias`` {token id: value}, a grammar (llguidance), logprobs."""

    def __init__(self, vocab_size: int, bias: Optional[dict] = None, grammar: Optional[str] = None,
                 tokenizer=None, eos_ids=(), top_logprobs: Optional[int] = None):
        self.V = vocab_size
        self.bias_idx = np.array(sorted(bias), np.int64) if bias else None
        self.bias_val = np.array([bias[i] for i in sorted(bias)], np.float32) if bias else None
        self.eos = np.array(sorted(eos_ids), np.int64)
        self.matcher = self.bitmask = None
        self.failed = None      # a ConstraintError once the grammar has failed mid-reply (the request then fails)
        if grammar is not None:
            import llguidance
            import llguidance.numpy as lln

            self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size, eos_ids), grammar, log_level=0)
            if self.matcher.is_error():
                raise GlmJaxError(f"the constraint does not compile ({self.matcher.get_error()})")
            self.bitmask = lln.allocate_token_bitmask(1, vocab_size)
            self.allowed()          # the first token's mask: a grammar that fails here (a schema that only refers
            if self.failed is not None:     # to itself) would end the reply at once with nothing valid in it
                raise self.failed
        self.top_logprobs = top_logprobs
        self.logprobs = [] if top_logprobs is not None else None     # [(token, logprob, [(token, logprob), ...])]

    def allowed(self) -> Optional[np.ndarray]:
        """The grammar's mask of the next token [V] bool (None: no grammar).  A grammar that is done or broken
        allows only EOS."""
        m = self.matcher
        if m is None:
            return None
        if m.is_stopped() or m.is_error():
            if m.is_error() and self.failed is None:
                err = " ".join(m.get_error().split())[:200]
                self.failed = ConstraintError(f"the constraint cannot be satisfied ({err})")
            ok = np.zeros(self.V, bool)
            ok[self.eos] = True
            return ok
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask(m, self.bitmask, 0)
        ok = np.unpackbits(self.bitmask[0].view(np.uint8), bitorder="little")[:self.V].astype(bool)
        if not ok.any():
            ok[self.eos] = True
        return ok

    def process(self, logits: np.ndarray) -> np.ndarray:
        if self.bias_idx is not None:
            logits[self.bias_idx] += self.bias_val
        ok = self.allowed()
        if ok is not None:
            logits[~ok] = -np.inf
        return logits

    def accept(self, logits: np.ndarray, token: int):
        if self.logprobs is not None:
            z = logits.astype(np.float64)
            mx = np.max(z)
            lp = z - (mx + np.log(np.sum(np.exp(z - mx))))
            k = self.top_logprobs or 0
            top = []
            if k:
                idx = np.argsort(-lp, kind="stable")[:k]
                top = [(int(i), float(lp[i])) for i in idx]
            self.logprobs.append((int(token), float(lp[token]), top))
        if self.matcher is not None and not self.matcher.is_stopped() and not self.matcher.is_error():
            self.matcher.consume_token(int(token))

"""Chat formatting: the checkpoint's own ``chat_template`` (tokenizer_config.json), rendered with jinja2 the way
transformers renders it (a sandboxed environment with trim_blocks / lstrip_blocks, ``raise_exception``,
``strftime_now``, ``tojson``; variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, and
the special tokens by name), then tokenized; special tokens written in the template are recognised by the
tokenizer.  A checkpoint without a template gets the GLM format:
``[gMASK]<sop><|role|>\\ncontent ... <|assistant|>\\n``.  ``glm-jax --chat`` and the server use the same code.

Only the template's own markup yields control tokens: every string a client supplies (content, names, tool names,
arguments, tool definitions, ids) has its special-token texts swapped for nonce sentinels before rendering
(``Guard``), and ``encode_rendered`` splits the rendered text at the special tokens left (the template's), encodes
the text between them with special-token parsing off and the sentinels restored -- so ``<|system|>`` typed in a
message is the 7 tokens of its text, never the role token (vLLM / llama-server tokenize messages the same way)."""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Optional

from . import fileio
from .errors import GlmJaxError

GLM_TOKENS = ("[gMASK]", "<sop>", "<|user|>", "<|assistant|>")
ROLES = ("system", "user", "assistant")


class Guard:
    """A client's strings with their special-token texts (``specials``) swapped for sentinels
    ``\\ue000<nonce><i>\\ue001`` (the nonce is per render, so a client cannot forge one); ``restore`` puts the texts
    back (also where a template's ``tojson(ensure_ascii=True)`` escaped the sentinel's characters)."""

    def __init__(self, specials):
        self.nonce = secrets.token_hex(8)
        self.table = []
        toks = sorted((t for t in specials if t), key=len, reverse=True)
        self.pat = re.compile("|".join(map(re.escape, toks))) if toks else None
        self.back = re.compile(r"(?:\ue000|\\ue000)" + self.nonce + r"(\d+)(?:\ue001|\\ue001)")

    def _swap(self, m) -> str:
        self.table.append(m.group(0))
        return f"\ue000{self.nonce}{len(self.table) - 1}\ue001"

    def text(self, s: str) -> str:
        return s if self.pat is None else self.pat.sub(self._swap, s)

    def deep(self, x):
        """Every string in a JSON-like value, dict keys included."""
        if isinstance(x, str):
            return self.text(x)
        if isinstance(x, dict):
            return {self.deep(k): self.deep(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [self.deep(v) for v in x]
        return x

    def messages(self, messages: list) -> list:
        """Checked messages (check_messages) with every client string guarded; roles are checked names, kept."""
        return [{k: (v if k == "role" else self.deep(v)) for k, v in m.items()} for m in messages]

    def restore(self, s: str) -> str:
        return self.back.sub(lambda m: self.table[int(m.group(1))], s)


def encode_rendered(tokenizer, text: str, guard: Guard) -> list:
    """Ids of a rendered chat text: its special tokens (the template's, since the guard took the clients') as their
    ids, an lstrip / rstrip token taking the whitespace beside it as the tokenizers library does; the text between
    them, sentinels restored, encoded with special-token parsing off."""
    specials = tokenizer.special_tokens            # {text: (id, lstrip, rstrip)}
    if guard.pat is None:
        return tokenizer.encode_plain(guard.restore(text))
    ids, pos, strip_next = [], 0, False
    for m in guard.pat.finditer(text):
        tid, lstrip, rstrip = specials[m.group(0)]
        piece = text[pos:m.start()]
        if strip_next:
            piece = piece.lstrip()
        if lstrip:
            piece = piece.rstrip()
        if piece:
            ids += tokenizer.encode_plain(guard.restore(piece))
        ids.append(tid)
        pos, strip_next = m.end(), rstrip
    piece = text[pos:].lstrip() if strip_next else text[pos:]
    if piece:
        ids += tokenizer.encode_plain(guard.restore(piece))
    return ids


TEMPLATE_FILE = "chat_template.jinja"   # where transformers 5 saves a tokenizer's template (GLM-4.6 / 4.7 hub repos)


def load_template(model_dir: str) -> Optional[dict]:
    """{"template": str, "tokens": {name: str}} from tokenizer_config.json, the template from chat_template.jinja
    where that file exists (it wins over the config's, as in transformers), or None when neither has one."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    jinja = os.path.join(model_dir, TEMPLATE_FILE)
    cfg = {}
    if os.path.exists(path):
        try:
            cfg = fileio.read_json(path)
        except OSError as e:
            raise GlmJaxError(f"{path}: cannot read ({e.strerror or e})") from None
        if not isinstance(cfg, dict):
            raise GlmJaxError(f"{path}: expected a JSON object")
    t = cfg.get("chat_template")
    if os.path.exists(jinja):
        try:
            t, path = fileio.read_bounded(jinja, fileio.JSON_MAX).decode("utf-8"), jinja
        except (OSError, UnicodeDecodeError) as e:
            raise GlmJaxError(f"{jinja}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if t is None:
        return None
    if isinstance(t, list):      # [{"name": "default", "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if not isinstance(t, str) or not t:
        raise GlmJaxError(f"{path}: field chat_template: expected a template string")
    tokens = {}
    for k, v in cfg.items():
        if k.endswith("_token"):
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str) or v is None:
                tokens[k] = v
    _compile(t, path)
    return {"template": t, "tokens": tokens, "path": path}


_ENV = {}


def _compile(template: str, where: str):
    t = _ENV.get(template)
    if t is not None:
        return t
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        t = env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise GlmJaxError(f"{where}: chat_template does not compile ({e})") from None
    _ENV[template] = t
    return t


def check_messages(messages, where: str = "messages") -> list:
    """A list of {"role": system|developer|user|assistant|tool, "content": str} (developer: a system turn) (content parts of type text are joined); an
    assistant message may carry OpenAI ``tool_calls`` (kept with their arguments parsed into objects, as chat
    templates read them), a tool message its ``tool_call_id``."""
    if not isinstance(messages, list) or not messages:
        raise GlmJaxError(f"{where}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GlmJaxError(f"{where}[{i}]: expected an object with role and content")
        role = m.get("role")
        if role == "developer":          # OpenAI's newer name for the system turn
            role = "system"
        if role not in ROLES + ("tool",):
            raise GlmJaxError(f"{where}[{i}].role: expected one of system, developer, user, assistant, tool, got "
                              f"{role!r}")
        c = m.get("content", "")
        if c is None:
            c = ""
        if isinstance(c, list):          # [{"type": "text", "text": ...}]
            parts = []
            for j, p in enumerate(c):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise GlmJaxError(f"{where}[{i}].content[{j}]: only text parts are supported")
                parts.append(p["text"])
            c = "".join(parts)
        if not isinstance(c, str):
            raise GlmJaxError(f"{where}[{i}].content: expected a string")
        msg = {"role": role, "content": c}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _check_tool_calls(m["tool_calls"], f"{where}[{i}].tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise GlmJaxError(f"{where}[{i}].tool_call_id: expected a string")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _check_tool_calls(calls, where: str) -> list:
    if not isinstance(calls, list):
        raise GlmJaxError(f"{where}: expected a list")
    out = []
    for j, tc in enumerate(calls):
        f = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise GlmJaxError(f"{where}[{j}]: expected {{\"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise GlmJaxError(f"{where}[{j}].function.arguments: not valid JSON") from None
        if not isinstance(args, dict):
            raise GlmJaxError(f"{where}[{j}].function.arguments: expected a JSON object")
        out.append({"id": tc.get("id") if isinstance(tc.get("id"), str) else f"call_{j}", "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


# ----------------------------------------------------------------------------- tools (GLM-4.5's format)
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def tools_system_text(tools: list) -> str:
    """The tools block written into the system turn for a template that does not render ``tools`` itself: the
    functions as compact JSON between <tools> tags (GLM-4.5's own template, which renders them, also explains the
    call format in ~250 tokens; here the format is what constrained decoding enforces)."""
    return "<tools>\n" + "\n".join(json.dumps(t.get("function", t), ensure_ascii=False, separators=(",", ":"))
                                     for t in tools) + "\n</tools>"


def format_tool_call(name: str, args: dict, compact: bool = False) -> str:
    """One call in GLM's format (string values raw, others JSON): a line a part (GLM-4.5 / 4.6), or ``compact``
    without the newlines (GLM-4.7 / 4.7-Flash)."""
    out = [f"{TOOL_CALL}{name}"]
    for k, v in args.items():
        out.append(f"<arg_key>{k}</arg_key>")
        out.append(f"<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>")
    sep = "" if compact else "\n"
    return sep.join(out) + sep + TOOL_CALL_END


def compact_tool_calls(template: Optional[dict]) -> bool:
    """Whether the checkpoint's template writes tool calls in GLM-4.7's compact form (``</arg_key><arg_value>``,
    no newline between a call's parts; GLM-4.5 / 4.6 put each part on its own line): constrained decoding then
    forces that form, the one the model was trained on."""
    return template is not None and "</arg_key><arg_value>" in template["template"]


def _template_renders_tools(template: dict) -> bool:
    return "tools" in template["template"]


def with_tools(template: Optional[dict], messages: list, tools: Optional[list]) -> list:
    """Messages for a template that does not render tools / tool calls itself: the tools block in the system turn,
    assistant tool calls written in GLM's format, tool results wrapped in <tool_response>."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            text = "\n".join(format_tool_call(tc["function"]["name"], tc["function"]["arguments"])
                             for tc in m["tool_calls"])
            m = {"role": m["role"], "content": (m["content"] + "\n" if m["content"] else "") + text}
        elif m["role"] == "tool":
            m = {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools:
        block = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render(template: dict, messages: list, add_generation_prompt: bool = True, tools: Optional[list] = None) -> str:
    """The template rendered; ``tools`` (OpenAI tool objects) are passed as transformers' apply_chat_template passes
    them, or, to a template that does not use them, written into the messages (``with_tools``)."""
    t = _compile(template["template"], template.get("path", "chat_template"))
    import jinja2

    if not _template_renders_tools(template):
        messages, tools = with_tools(template, messages, tools), None
    kw = dict(template.get("tokens", {}))
    try:
        return t.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                        **{k: v for k, v in kw.items()})
    except jinja2.exceptions.TemplateError as e:
        raise GlmJaxError(f"{template.get('path', 'chat_template')}: chat_template: {e}") from None


def chat_ids(tokenizer, template: Optional[dict], messages: list, tools: Optional[list] = None) -> list:
    """Token ids of a chat prompt (ends with the assistant's turn opened); control tokens only from the markup."""
    messages = check_messages(messages)
    guard = Guard(tokenizer.special_tokens)
    messages = guard.messages(messages)
    tools = guard.deep(tools) if tools is not None else None
    if template is not None:
        return encode_rendered(tokenizer, render(template, messages, tools=tools), guard)
    messages = with_tools(None, messages, tools)
    ids = [tokenizer.token_id(t) for t in GLM_TOKENS]
    if any(i is None for i in ids):
        raise GlmJaxError(f"{tokenizer.path}: chat needs a chat_template in tokenizer_config.json or the GLM tokens "
                          f"{', '.join(GLM_TOKENS)} in the tokenizer")
    g, sop, _, a = ids
    out = [g, sop]
    for m in messages:
        rid = tokenizer.token_id(f"<|{m['role']}|>")
        if rid is None:
            raise GlmJaxError(f"{tokenizer.path}: no <|{m['role']}|> token for a {m['role']} message")
        out += [rid] + encode_rendered(tokenizer, "\n" + m["content"], guard)
    return out + [a] + tokenizer.encode_plain("\n")

"""``POST /v1/responses``: OpenAI's Responses API, stateless, on the chat path.

The request (``input``: a string or items -- messages, ``function_call``, ``function_call_output`` --,
``instructions``, ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, ``text.format``, ``max_output_tokens``,
``temperature`` / ``top_p``, ``stream``) becomes a chat completions body (``chat_body``) that the server submits as
one chat; its reply (content and GLM-format tool calls, replies.Choice) becomes the output items: a ``message``
with ``output_text``, then a ``function_call`` per call.  Streamed, the Responses events: ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` ... ``response.output_text.delta`` /
``response.function_call_arguments.delta`` ... ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` where max_output_tokens cut it).  Nothing is stored: ``store: true`` and
``previous_response_id`` are 400s naming them."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from . import replies
from .http import HTTPError, one_line

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "stream",
          "max_output_tokens", "temperature", "top_p", "store", "previous_response_id", "metadata", "user",
          "truncation", "include", "reasoning", "seed", "top_logprobs", "service_tier", "stream_options"}
ROLES = ("user", "system", "developer", "assistant")


def _bad(field: str, what: str) -> HTTPError:
    return HTTPError(400, f"'{field}': {what}", param=field)


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") or \
                    not isinstance(p.get("text"), str):
                raise _bad(f"{where}[{j}]", "only text parts (input_text, output_text) are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise _bad(where, "expected a string or a list of text parts")


def messages(body: dict) -> list:
    """``instructions`` + ``input`` as chat messages (consecutive function calls: one assistant turn)."""
    out = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _bad("instructions", "expected a string")
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "expected a string or a non-empty list of items")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        t = it.get("type", "message") if isinstance(it, dict) else None
        if t == "message" and it.get("role") in ROLES:
            out.append({"role": it["role"], "content": _text(it.get("content", ""), f"{where}.content")})
        elif t == "function_call":
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(where, "a function_call needs call_id, name and arguments (strings)")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif t == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _bad(where, "a function_call_output needs call_id (a string)")
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": _text(it.get("output", ""),
                                                                                       f"{where}.output")})
        else:
            raise _bad(where, "expected a message (role user, system, developer or assistant), a function_call "
                              "or a function_call_output")
    return out


def _tools(body: dict):
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "expected a list of function tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"tools[{i}]", "only function tools are supported")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                       "strict") if t.get(k) is not None}})
    return out


def _tool_choice(tc):
    if isinstance(tc, dict) and tc.get("type") == "function":
        return {"type": "function", "function": {"name": tc.get("name")}}
    return tc


def _format(body: dict):
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "expected {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict")
                                                       if k in fmt}}
    return {"type": fmt.get("type")}


def chat_body(body: dict) -> dict:
    """The chat completions body of a Responses request (400 naming a field it cannot take)."""
    for k, v in body.items():
        if k not in FIELDS and v is not None:
            raise _bad(k, "not supported by this server's responses")
    if body.get("store") is True:
        raise _bad("store", "not supported: this server keeps no responses (send store: false, or omit it)")
    if body.get("previous_response_id") is not None:
        raise _bad("previous_response_id", "not supported: this server keeps no responses (send the whole "
                                           "conversation as input)")
    for k in ("reasoning", "top_logprobs"):
        if body.get(k) not in (None, {}, 0):
            raise _bad(k, "not supported")
    if body.get("include") not in (None, []):
        raise _bad("include", "not supported")
    out = {"messages": messages(body), "tools": _tools(body), "tool_choice": _tool_choice(body.get("tool_choice")),
           "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": _format(body),
           "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
           "top_p": body.get("top_p"), "seed": body.get("seed"), "stream": body.get("stream")}
    if out["tools"] is None and isinstance(out["tool_choice"], str) and out["tool_choice"] in ("auto", "none"):
        out["tool_choice"] = None
    return {k: v for k, v in out.items() if v is not None}


# ----------------------------------------------------------------------------- the reply
def _message_item(mid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []}


def _call_item(c: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + c["id"][5:], "call_id": c["id"], "name": c["function"]["name"],
            "arguments": c["function"]["arguments"], "status": status}


def _response(server, job, body: dict, status: str, output: list, usage=True) -> dict:
    req = job["reqs"][0]
    u = None
    if usage:
        cached = int(getattr(req, "cached_tokens", 0) or 0)
        u = {"input_tokens": len(req.prompt), "output_tokens": len(req.out),
             "total_tokens": len(req.prompt) + len(req.out), "input_tokens_details": {"cached_tokens": cached},
             "output_tokens_details": {"reasoning_tokens": 0}}
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    return {"id": job["rid"], "object": "response", "created_at": job["created"], "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "model": server.model_name, "output": output, "usage": u,
            "instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "text": {"format": fmt or {"type": "text"}},
            "metadata": body.get("metadata") or {}, "store": False, "previous_response_id": None,
            "truncation": body.get("truncation") or "disabled", "reasoning": None}


def _status(req) -> str:
    return "incomplete" if req.finish_reason == "length" else "completed"


async def respond(server, request):
    """The handler of POST /v1/responses."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    server.check_ready()
    raw = await server._raw_body(request)
    body = server.parse_body(raw)
    chat = chat_body(body)
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    job = await run_in_threadpool(server.submit_body, chat, True, "responses", loop, q, "resp_",
                                  getattr(request.state, "tenant", None))      # the prefix cache's tenant
    server.m_prompt.inc(job["prompt_tokens"])
    if job["stream"]:
        return replies.sse(_events(server, job, body, q))
    if not await replies.wait_all(server, request, job, q):
        return JSONResponse({}, status_code=499)
    bad = replies.failure(server, job)
    if bad is not None:
        return bad
    req = job["reqs"][0]
    text, calls = replies.Choice(req, job["tools"], job["drop_calls"], job["check_calls"]).result()
    output = ([_message_item("msg_" + secrets.token_hex(12), text, "completed")] if text or not calls else []) + \
        [_call_item(c) for c in calls]
    server.m_gen.inc(len(req.out))
    server.m_requests.labels("responses", "200").inc()
    server._log(job, 200)
    return JSONResponse(_response(server, job, body, _status(req), output))


class _Stream:
    """The Responses events of one streamed generation."""

    def __init__(self, server, job, body):
        self.server, self.job, self.body = server, job, body
        self.seq = 0
        self.output = []             # finished items
        self.msg = None              # the open message item: [id, text]
        self.calls = {}              # parser call index -> [output index, item]

    def ev(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"event": kind, "data": json.dumps(dict(type=kind, sequence_number=self.seq - 1, **fields))}

    def close_message(self) -> list:
        if self.msg is None:
            return []
        (mid, text), k = self.msg, len(self.output)
        part = {"type": "output_text", "text": text, "annotations": []}
        item = _message_item(mid, text, "completed")
        self.output.append(item)
        self.msg = None
        return [self.ev("response.output_text.done", item_id=mid, output_index=k, content_index=0, text=text),
                self.ev("response.content_part.done", item_id=mid, output_index=k, content_index=0, part=part),
                self.ev("response.output_item.done", output_index=k, item=item)]

    def feed(self, events: list) -> list:
        out = []
        for e in events:
            if "content" in e:
                if self.msg is None:
                    self.msg = ["msg_" + secrets.token_hex(12), ""]
                    k = len(self.output)
                    out += [self.ev("response.output_item.added", output_index=k,
                                    item=_message_item(self.msg[0], "", "in_progress")),
                            self.ev("response.content_part.added", item_id=self.msg[0], output_index=k,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
                self.msg[1] += e["content"]
                out.append(self.ev("response.output_text.delta", item_id=self.msg[0], output_index=len(self.output),
                                   content_index=0, delta=e["content"]))
            elif "name" in e:
                out += self.close_message()
                item = _call_item({"id": e["id"], "function": {"name": e["name"], "arguments": ""}}, "in_progress")
                self.calls[e["index"]] = [len(self.output), item]
                self.output.append(item)
                out.append(self.ev("response.output_item.added", output_index=len(self.output) - 1, item=item))
            else:
                k, item = self.calls[e["index"]]
                item["arguments"] += e["arguments"]
                out.append(self.ev("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                                   delta=e["arguments"]))
        return out

    def finish(self, choice) -> list:
        out = self.close_message()
        done = {c["id"] for c in choice.calls}
        for k, item in self.calls.values():
            if item["call_id"] in done:
                item["status"] = "completed"
                out += [self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                name=item["name"], arguments=item["arguments"]),
                        self.ev("response.output_item.done", output_index=k, item=item)]
            else:                                    # cut off: never a call with broken arguments
                self.output.remove(item)
        return out


async def _events(server, job, body, q):
    st, req = _Stream(server, job, body), job["reqs"][0]
    choice = replies.Choice(req, job["tools"], job["drop_calls"], job["check_calls"])
    status = 499
    try:
        yield st.ev("response.created", response=_response(server, job, body, "in_progress", [], usage=False))
        yield st.ev("response.in_progress", response=_response(server, job, body, "in_progress", [], usage=False))
        done = False
        while not done:
            _, text, _, done = await q.get()
            for e in st.feed(choice.feed(text, done)):
                yield e
        server._observe(job)
        if req.error is not None:
            yield st.ev("error", code="server_error", message=one_line(req.error), param=None)
            status = 500
        else:
            for e in st.finish(choice):
                yield e
            final = _status(req)
            yield st.ev(f"response.{final}", response=_response(server, job, body, final, st.output))
            status = 200
        server.m_gen.inc(len(req.out))
    finally:
        if not req.done:
            server.sched.cancel(req)
        server.m_requests.labels("responses", str(status)).inc()
        server._log(job, status)


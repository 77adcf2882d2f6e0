"""The replies of glm-jax-serve's generation endpoints: a job's n requests collected into one JSON body, or streamed
as server-sent events.  Chat completions and completions here; the Responses API (responses.py) builds on
``Choice``, ``wait_all`` and ``failure``.

With ``tools`` (and tool_choice not "none") every choice's text goes through a ``ToolCallParser``
(toolcalls.py): complete GLM-format calls become ``tool_calls`` (streamed as ``arguments`` deltas), the text
outside them is the content, and no call markup is ever content; a call cut off (max_tokens, EOS) is dropped and
logged, its finish reason what the request's was (``length``)."""

from __future__ import annotations

import asyncio
import json
import logging

from ..experts.store import RamBudgetError
from .constrain import ConstraintError
from .http import HTTPError, one_line, request_refusal
from .toolcalls import ToolCallParser

LOG = logging.getLogger("glm_jax.server")


class Choice:
    """One request's reply as it streams; ``drop_calls`` (tool_choice none): calls are neither content nor
    tool_calls; ``check_calls`` (no grammar forced the calls): a call whose arguments do not validate against its
    tool's schema is dropped and logged (we promise arguments that validate)."""

    def __init__(self, req, tools, drop_calls: bool = False, check_calls: bool = False):
        self.req, self.drop = req, drop_calls
        self.parser = ToolCallParser(tools, check_calls) if tools is not None else None
        self.sent_tok = 0
        self.whole = None

    def feed(self, text: str, done: bool) -> list:
        """Events of the next text ({"content"}, {"index", "id", "name"}, {"index", "arguments"})."""
        if self.parser is None:
            return [{"content": text}] if text else []
        ev = self.parser.feed(text)
        if done:
            ev += self.parser.finish()
            if self.parser.truncated:
                LOG.warning("glm-jax-serve: request %d: a tool call cut off (finish_reason %s) was dropped",
                            self.req.id, self.req.finish_reason)
            for name, why in self.parser.invalid:
                LOG.warning("glm-jax-serve: request %d: a call of tool %r was dropped: its %s", self.req.id, name, why)
            if self.drop and self.parser.calls:
                LOG.warning("glm-jax-serve: request %d: %d tool call(s) dropped (tool_choice none)", self.req.id,
                            len(self.parser.calls))
        return [e for e in ev if "content" in e] if self.drop else ev

    def result(self):
        """(content, calls) of the finished request."""
        if self.parser is None:
            return self.req.text, []
        if self.whole is None:
            self.feed(self.req.text, True)
            self.whole = (self.parser.content, self.calls)
        return self.whole

    @property
    def calls(self) -> list:
        return self.parser.calls if self.parser is not None and not self.drop else []

    def finish_reason(self) -> str:
        return "tool_calls" if self.calls and self.req.finish_reason == "stop" else self.req.finish_reason


async def wait_all(server, request, job, q) -> bool:
    """Wait until every request of the job is done; False (all cancelled) when the client went away."""
    left = len(job["reqs"])
    try:
        while left:
            try:
                _, _, _, done = await asyncio.wait_for(q.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    for r in job["reqs"]:
                        server.sched.cancel(r)
                    server.m_requests.labels(job["endpoint"], "499").inc()
                    server._log(job, 499)
                    return False
                continue
            left -= bool(done)
    except asyncio.CancelledError:
        for r in job["reqs"]:
            server.sched.cancel(r)
        raise
    server._observe(job)
    return True


def failure(server, job):
    """A finished job's error as a response (memory refusal: raised as its 400), or None."""
    for req in job["reqs"]:
        if isinstance(req.error, (RamBudgetError, ConstraintError)):    # the memory plan's / the schema's refusal
            server._log(job, 400)
            raise request_refusal(job, req.error)
        if req.error is not None:
            server._log(job, 500)
            return server.internal_error(job["endpoint"], req.error)
    return None


async def respond(server, request, job, q):
    """The chat / text completion reply of a submitted job."""
    from starlette.responses import JSONResponse

    server.m_prompt.inc(job["prompt_tokens"])
    if job["stream"]:
        return stream(server, job, q)
    if not await wait_all(server, request, job, q):
        return JSONResponse({}, status_code=499)
    bad = failure(server, job)
    if bad is not None:
        return bad
    choices = []
    for i, req in enumerate(job["reqs"]):
        ch = Choice(req, job["tools"], job["drop_calls"], job["check_calls"])
        text, calls = ch.result()
        lp = server._logprobs(job, req, 0, len(req.out))
        if job["chat"]:
            msg = {"role": "assistant", "content": text if (text or not calls) else None}
            if calls:
                msg["tool_calls"] = calls
            choices.append({"index": i, "message": msg, "finish_reason": ch.finish_reason(), "logprobs": lp})
        else:
            choices.append({"index": i, "text": job.get("echo", [""] * (i + 1))[i] + text,
                            "finish_reason": ch.finish_reason(), "logprobs": lp})
        server.m_gen.inc(len(req.out))
    server.m_requests.labels(job["endpoint"], "200").inc()
    server._log(job, 200)
    return JSONResponse({"id": job["rid"], "object": "chat.completion" if job["chat"] else "text_completion",
                         "created": job["created"], "model": server.model_name, "choices": choices,
                         "usage": server._usage(job), "system_fingerprint": None})


def sse(gen, ping: int = 15):
    from sse_starlette.sse import AppStatus, EventSourceResponse

    # SIGTERM drains: uvicorn stops accepting and waits for the open responses, and our streams end when their
    # generation ends, so sse-starlette must not cut them at shutdown (its default)
    AppStatus.disable_automatic_graceful_drain()
    return EventSourceResponse(gen, ping=ping)


class _Chunks:
    """The chunk objects of one streamed chat / text completion."""

    def __init__(self, server, job):
        self.server, self.job, self.chat = server, job, job["chat"]
        self.obj = "chat.completion.chunk" if self.chat else "text_completion"

    def __call__(self, i, text=None, reason=None, role=False, lp=None, tool_calls=None) -> str:
        if self.chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            ch = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp}
        else:
            ch = {"index": i, "text": text or "", "finish_reason": reason, "logprobs": lp}
        d = {"id": self.job["rid"], "object": self.obj, "created": self.job["created"],
             "model": self.server.model_name, "choices": [ch]}
        if self.job["include_usage"]:
            d["usage"] = None
        return json.dumps(d)

    def events(self, i, ev: list, lp):
        """The chunks of one choice's parser events (the logprobs ride on the first, or on an empty one)."""
        out = []
        for e in ev:
            if "content" in e:
                out.append(self(i, e["content"], lp=lp))
            elif "name" in e:
                out.append(self(i, lp=lp, tool_calls=[{"index": e["index"], "id": e["id"], "type": "function",
                                                       "function": {"name": e["name"], "arguments": ""}}]))
            else:
                out.append(self(i, lp=lp, tool_calls=[{"index": e["index"], "function": {"arguments":
                                                                                          e["arguments"]}}]))
            lp = None
        if lp and lp.get("content", lp.get("tokens")):
            out.append(self(i, "" if self.chat else "", lp=lp))
        return out


def stream(server, job, q):
    """A streamed chat / text completion: per-token chunks, each choice's finish reason, usage when asked, [DONE]."""
    reqs = job["reqs"]
    chunk = _Chunks(server, job)

    async def events():
        status = 499
        choices = [Choice(r, job["tools"], job["drop_calls"], job["check_calls"]) for r in reqs]
        try:
            for i in range(len(reqs)):
                if job["chat"]:
                    yield {"data": chunk(i, "", role=True)}
                elif job.get("echo"):
                    yield {"data": chunk(i, job["echo"][i])}
            left = len(reqs)
            while left:
                i, text, n, done = await q.get()
                ch = choices[i]
                lp = server._logprobs(job, ch.req, ch.sent_tok, len(ch.req.out))
                ch.sent_tok = len(ch.req.out)
                for c in chunk.events(i, ch.feed(text, done), lp):
                    # the per-token chunk, encoded here (one JSON line: sse_starlette passes bytes through)
                    yield b"data: " + c.encode() + b"\r\n\r\n"
                if done:
                    left -= 1
                    server._observe(job)
                    if ch.req.error is None:
                        yield {"data": chunk(i, None if job["chat"] else "", reason=ch.finish_reason())}
            status = None
            async for e in _stream_end(server, job, chunk.obj):
                if isinstance(e, int):
                    status = e
                else:
                    yield e
        finally:
            for r in reqs:
                if not r.done:          # the client went away: free the row
                    server.sched.cancel(r)
            server.m_requests.labels(job["endpoint"], str(status or 499)).inc()
            server._log(job, status or 499)

    return sse(events())


async def _stream_end(server, job, obj: str):
    """The end of a stream: the error, or the usage chunk when asked; then [DONE]; yields the status last."""
    reqs = job["reqs"]
    errs = [r.error for r in reqs if r.error is not None]
    if errs and isinstance(errs[0], (RamBudgetError, ConstraintError)):
        yield {"data": json.dumps(request_refusal(job, errs[0]).body())}
        status = 400
    elif errs:
        LOG.error("glm-jax-serve: %s: internal error: %s", job["endpoint"], one_line(errs[0]), exc_info=errs[0])
        yield {"data": json.dumps(HTTPError(500, one_line(errs[0]), type_="server_error").body())}
        status = 500
    else:
        if job["include_usage"]:
            yield {"data": json.dumps({"id": job["rid"], "object": obj, "created": job["created"],
                                       "model": server.model_name, "choices": [], "usage": server._usage(job)})}
        status = 200
    for r in reqs:
        server.m_gen.inc(len(r.out))
    yield {"data": "[DONE]"}
    yield status

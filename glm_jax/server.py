"""`glm-jax-serve`: an OpenAI-compatible HTTP server (starlette + uvicorn, SSE through sse-starlette, Prometheus
metrics through prometheus-client) over the engine's continuous-batching scheduler (glm_jax/scheduler.py).

Endpoints: POST /v1/chat/completions, POST /v1/completions (``stream`` true/false; SSE chunks end with
``data: [DONE]``), GET /v1/models, GET /health, GET /metrics.  One engine thread drives the scheduler; request
handlers submit ``Request``s to it and receive their tokens through an asyncio queue.  Errors are OpenAI-style JSON
bodies ``{"error": {"message", "type", "param", "code"}}``: 400 for bad JSON / fields / an unknown model / a prompt
beyond the context, 401 for a wrong API key, 429 when ``--max_queue`` requests are waiting, 503 while draining.
A client that disconnects has its request cancelled; its row is freed before the next decode dispatch.
SIGTERM: uvicorn stops accepting connections, in-flight requests finish, then the engine closes and the process
exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import threading
import time

from absl import app as absl_app
from absl import flags

from . import options as O
from .config import GlmJaxError

FLAGS = flags.FLAGS

O.define_model_flag()
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (127.0.0.1: this machine only).")
flags.DEFINE_integer("port", 8000, "TCP port (0: any free port, printed at start).", lower_bound=0, upper_bound=65535)
flags.DEFINE_string("api_key", "", "If set, every /v1 request and /metrics must send 'Authorization: Bearer KEY'.")
flags.DEFINE_integer("max_queue", 64, "Requests that may wait for a free row; beyond it: HTTP 429 (0 = no limit).",
                     lower_bound=0)
flags.DEFINE_string("served_model_name", "", "The model id clients send and /v1/models lists (default: the model "
                    "directory's name, 'glm-jax-default' for the embedded model).")
O.define_flags()
SERVE_MAX_BATCH = 8          # --max_batch's default here (the option table's default, 1, is glm-jax's)

MAIN_FLAGS = ("model", "host", "port", "api_key", "max_batch", "prefill_chunk", "max_queue", "served_model_name")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param=None, code=None, type_="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_one_line = O.one_line


# ----------------------------------------------------------------------------- request parameters
def _field(body: dict, name: str, kind, default=None, lo=None, hi=None, nullable=True):
    """body[name] checked: kind int | float | bool | str; ranges inclusive.  400 naming the field otherwise."""
    if name not in body or (body[name] is None and nullable):
        return default
    v = body[name]
    ok = (isinstance(v, bool) if kind is bool else
          isinstance(v, int) and not isinstance(v, bool) if kind is int else
          isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else isinstance(v, kind))
    if not ok:
        what = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}.get(kind, kind.__name__)
        raise HTTPError(400, f"'{name}': expected {what}, got {json.dumps(v)[:80]}", param=name)
    if kind is float:
        v = float(v)
        if v != v or v in (float("inf"), float("-inf")):
            raise HTTPError(400, f"'{name}': expected a finite number", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise HTTPError(400, f"'{name}': {v} is out of range (expected {rng})", param=name)
    return v


def sampling_args(body: dict, vocab: int, default_max: int) -> dict:
    for name in ("frequency_penalty", "presence_penalty"):
        if _field(body, name, float, 0.0) != 0.0:
            raise HTTPError(400, f"'{name}': not supported (only 0)", param=name)
    if _field(body, "n", int, 1) != 1:
        raise HTTPError(400, "'n': only n=1 is supported", param="n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise HTTPError(400, "'logprobs': not supported", param="logprobs")
    if body.get("echo") not in (None, False):
        raise HTTPError(400, "'echo': not supported", param="echo")
    mt = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise HTTPError(400, "'stop': expected a string or a list of at most 16 strings", param="stop")
    seed = _field(body, "seed", int, None, -(1 << 63), (1 << 63) - 1)
    return dict(max_new_tokens=_field(body, mt, int, default_max, 0, None),
                temperature=_field(body, "temperature", float, 1.0, 0.0, 2.0),
                top_p=_field(body, "top_p", float, 1.0, 0.0, 1.0),
                top_k=_field(body, "top_k", int, 0, 0, vocab),
                seed=seed if seed is not None else secrets.randbits(63),
                stop=stop)


# ----------------------------------------------------------------------------- the app
class Server:
    def __init__(self, engine, model_name: str = "", api_key: str = "", max_queue: int = 64):
        self.engine = engine
        self.sched = engine.scheduler
        self.sched.max_queue = max_queue
        self.model_name = model_name or _default_name(engine.path)
        self.api_key = api_key
        self.created = int(time.time())
        self.stop = threading.Event()
        self.draining = False
        self.thread = None
        self._metrics()
        self.app = self._app()

    # ------------------------------------------------------------------ the engine thread
    def start_engine(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="glm-jax-engine", daemon=True)
            self.thread.start()

    def _loop(self):
        try:
            self.sched.serve_forever(self.stop)
        except BaseException as e:       # never leave clients hanging: fail what is left
            print(f"glm-jax-serve: engine thread stopped: {_one_line(e)}", file=sys.stderr)
            for r in list(self.sched.queue) + [r for r in self.sched.rows if r is not None]:
                self.sched._fail(r, e)

    def stop_engine(self):
        self.stop.set()
        with self.sched.lock:
            self.sched.lock.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=30)

    # ------------------------------------------------------------------ metrics
    def _metrics(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        s = self.sched
        self.m_requests = Counter("glmjax_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                  registry=r)
        self.m_prompt = Counter("glmjax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.m_gen = Counter("glmjax_generated_tokens", "Generated tokens", registry=r)
        self.m_ttft = Histogram("glmjax_time_to_first_token_seconds", "Submit to first token", registry=r,
                                buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        Gauge("glmjax_queue_depth", "Requests waiting for a row", registry=r).set_function(lambda: s.waiting)
        Gauge("glmjax_running_requests", "Rows in use (the running batch)", registry=r).set_function(
            lambda: s.running)
        Gauge("glmjax_max_batch", "Rows of the scheduler", registry=r).set(s.B)
        self._rate = [time.perf_counter(), 0]

        def tok_s():
            now, n = time.perf_counter(), s.counters["tokens"]
            t0, n0 = self._rate
            self._rate = [now, n]
            return (n - n0) / (now - t0) if now > t0 else 0.0

        Gauge("glmjax_generated_tokens_per_second", "Generated tokens per second since the previous scrape",
              registry=r).set_function(tok_s)
        eng = self.engine

        def store(key, default=0.0):
            def f():
                if eng.store is None:
                    return default
                return float(eng.store.stats().get(key, default))
            return f

        Gauge("glmjax_expert_bytes_read", "Bytes the expert store has read (since start)", registry=r).set_function(
            store("bytes_read"))
        Gauge("glmjax_expert_hit_rate", "Expert cache hit rate (since start)", registry=r).set_function(
            store("hit_rate", 1.0))
        Gauge("glmjax_experts_dropped", "Experts dropped by the routing plugins (since start)",
              registry=r).set_function(lambda: float(eng._route_acc.get("dropped", 0.0)))

        def mtp():
            p = s.counters["drafts_proposed"]
            return s.counters["drafts_accepted"] / p if p else 0.0

        Gauge("glmjax_mtp_acceptance", "Accepted / proposed draft tokens (since start)", registry=r).set_function(mtp)

    # ------------------------------------------------------------------ handlers
    def _app(self):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        server = self

        def err(e: HTTPError, endpoint: str):
            server.m_requests.labels(endpoint, str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)

        def auth(request: Request):
            if server.api_key:
                h = request.headers.get("authorization", "")
                if not (h.startswith("Bearer ") and secrets.compare_digest(h[7:].strip(), server.api_key)):
                    raise HTTPError(401, "invalid API key (send 'Authorization: Bearer KEY')", code="invalid_api_key",
                                    type_="authentication_error")

        async def body_of(request: Request) -> dict:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise HTTPError(400, f"request body is not valid JSON ({_one_line(e)})")
            if not isinstance(body, dict):
                raise HTTPError(400, "request body must be a JSON object")
            m = body.get("model")
            if m is not None and m != server.model_name:
                raise HTTPError(400, f"unknown model {json.dumps(m)[:80]} (this server serves "
                                     f"{json.dumps(server.model_name)})", param="model", code="model_not_found")
            if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
                raise HTTPError(400, "'stream': expected a boolean", param="stream")
            return body

        async def health(request):
            return JSONResponse({"status": "draining" if server.draining else "ok",
                                 "running": server.sched.running, "waiting": server.sched.waiting})

        async def models(request):
            try:
                auth(request)
            except HTTPError as e:
                return err(e, "models")
            server.m_requests.labels("models", "200").inc()
            return JSONResponse({"object": "list", "data": [
                {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "glm-jax"}]})

        async def metrics(request):
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            try:
                auth(request)
            except HTTPError as e:
                return err(e, "metrics")
            return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

        async def completions(request):
            return await server._generate(request, chat=False, err=err, auth=auth, body_of=body_of)

        async def chat_completions(request):
            return await server._generate(request, chat=True, err=err, auth=auth, body_of=body_of)

        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app):
            server.start_engine()
            try:
                yield
            finally:
                server.draining = True
                server.stop_engine()

        return Starlette(routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ], lifespan=lifespan)

    def _prompt(self, body: dict, chat: bool):
        eng = self.engine
        if chat:
            msgs = body.get("messages")
            if msgs is None:
                raise HTTPError(400, "'messages': required", param="messages")
            try:
                from . import chat as C

                msgs = C.check_messages(msgs, "messages")
            except GlmJaxError as e:
                raise HTTPError(400, _one_line(e), param="messages")
            return msgs
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise HTTPError(400, "'prompt': empty", param="prompt")
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            V = eng.cfg.vocab_size
            bad = [t for t in p if not 0 <= t < V]
            if bad:
                raise HTTPError(400, f"'prompt': token id {bad[0]} outside the vocabulary [0, {V})", param="prompt")
            return p
        raise HTTPError(400, "'prompt': expected a string or a list of token ids (one prompt)", param="prompt")

    async def _generate(self, request, chat: bool, err, auth, body_of):
        from starlette.responses import JSONResponse

        endpoint = "chat_completions" if chat else "completions"
        eng, sched = self.engine, self.sched
        try:
            auth(request)
            if self.draining:
                raise HTTPError(503, "the server is shutting down", type_="server_error")
            body = await body_of(request)
            prompt = self._prompt(body, chat)
            args = sampling_args(body, eng.cfg.vocab_size, default_max=16 if not chat else 1 << 30)
            stream = bool(body.get("stream") or False)
            so = body.get("stream_options")
            if so is not None and not isinstance(so, dict):
                raise HTTPError(400, "'stream_options': expected an object", param="stream_options")
            include_usage = bool((so or {}).get("include_usage", False))
            loop = asyncio.get_running_loop()
            q: asyncio.Queue = asyncio.Queue()

            def on_event(req, text, toks, done):
                loop.call_soon_threadsafe(q.put_nowait, (text, len(toks), done))

            try:
                req = eng.request(prompt, chat=chat, on_event=on_event, where=endpoint, **args)
                limit = eng.context_limit
                req.sampling.max_new_tokens = min(req.sampling.max_new_tokens, max(0, limit - len(req.prompt)))
                sched.submit(req)
            except GlmJaxError as e:
                from .scheduler import QueueFull

                if isinstance(e, QueueFull):
                    raise HTTPError(429, _one_line(e), code="queue_full", type_="rate_limit_error")
                code = "context_length_exceeded" if "context limit" in str(e) else None
                raise HTTPError(400, _one_line(e), param="messages" if chat else "prompt", code=code)
        except HTTPError as e:
            return err(e, endpoint)
        self.m_prompt.inc(len(req.prompt))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage():
            return {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.out),
                    "total_tokens": len(req.prompt) + len(req.out),
                    "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}

        def finished():
            if req.t_first is not None and not getattr(req, "_ttft_seen", False):
                req._ttft_seen = True
                self.m_ttft.observe(req.t_first - req.t_submit)

        if not stream:
            try:
                while True:
                    try:
                        text, n, done = await asyncio.wait_for(q.get(), timeout=0.25)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            sched.cancel(req)
                            self.m_requests.labels(endpoint, "499").inc()
                            return JSONResponse({}, status_code=499)
                        continue
                    if done:
                        break
            except asyncio.CancelledError:
                sched.cancel(req)
                raise
            finished()
            if req.error is not None:
                self.m_requests.labels(endpoint, "500").inc()
                return JSONResponse(HTTPError(500, _one_line(req.error), type_="server_error").body(), status_code=500)
            self.m_gen.inc(len(req.out))
            self.m_requests.labels(endpoint, "200").inc()
            reason = req.finish_reason
            choice = ({"index": 0, "message": {"role": "assistant", "content": req.text}, "finish_reason": reason,
                       "logprobs": None} if chat else
                      {"index": 0, "text": req.text, "finish_reason": reason, "logprobs": None})
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                 "choices": [choice], "usage": usage(), "system_fingerprint": None})

        from sse_starlette.sse import AppStatus, EventSourceResponse

        # SIGTERM drains: uvicorn stops accepting and waits for the open responses, and our streams end when their
        # generation ends, so sse-starlette must not cut them at shutdown (its default)
        AppStatus.disable_automatic_graceful_drain()

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text=None, reason=None, role=False):
            if chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                ch = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                ch = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            d = {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name, "choices": [ch]}
            if include_usage:
                d["usage"] = None
            return json.dumps(d)

        async def events():
            ok = False
            try:
                if chat:
                    yield {"data": chunk("", role=True)}
                while True:
                    text, n, done = await q.get()
                    if text:
                        yield {"data": chunk(text)}
                    if done:
                        break
                finished()
                if req.error is not None:
                    yield {"data": json.dumps(HTTPError(500, _one_line(req.error), type_="server_error").body())}
                else:
                    yield {"data": chunk(None if chat else "", reason=req.finish_reason)}
                    if include_usage:
                        yield {"data": json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                                   "model": self.model_name, "choices": [], "usage": usage()})}
                self.m_gen.inc(len(req.out))
                yield {"data": "[DONE]"}
                ok = req.error is None
            finally:
                if not req.done:          # the client went away: free the row
                    sched.cancel(req)
                self.m_requests.labels(endpoint, "200" if ok else ("500" if req.error else "499")).inc()

        return EventSourceResponse(events(), ping=15)


def _default_name(path: str) -> str:
    from .engine import default_model_path

    if os.path.abspath(path) == os.path.abspath(default_model_path()):
        return "glm-jax-default"
    return os.path.basename(os.path.normpath(path))


# ----------------------------------------------------------------------------- the command
def help_text() -> str:
    return O.command_help(
        FLAGS, ["glm-jax-serve: an OpenAI-compatible server (chat and text completions, streaming, /metrics) with "
                "continuous batching.", "",
                "usage: glm-jax-serve [--model=DIR] [--host=127.0.0.1] [--port=8000] [--max_batch=8] [flags]", ""],
        O.main_flag_names(MAIN_FLAGS), "glm-jax-serve --helpfull documents every flag (the engine options are glm-jax's).")


def parse_flags(argv):
    return O.parse_command_flags(FLAGS, argv, "glm-jax-serve", help_text)


def main(argv):
    from absl import logging

    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    engine = None
    try:
        if len(argv) > 1:
            raise GlmJaxError(f"unexpected arguments: {' '.join(argv[1:])} (flags are --name=value)")
        opts = O.from_flags()
        if not FLAGS["max_batch"].present:
            opts["max_batch"] = SERVE_MAX_BATCH
        from .engine import Engine

        engine = Engine.from_options(FLAGS.model or None, opts)
        import socket

        import uvicorn

        srv = Server(engine, FLAGS.served_model_name, FLAGS.api_key, FLAGS.max_queue)
        sock = socket.socket(socket.AF_INET6 if ":" in FLAGS.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((FLAGS.host, FLAGS.port))
        except OSError as e:
            raise GlmJaxError(f"--host={FLAGS.host} --port={FLAGS.port}: cannot listen ({e.strerror or e})") from None
        port = sock.getsockname()[1]
        print(f"glm-jax-serve: serving {srv.model_name} on http://{FLAGS.host}:{port}/v1 "
              f"(max_batch {engine.opts['max_batch']}, {engine.opts['fetch']})", file=sys.stderr, flush=True)
        cfg = uvicorn.Config(srv.app, log_level="warning", timeout_graceful_shutdown=600)
        _DrainingServer(cfg).run(sockets=[sock])
    except GlmJaxError as e:
        print(f"glm-jax-serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    finally:
        if engine is not None:
            engine.close()
    return 0


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """SIGTERM / SIGINT: stop accepting, let the open requests finish (uvicorn's graceful shutdown), close the
        engine, exit 0 -- uvicorn would re-raise the signal after its shutdown and the process would die of it."""

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return DrainingServer


def _DrainingServer(cfg):
    return _draining_server_class()(cfg)


def run():
    FLAGS.set_default("max_batch", SERVE_MAX_BATCH)
    absl_app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()

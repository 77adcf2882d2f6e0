"""`glm-jax-serve`: an OpenAI-compatible HTTP server (starlette + uvicorn, SSE through sse-starlette, Prometheus
metrics through prometheus-client) over the engine's continuous-batching scheduler (glm_jax/runtime/scheduler.py).

Endpoints: POST /v1/chat/completions, POST /v1/completions (``stream`` true/false; SSE chunks end with
``data: [DONE]``), GET /v1/models, GET /health, GET /metrics.  One engine thread drives the scheduler; request
handlers submit ``Request``s to it and receive their tokens through an asyncio queue.  Errors are OpenAI-style JSON
bodies ``{"error": {"message", "type", "param", "code"}}``: 400 for bad JSON / fields / an unknown model / a prompt
beyond the context, or one the memory plan refuses (code ``insufficient_memory``: its K/V growth and compile do not
fit the RAM budget, Engine.memory_guard), 401 for a wrong API key, 429 when ``--max_queue`` requests are waiting, 503 while draining.
A client that disconnects has its request cancelled; its row is freed before the next decode dispatch.
SIGTERM: uvicorn stops accepting connections, in-flight requests finish, then the engine closes and the process
exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import threading
import time

from absl import app as absl_app
from absl import flags

from .. import chat as C
from .. import options as O
from ..engine import Engine, default_model_path
from ..errors import GlmJaxError
from ..experts.store import RamBudgetError
from ..runtime.scheduler import QueueFull
from . import replies, responses, tenancy
from .constrain import Processor, calls_or_json_grammar, json_schema_grammar, tool_call_grammar
from .http import HTTPError, memory_refusal

FLAGS = flags.FLAGS

O.define_model_flag()
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (127.0.0.1: this machine only).")
flags.DEFINE_integer("port", 8000, "TCP port (0: any free port, printed at start).", lower_bound=0, upper_bound=65535)
flags.DEFINE_string("api_key", "", "If set, every /v1 request and /metrics must send 'Authorization: Bearer KEY'. "
                    "Visible to every local user in /proc/PID/cmdline: prefer --api_key_file or $GLM_JAX_API_KEY.")
flags.DEFINE_string("api_key_file", "", "A file of API keys, one a line (mode 600; each key its own prefix-cache "
                    "tenant); with --api_key and $GLM_JAX_API_KEY every key given is accepted.")
flags.DEFINE_integer("max_queue", 64, "Requests that may wait for a free row; beyond it: HTTP 429 (0 = no limit).",
                     lower_bound=0)
flags.DEFINE_string("served_model_name", "", "The model id clients send and /v1/models lists (default: the model "
                    "directory's name, 'glm-jax-default' for the embedded model).")
O.define_flags()
O.define_serve_flags()
SERVE_MAX_BATCH = 8          # --max_batch's default here (the option table's default, 1, is glm-jax's)

MAIN_FLAGS = ("model", "host", "port", "api_key", "max_batch", "prefill_chunk", "max_queue", "served_model_name",
              "max_body_mb")
LOG = logging.getLogger("glm_jax.server")


_one_line = O.one_line
_memory_refusal = memory_refusal


# ----------------------------------------------------------------------------- request parameters
def _field(body: dict, name: str, kind, default=None, lo=None, hi=None, nullable=True, lo_open=False):
    """body[name] checked: kind int | float | bool | str; ranges inclusive (``lo_open``: lo excluded).  400 naming
    the field otherwise."""
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
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f"{'>' if lo_open else '>='} {lo}"
        raise HTTPError(400, f"'{name}': {v} is out of range (expected {rng})", param=name)
    return v


# the request fields each endpoint takes (anything else with a value is a 400 naming it, never ignored)
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "n", "seed",
                 "stop", "logit_bias", "logprobs", "user", "frequency_penalty", "presence_penalty", "cache_salt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "response_format"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
MAX_N = 16
MAX_PROMPTS = 16          # completions: prompts in one request


def check_fields(body: dict, chat: bool):
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for k, v in body.items():
        if k not in known and v is not None:
            where = "chat completions" if chat else "completions"
            raise HTTPError(400, f"'{k}': not supported by this server's {where}", param=k)


def sampling_args(body: dict, vocab: int, default_max: int) -> dict:
    for name in ("frequency_penalty", "presence_penalty"):
        if _field(body, name, float, 0.0) != 0.0:
            raise HTTPError(400, f"'{name}': not supported (only 0)", param=name)
    n = _field(body, "n", int, 1, 1, MAX_N)
    if _field(body, "best_of", int, n) != n:
        raise HTTPError(400, "'best_of': not supported (only equal to n)", param="best_of")
    if body.get("echo") is not None and not isinstance(body["echo"], bool):
        raise HTTPError(400, "'echo': expected a boolean", param="echo")
    if body.get("echo") and body.get("logprobs") is not None:
        raise HTTPError(400, "'echo': not supported with 'logprobs' (no prompt logprobs)", param="echo")
    if body.get("suffix") not in (None, ""):
        raise HTTPError(400, "'suffix': not supported", param="suffix")
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
                top_p=_field(body, "top_p", float, 1.0, 0.0, 1.0, lo_open=True),
                top_k=_field(body, "top_k", int, 0, 0, vocab),
                seed=seed if seed is not None else secrets.randbits(63),
                stop=stop)


def logit_bias_arg(body: dict, vocab: int):
    """``logit_bias``: {"token id": bias in [-100, 100]} -> {int: float}, or None."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise HTTPError(400, "'logit_bias': expected an object {\"token id\": bias}", param="logit_bias")
    if len(lb) > vocab:
        raise HTTPError(400, f"'logit_bias': {len(lb)} entries, more than the vocabulary's {vocab} tokens",
                        param="logit_bias")
    out = {}
    for k, v in lb.items():
        try:
            t = int(k)
        except ValueError:
            t = None
        if t is None or not 0 <= t < vocab or str(t) != k.strip():
            raise HTTPError(400, f"'logit_bias': key {json.dumps(k)[:40]} is not a token id in [0, {vocab})",
                            param="logit_bias")
        out[t] = _field({"logit_bias": v}, "logit_bias", float, 0.0, -100.0, 100.0)
    return out or None


def logprobs_arg(body: dict, chat: bool):
    """How many top logprobs per token (0: only the sampled token's), or None (off).  Chat: ``logprobs`` true and
    ``top_logprobs`` 0..20; completions: ``logprobs`` 0..5."""
    if chat:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise HTTPError(400, "'logprobs': expected a boolean", param="logprobs")
        k = _field(body, "top_logprobs", int, None, 0, 20)
        if k is not None and not on:
            raise HTTPError(400, "'top_logprobs': needs 'logprobs': true", param="top_logprobs")
        return (k or 0) if on else None
    return _field(body, "logprobs", int, None, 0, 5)


def tools_arg(body: dict):
    """(tools, choice): tools a checked list of OpenAI function tools (or None); choice "none" | "auto" |
    "required" | a function name."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list) or not tools or len(tools) > 128:
            raise HTTPError(400, "'tools': expected a non-empty list of at most 128 tools", param="tools")
        names = set()
        for i, t in enumerate(tools):
            f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] or \
                    not all(c.isalnum() or c in "_-." for c in f["name"]):
                raise HTTPError(400, f"'tools[{i}]': expected {{\"type\": \"function\", \"function\": {{\"name\": "
                                     f"letters, digits, _ - ., \"parameters\": a JSON schema}}}}", param="tools")
            p = f.get("parameters")
            if p is not None and (not isinstance(p, dict) or not isinstance(p.get("properties", {}), dict)):
                raise HTTPError(400, f"'tools[{i}].function.parameters': expected a JSON schema object",
                                param="tools")
            if f.get("strict") not in (None, True, False):
                raise HTTPError(400, f"'tools[{i}].function.strict': expected a boolean", param="tools")
            names.add(f["name"])
    if choice is None:
        return tools, ("auto" if tools else "none")
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        name = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        if tools is None or name not in names:
            raise HTTPError(400, f"'tool_choice': no tool named {json.dumps(name)[:80]} in 'tools'",
                            param="tool_choice")
        return tools, {"name": name}
    else:
        raise HTTPError(400, "'tool_choice': expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", param="tool_choice")
    if name != "none" and tools is None:
        raise HTTPError(400, f"'tool_choice': {name} needs 'tools'", param="tool_choice")
    return tools, name


def response_format_arg(body: dict):
    """(the JSON schema ``response_format`` asks for ({"type": "object"} for json_object) or None (text), strict)."""
    rf = body.get("response_format")
    if rf is None:
        return None, False
    t = rf.get("type") if isinstance(rf, dict) else None
    if t == "text":
        return None, False
    if t == "json_object":
        return {"type": "object"}, False
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict) or \
                js.get("strict") not in (None, True, False):
            raise HTTPError(400, "'response_format.json_schema': expected {\"name\", \"schema\": {...}, "
                                 "\"strict\": a boolean}", param="response_format")
        return js.get("schema") or {}, js.get("strict") is True
    raise HTTPError(400, "'response_format': expected type text, json_object or json_schema",
                    param="response_format")


def stream_args(body: dict):
    """(stream, include_usage)."""
    stream = bool(body.get("stream") or False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise HTTPError(400, "'stream_options': expected an object", param="stream_options")
    include_usage = (so or {}).get("include_usage", False)
    if include_usage is not None and not isinstance(include_usage, bool):
        raise HTTPError(400, f"'stream_options.include_usage': expected a boolean (true or false), got "
                             f"{json.dumps(include_usage)[:80]}", param="stream_options.include_usage")
    return stream, bool(include_usage)


class _Grammar:
    """A constraint as a function of the tokens the request may generate (the grammar fits them), with the
    field a failure names."""

    def __init__(self, fn, param: str):
        self.fn, self.param, self.built = fn, param, {}

    def __call__(self, budget: int) -> str:
        if budget not in self.built:         # n choices of one prompt: one build
            self.built[budget] = self.fn(budget)
        return self.built[budget]


def constraint_arg(body: dict, tools, choice, marker, compact: bool = False):
    """The grammar response_format or tool_choice (required / a named function) asks for, or None."""
    schema, strict = response_format_arg(body)
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise HTTPError(400, "'parallel_tool_calls': expected a boolean", param="parallel_tool_calls")
    forced = choice == "required" or isinstance(choice, dict)
    # a forced tool choice wins over a response format (its shape still checked above): that turn is the call(s)
    # and has no text for the format to shape (agent libraries send both on an agent's first turn)
    multiple = body.get("parallel_tool_calls") is not False
    if schema is not None and not forced and choice == "auto":       # an agent's turn: call its tools or answer
        g = _Grammar(lambda b: calls_or_json_grammar(tools, schema, strict, marker, multiple, b, compact),
                     "response_format")
    elif schema is not None and not forced:
        g = _Grammar(lambda b: json_schema_grammar(schema, b, strict), "response_format")
    elif forced:
        name = choice["name"] if isinstance(choice, dict) else None
        g = _Grammar(lambda b: tool_call_grammar(tools, name, marker=marker, multiple=multiple, budget=b,
                                                 compact=compact), "tools")
    else:
        return None
    return g                         # built for the first request, before it is submitted (Server._processor)


def rendered_bytes(messages: list, tools: list) -> int:
    """Bytes of every string a chat template renders of a request (message contents, tool calls' names and
    arguments, every string in the tools' definitions): a lower bound on the rendered prompt's size."""
    def strings(x) -> int:
        if isinstance(x, str):
            return len(x.encode("utf-8", "surrogatepass"))
        if isinstance(x, dict):
            return sum(strings(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(strings(v) for v in x)
        return 0
    return strings([(m.get("content"), m.get("tool_calls")) for m in messages]) + strings(tools)


def tenant_of(request):
    """The API key's index the request authenticated with (Server._auth), None without keys."""
    return getattr(request.state, "tenant", None)


def request_salt(body: dict, tenant, scope: str):
    try:
        return tenancy.cache_salt(body, tenant, scope)
    except GlmJaxError as e:
        raise HTTPError(400, _one_line(e), param="cache_salt") from None


def store_health(engine, body: dict):
    """(/health's body, status): a store whose last expert read failed (a truncated, corrupt or missing expert
    file) is "degraded" with HTTP 503 and the error, until a read succeeds again."""
    h = getattr(getattr(engine, "store", None), "health", None)
    if not isinstance(h, dict) or not h.get("errors"):
        return body, 200
    body["store"] = {"read_errors": h["errors"], "failing_fetches": h["consecutive"], "last_error": h["last"]}
    if h["consecutive"] and body["status"] == "ok":
        body["status"] = "degraded"
        return body, 503
    return body, 200


# ----------------------------------------------------------------------------- the app
class Server:
    def __init__(self, engine, model_name: str = "", api_key: str = "", max_queue: int = 64,
                 max_body_mb: float = O.SERVE_BY_NAME["max_body_mb"].default,
                 read_timeout_s: float = O.SERVE_BY_NAME["read_timeout_s"].default,
                 keep_alive_s: float = O.SERVE_BY_NAME["keep_alive_s"].default, warmup: bool = False,
                 prefix_cache_scope: str = O.SERVE_BY_NAME["prefix_cache_scope"].default):
        self.engine = engine
        self.loading = bool(warmup)          # the engine thread warms up first: /health and /v1 answer 503 till then
        self.sched = engine.scheduler
        self.sched.max_queue = max_queue
        self.sched.kv_reserve = engine.kv_reserve_tokens  # the planned K/V, allocated at the first request
        self.model_name = model_name or _default_name(engine.path)
        self.keys = tenancy.Keys(api_key)                # a key or a list of them; each a prefix-cache tenant
        self.prefix_cache_scope = prefix_cache_scope
        self.max_body = int(max_body_mb * (1 << 20))
        self.read_timeout_s = float(read_timeout_s)
        self.keep_alive_s = float(keep_alive_s)
        self._max_token_bytes = _max_token_bytes(engine)
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
            if self.loading:
                try:
                    comp, wall = self.sched.warmup()
                finally:
                    self.loading = False
                print(f"glm-jax-serve: warm-up {wall:.1f} s ({comp:.1f} s compiling; --nowarmup skips it); ready",
                      file=sys.stderr, flush=True)
            self.sched.serve_forever(self.stop)
        except BaseException as e:       # never leave clients hanging: fail what is left
            print(f"glm-jax-serve: engine thread stopped: {_one_line(e)}", file=sys.stderr)
            for r in list(self.sched.queue) + [r for r in self.sched.rows if r is not None]:
                self.sched._fail(r, e)

    def uvicorn_config(self, **kw):
        """uvicorn's Config for this app: the h11 protocol with --read_timeout_s (a request whose headers or body
        never finish is closed), --keep_alive_s, bounded header size."""
        import uvicorn

        kw.setdefault("log_level", "warning")
        return uvicorn.Config(self.app, http=_timed_h11(self.read_timeout_s), timeout_keep_alive=self.keep_alive_s,
                              h11_max_incomplete_event_size=64 * 1024, **kw)

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
        Gauge("glmjax_prefix_store_bytes", "Host RAM held by the prefix store (--prefix_store_mb)",
              registry=r).set_function(lambda: s.saved.bytes if s.saved is not None else 0)
        Gauge("glmjax_prefix_store_hits", "Requests whose prefix came back from the prefix store (since start)",
              registry=r).set_function(lambda: s.saved.counters["restored"] if s.saved is not None else 0)
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
        Gauge("glmjax_compile_seconds", "Seconds spent compiling XLA programs since start (the warm-up's included): "
              "a rise while serving is a request waiting for a program", registry=r).set_function(
            lambda: float(s.rt.compile_s))

    # ------------------------------------------------------------------ handlers
    def _app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException as StarletteHTTPException
        from starlette.requests import ClientDisconnect, Request
        from starlette.responses import Response
        from starlette.routing import Route

        server = self

        def handler(endpoint: str, fn, needs_auth: bool = True):
            """Every handler: its HTTPError as an OpenAI-style JSON error; any other exception a JSON 500, counted in
            /metrics and logged with its traceback."""
            async def h(request: Request):
                try:
                    if needs_auth:
                        server._auth(request)
                    return await fn(request)
                except HTTPError as e:
                    return server._err(e, endpoint)
                except ClientDisconnect:
                    server.m_requests.labels(endpoint, "499").inc()
                    return Response(status_code=499)
                except Exception as e:
                    return server.internal_error(endpoint, e)
            return h

        async def http_error(request, exc):         # starlette's own 404 / 405: OpenAI-style JSON too
            status = getattr(exc, "status_code", 500)
            e = HTTPError(status, f"{request.method} {request.url.path}: {exc.detail}",
                          type_="invalid_request_error" if status < 500 else "server_error")
            return server._err(e, "other")

        async def unexpected(request, exc):          # outside every handler (middleware, routing)
            return server.internal_error("other", exc)

        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app):
            server.start_engine()
            try:
                yield
            finally:
                server.draining = True
                server.stop_engine()

        routes = [Route(path, handler(name, fn, needs_auth=name != "health"), methods=[method])
                  for path, name, method, fn in self._endpoints()]
        return Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={StarletteHTTPException: http_error, Exception: unexpected})

    def _endpoints(self) -> list:
        """(path, endpoint name, method, async handler) of every route."""
        from starlette.responses import JSONResponse, Response

        server = self

        async def health(request):
            if server.loading:               # llama-server's answer while it loads
                return JSONResponse({"status": "loading"}, status_code=503)
            return JSONResponse(*store_health(server.engine, {"status": "draining" if server.draining else "ok",
                                                              "running": server.sched.running,
                                                              "waiting": server.sched.waiting}))

        async def models(request):
            server.m_requests.labels("models", "200").inc()
            return JSONResponse({"object": "list", "data": [server.model_card()]})

        async def model(request):
            mid = request.path_params["model_id"]
            if mid != server.model_name:
                raise server.unknown_model(mid)
            server.m_requests.labels("models", "200").inc()
            return JSONResponse(server.model_card())

        async def metrics(request):
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

        async def completions(request):
            return await server._generate(request, chat=False, raw_body=server._raw_body)

        async def chat_completions(request):
            return await server._generate(request, chat=True, raw_body=server._raw_body)

        async def respond(request):
            return await responses.respond(server, request)

        return [("/health", "health", "GET", health), ("/v1/models", "models", "GET", models),
                ("/v1/models/{model_id:path}", "models", "GET", model), ("/metrics", "metrics", "GET", metrics),
                ("/v1/completions", "completions", "POST", completions),
                ("/v1/chat/completions", "chat_completions", "POST", chat_completions),
                ("/v1/responses", "responses", "POST", respond)]

    def _err(self, e: HTTPError, endpoint: str):
        from starlette.responses import JSONResponse

        self.m_requests.labels(endpoint, str(e.status)).inc()
        LOG.info("glm-jax-serve: - %s status=%d error=%s", endpoint, e.status, e.message[:200])
        headers = {"Connection": "close"} if e.status == 413 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def _auth(self, request):
        if self.keys:
            h = request.headers.get("authorization", "").encode("latin-1")     # the header's bytes as sent
            request.state.tenant = self.keys.match(h)
            if request.state.tenant is None:
                raise HTTPError(401, "invalid API key (send 'Authorization: Bearer KEY')", code="invalid_api_key",
                                type_="authentication_error")

    async def _raw_body(self, request) -> bytes:
        """The body, refused with 413 past --max_body_mb before it is all read (Content-Length, or as it
        arrives)."""
        limit = self.max_body
        cl = request.headers.get("content-length")
        if cl is not None and cl.strip().isdigit() and int(cl) > limit:
            raise HTTPError(413, f"request body is {int(cl)} bytes, more than --max_body_mb "
                                 f"({limit / (1 << 20):g} MB)", code="request_too_large")
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise HTTPError(413, f"request body is more than --max_body_mb ({limit / (1 << 20):g} MB)",
                                code="request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    def check_ready(self):
        """503 while the server warms up or drains."""
        if self.loading:
            raise HTTPError(503, "the model is loading (warm-up); retry when /health answers 200", code="loading",
                            type_="server_error")
        if self.draining:
            raise HTTPError(503, "the server is shutting down", type_="server_error")

    def internal_error(self, endpoint: str, e: BaseException):
        from starlette.responses import JSONResponse

        LOG.error("glm-jax-serve: %s: internal error: %s", endpoint, _one_line(e), exc_info=e)
        self.m_requests.labels(endpoint, "500").inc()
        return JSONResponse(HTTPError(500, f"internal error: {_one_line(e)}", type_="server_error").body(),
                            status_code=500)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "glm-jax"}

    def unknown_model(self, m) -> HTTPError:
        return HTTPError(404, f"the model {json.dumps(m)[:80]} does not exist (this server serves "
                              f"{json.dumps(self.model_name)})", param="model", code="model_not_found")

    def parse_body(self, raw: bytes) -> dict:
        """The request's JSON object: 400 for invalid JSON, nesting too deep for the parser, invalid Unicode (a lone
        surrogate escaped as \\ud800), a non-object; 404 for another model."""
        try:
            body = json.loads(raw)
        except RecursionError:
            raise HTTPError(400, "request body: JSON nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"request body is not valid JSON ({_one_line(e)})") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            raise HTTPError(400, "request body: JSON nested too deeply") from None
        except UnicodeEncodeError as e:
            bad = e.object[e.start:e.end]
            raise HTTPError(400, f"request body: invalid Unicode (a lone surrogate "
                                 f"{ascii(bad)[1:-1]} in a string)") from None
        m = body.get("model")
        if m is not None and m != self.model_name:
            raise self.unknown_model(m)
        if "stream" in body and not isinstance(body["stream"], bool) and body["stream"] is not None:
            raise HTTPError(400, "'stream': expected a boolean", param="stream")
        return body

    def _prompt(self, body: dict, chat: bool):
        eng = self.engine
        if chat:
            msgs = body.get("messages")
            if msgs is None:
                raise HTTPError(400, "'messages': required", param="messages")
            try:
                msgs = C.check_messages(msgs, "messages")
            except GlmJaxError as e:
                raise HTTPError(400, _one_line(e), param="messages")
            self._check_size(sum(len(m["content"].encode("utf-8")) for m in msgs), "messages")
            return msgs
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):     # a list of prompts
            if len(p) > MAX_PROMPTS:
                raise HTTPError(400, f"'prompt': at most {MAX_PROMPTS} prompts in one request", param="prompt")
            return [self._one_prompt(x, f"prompt[{i}]") for i, x in enumerate(p)]
        return [self._one_prompt(p, "prompt")]

    def _one_prompt(self, p, where: str):
        eng = self.engine
        if isinstance(p, str):
            if not p:
                raise HTTPError(400, f"'{where}': empty", param="prompt")
            self._check_size(len(p.encode("utf-8")), "prompt")
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if len(p) >= eng.context_limit:
                raise HTTPError(400, f"'{where}': the prompt is {len(p)} tokens but the context limit is "
                                     f"{eng.context_limit} tokens", param="prompt", code="context_length_exceeded")
            V = eng.cfg.vocab_size
            bad = [t for t in p if not 0 <= t < V]
            if bad:
                raise HTTPError(400, f"'{where}': token id {bad[0]} outside the vocabulary [0, {V})", param="prompt")
            return p
        raise HTTPError(400, f"'{where}': expected a string or a list of token ids (or a list of those: one per "
                             f"prompt)", param="prompt")

    def _check_size(self, nbytes: int, param: str):
        """Refuse, before tokenizing it, a text that cannot fit the context: every token covers at most
        ``_max_token_bytes`` bytes of it (x4 for a tokenizer that normalizes), so it has at least that many tokens."""
        limit, per = self.engine.context_limit, self._max_token_bytes
        if per and nbytes > per * limit:
            raise HTTPError(400, f"'{param}': {nbytes} bytes of text are at least {nbytes // per} tokens but the "
                                 f"context limit is {limit} tokens", param=param, code="context_length_exceeded")

    async def _generate(self, request, chat: bool, raw_body):
        from starlette.concurrency import run_in_threadpool

        endpoint = "chat_completions" if chat else "completions"
        self.check_ready()
        raw = await raw_body(request)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        # JSON parsing, checks and tokenization in a worker thread: /health and the streams keep answering
        job = await run_in_threadpool(self._submit, raw, chat, endpoint, loop, q, tenant_of(request))
        return await replies.respond(self, request, job, q)

    def _submit(self, raw: bytes, chat: bool, endpoint: str, loop, q, tenant=None):
        """Parse and check a request, tokenize it, submit its generations.  Returns the job (a dict)."""
        body = self.parse_body(raw)
        check_fields(body, chat)
        return self.submit_body(body, chat, endpoint, loop, q, tenant=tenant)

    def submit_body(self, body: dict, chat: bool, endpoint: str, loop, q, prefix: str = "", tenant=None) -> dict:
        """Submit a checked request body's generations (a chat's n, or each completion prompt's n); the job's
        ``reqs`` in choice order."""
        eng = self.engine
        V = eng.cfg.vocab_size
        prompts = [self._prompt(body, chat)] if chat else self._prompt(body, chat)
        args = sampling_args(body, V, default_max=16 if not chat else 1 << 30)
        n = _field(body, "n", int, 1, 1, MAX_N)
        stream, include_usage = stream_args(body)
        bias = logit_bias_arg(body, V)
        top_lp = logprobs_arg(body, chat)
        tools, choice = tools_arg(body) if chat else (None, "none")
        salt = request_salt(body, tenant, self.prefix_cache_scope)
        if tools is not None:       # what the template renders of them counts, before anything is tokenized
            self._check_size(rendered_bytes(prompts[0], tools), "tools")
        compact = C.compact_tool_calls(getattr(eng.tokenizer, "template", None))     # GLM-4.7's call form
        grammar = constraint_arg(body, tools, choice, self._marker, compact) if chat else None
        if grammar is not None and eng.tokenizer is None:
            raise HTTPError(400, "constrained decoding needs the model's tokenizer.json",
                            param="response_format" if body.get("response_format") else "tool_choice")
        with_tools = chat and (tools is not None or any(m.get("tool_calls") for m in prompts[0]))
        if with_tools:          # rendered here: the template gets the tools (or they are written into the messages)
            try:
                prompts = [C.chat_ids(eng.tokenizer, eng.tokenizer.template, prompts[0], tools=tools)]
            except GlmJaxError as e:
                raise HTTPError(400, _one_line(e), param="messages") from None
        parse_tools = tools is not None      # tool_choice none: markup still kept out of content, calls dropped
        job = dict(chat=chat, endpoint=endpoint, stream=stream, include_usage=include_usage, top_lp=top_lp,
                   tools=tools, drop_calls=choice == "none", reqs=[], created=int(time.time()),
                   rid=(prefix or ("chatcmpl-" if chat else "cmpl-")) + secrets.token_hex(12),
                   grammar_param=getattr(grammar, "param", None),
                   check_calls=getattr(grammar, "param", None) != "tools")    # calls no grammar held to a schema
        self._start(job, prompts, n, args, dict(chat=chat and not with_tools, loop=loop, q=q, bias=bias,
                                                 grammar=grammar, parse_tools=parse_tools, salt=salt))
        if not chat and body.get("echo"):
            job["echo"] = [p if isinstance(p, str) else eng.decode(p) for p in prompts for _ in range(n)]
        job["prompt_tokens"] = sum(len(job["reqs"][k * n].prompt) for k in range(len(prompts)))
        return job

    def _start(self, job: dict, prompts: list, n: int, args: dict, how: dict):
        """Submit n requests per prompt (choice k*n + i: prompt k with the request's seed + i)."""
        eng, sched, reqs = self.engine, self.sched, job["reqs"]
        seed0 = args.pop("seed")
        grammar, loop, q = how["grammar"], how["loop"], how["q"]
        try:
            for k, prompt in enumerate(prompts):
                for i in range(n):
                    def on_event(req, text, toks, done, c=k * n + i):
                        loop.call_soon_threadsafe(q.put_nowait, (c, text, len(toks), done))

                    seed = (seed0 + i + (1 << 63)) % (1 << 64) - (1 << 63)     # choice i: the request's seed + i
                    req = eng.request(prompt, chat=how["chat"], on_event=on_event, where=job["endpoint"],
                                      seed=seed, **args)
                    limit = eng.context_limit
                    req.sampling.max_new_tokens = min(req.sampling.max_new_tokens,
                                                      max(0, limit - len(req.prompt)))
                    if how["bias"] or grammar is not None or job["top_lp"] is not None:
                        req.processor = self._processor(req, how["bias"], grammar, job["top_lp"])
                    if how["parse_tools"] and self._special_markers:
                        req.stream.decode = self._decode_keeping_markers
                    req.salt = how.get("salt")
                    sched.submit(req)
                    reqs.append(req)
        except GlmJaxError as e:
            for r in reqs:
                sched.cancel(r)
            if isinstance(e, QueueFull):
                raise HTTPError(429, _one_line(e), code="queue_full", type_="rate_limit_error")
            code = "context_length_exceeded" if "context limit" in str(e) else None
            raise HTTPError(400, _one_line(e), param="messages" if job["chat"] else "prompt", code=code)
        except BaseException:
            for r in reqs:
                sched.cancel(r)
            raise

    def _processor(self, req, bias, grammar, top_lp) -> Processor:
        """A request's logits processor; a grammar (a function of the tokens it may take) fits its max tokens."""
        eng = self.engine
        text = None
        if grammar is not None:
            try:
                text = grammar(req.sampling.max_new_tokens)
            except (GlmJaxError, ValueError, TypeError, AttributeError, KeyError, RecursionError) as e:
                raise HTTPError(400, f"invalid schema ({_one_line(e)})", param=grammar.param) from None
        try:
            return Processor(eng.cfg.vocab_size, bias=bias, grammar=text, tokenizer=eng.tokenizer,
                             eos_ids=eng.cfg.eos_token_ids, top_logprobs=top_lp)
        except GlmJaxError as e:
            raise HTTPError(400, _one_line(e), param=grammar.param if grammar else "logit_bias") from None

    # ------------------------------------------------------------------ tool-call markers as special tokens
    @property
    def _special_markers(self) -> dict:
        """{marker: token id} for the GLM tool-call markers the tokenizer has as special tokens (GLM-4.5 does)."""
        m = getattr(self, "_markers", None)
        if m is None:
            m = {}
            tok = self.engine.tokenizer
            if tok is not None:
                special = {t.content for t in tok.tok.get_added_tokens_decoder().values() if t.special}
                for s in (C.TOOL_CALL, C.TOOL_CALL_END, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"):
                    if s in special and tok.token_id(s) is not None:
                        m[s] = tok.token_id(s)
            self._markers = m
        return m

    def _marker(self, s: str) -> str:
        i = self._special_markers.get(s)
        return f"<[{i}]>" if i is not None else json.dumps(s)

    def _decode_keeping_markers(self, ids) -> str:
        eos = set(self.engine.cfg.eos_token_ids)
        return self.engine.tokenizer.tok.decode([i for i in ids if i not in eos], skip_special_tokens=False)

    # ------------------------------------------------------------------ responses
    def _logprobs(self, job, req, lo: int, hi: int):
        """The logprobs object of req's tokens [lo, hi) (OpenAI chat or completions shape), or None."""
        p = req.processor
        if job["top_lp"] is None or p is None or p.logprobs is None:
            return None
        dec = self.engine.decode
        ents = p.logprobs[lo:min(hi, len(req.out))]
        if job["chat"]:
            def one(t, lp):
                s = dec([t])
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            return {"content": [dict(one(t, lp), top_logprobs=[one(a, b) for a, b in top]) for t, lp, top in ents],
                    "refusal": None}
        toks = [dec([t]) for t, _, _ in ents]
        offs, o = [], len(dec(req.out[:lo])) if lo else 0
        for s in toks:
            offs.append(o)
            o += len(s)
        return {"tokens": toks, "token_logprobs": [lp for _, lp, _ in ents],
                "top_logprobs": [{dec([a]): b for a, b in top} for _, _, top in ents] if job["top_lp"] else None,
                "text_offset": offs}

    def _log(self, job, status: int):
        for i, req in enumerate(job["reqs"]):
            ttft = (req.t_first - req.t_submit) * 1000 if req.t_first else float("nan")
            dt = (req.t_done or time.perf_counter()) - (req.t_first or req.t_submit)
            rate = (len(req.out) - 1) / dt if len(req.out) > 1 and dt > 0 else 0.0
            LOG.info("glm-jax-serve: %s%s %s status=%d prompt_tokens=%d cached_tokens=%d generated_tokens=%d "
                     "ttft_ms=%.1f tok_s=%.1f finish_reason=%s", job["rid"], f"[{i}]" if len(job["reqs"]) > 1 else "",
                     job["endpoint"], status, len(req.prompt), int(getattr(req, "cached_tokens", 0) or 0),
                     len(req.out), ttft, rate, req.finish_reason)

    def _usage(self, job) -> dict:
        reqs = job["reqs"]
        p, c = job.get("prompt_tokens", len(reqs[0].prompt)), sum(len(r.out) for r in reqs)
        u = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        cached = getattr(reqs[0], "cached_tokens", None)
        if cached is not None:
            u["prompt_tokens_details"] = {"cached_tokens": int(cached)}
        return u

    def _observe(self, job):
        for req in job["reqs"]:
            if req.t_first is not None and not getattr(req, "_ttft_seen", False):
                req._ttft_seen = True
                self.m_ttft.observe(req.t_first - req.t_submit)


def _max_token_bytes(engine) -> int:
    """The most UTF-8 bytes of text one token can stand for (an upper bound: a vocabulary entry's own UTF-8 length,
    x4 when the tokenizer has a normalizer, which may shrink the text); 0 without a tokenizer."""
    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        return 0
    vocab = tok.tok.get_vocab(with_added_tokens=True)
    per = max((len(k.encode("utf-8")) for k in vocab), default=0)
    return per * (4 if tok.tok.normalizer is not None else 1)


def _timed_h11(read_timeout_s: float):
    """uvicorn's h11 protocol with a read timeout: a connection whose request has not fully arrived (headers and
    body: h11's client state still IDLE or SEND_BODY) ``read_timeout_s`` after it opened or after its previous
    response is closed.  uvicorn itself only times out idle keep-alive connections, so a client that never
    finishes its headers would hold its connection (and its buffers) forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _read_timer = None

        def _arm_read_timer(self):
            if self._read_timer is None:
                self._read_timer = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _disarm_read_timer(self):
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self):
            self._read_timer = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                LOG.warning("glm-jax-serve: closed a connection from %s whose request did not arrive within "
                            "--read_timeout_s=%g", self.client, read_timeout_s)
                self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_read_timer()

        def data_received(self, data):
            super().data_received(data)
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm_read_timer()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_read_timer()

        def connection_lost(self, exc):
            self._disarm_read_timer()
            super().connection_lost(exc)

    return TimedH11Protocol


def _default_name(path: str) -> str:
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
    from absl import logging as absl_logging

    if not FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)
    engine = None
    try:
        if len(argv) > 1:
            raise GlmJaxError(f"unexpected arguments: {' '.join(argv[1:])} (flags are --name=value)")
        opts = O.from_flags()
        limits = O.serve_from_flags()
        if not FLAGS["max_batch"].present:      # the memory plan may lower it (fit.plan_rows); a given one stays
            opts.set_auto("max_batch", SERVE_MAX_BATCH)
        keys, warn = tenancy.api_keys(FLAGS.api_key, FLAGS.api_key_file)
        if warn:
            print(f"glm-jax-serve: warning: {warn}", file=sys.stderr, flush=True)
        engine = Engine.from_options(FLAGS.model or None, opts)
        import socket

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        LOG.addHandler(handler)
        LOG.setLevel(logging.INFO)
        LOG.propagate = False
        warmup = limits.pop("warmup")
        srv = Server(engine, FLAGS.served_model_name, keys, FLAGS.max_queue, warmup=warmup, **limits)
        sock = socket.socket(socket.AF_INET6 if ":" in FLAGS.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((FLAGS.host, FLAGS.port))
        except OSError as e:
            raise GlmJaxError(f"--host={FLAGS.host} --port={FLAGS.port}: cannot listen ({e.strerror or e})") from None
        port = sock.getsockname()[1]
        print(f"glm-jax-serve: serving {srv.model_name} on http://{FLAGS.host}:{port}/v1 "
              f"(max_batch {engine.opts['max_batch']}, {engine.opts['fetch']})" +
              ("; warming up: /health answers 503 until ready" if warmup else ""), file=sys.stderr, flush=True)
        cfg = srv.uvicorn_config(timeout_graceful_shutdown=600)
        _DrainingServer(cfg).run(sockets=[sock])
    except GlmJaxError as e:
        print(f"glm-jax-serve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:           # Ctrl-C while loading (serving drains on it instead)
        print("\nglm-jax-serve: interrupted", file=sys.stderr)
        return 130
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
    try:
        absl_app.run(main, flags_parser=parse_flags)
    except KeyboardInterrupt:
        print("\nglm-jax-serve: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run()

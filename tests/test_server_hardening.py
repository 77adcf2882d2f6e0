"""glm-jax-serve under hostile input (issue 22 items 4, 5, 7): request limits (--max_body_mb -> 413 before the body
is read, --read_timeout_s closing half-open connections, a prompt beyond the context refused before tokenizing),
parsing and tokenization off the event loop (/health answers meanwhile), never a 500 for an input error (lone
surrogates, deep JSON, non-ASCII keys), an unexpected error a counted JSON 500; and hypothesis-generated bodies
against every endpoint: never a 500, never a hang, /health answering in between.  One engine and one server (small
limits: 1 MB bodies, 2 s read timeout) for the module."""

import json
import socket
import threading
import time

import httpx
import pytest
import serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import glm_jax

KEY = "test-key"
READ_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def eng():
    e = glm_jax.Engine.load(max_batch=2, prefill_chunk=16)
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(eng):
    from glm_jax.serve.app import Server

    srv = Server(eng, api_key=KEY, max_queue=16, max_body_mb=1.0, read_timeout_s=READ_TIMEOUT)
    with serving.running(srv):
        yield srv


H = {"Authorization": f"Bearer {KEY}"}


def _post(server, path, body=None, raw=None, headers=H, timeout=60):
    if raw is not None:
        return httpx.post(server.base + path, content=raw, headers={**headers, "Content-Type": "application/json"},
                          timeout=timeout)
    return httpx.post(server.base + path, json=body, headers=headers, timeout=timeout)


def _health_ms(server) -> float:
    t0 = time.perf_counter()
    r = httpx.get(server.base + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    return (time.perf_counter() - t0) * 1000


def _requests_total(server, endpoint, status) -> float:
    m = httpx.get(server.base + "/metrics", headers=H, timeout=10).text
    key = f'glmjax_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    for line in m.splitlines():
        if line.startswith(key):
            return float(line[len(key):])
    return 0.0


def _error(r, status, param=None, text=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and "\n" not in e["message"]
    if param is not None:
        assert e["param"] == param, e
    if text is not None:
        assert text in e["message"], e
    return e


# ----------------------------------------------------------------------------- request limits
def test_body_over_max_body_mb_is_413_before_it_is_read(server):
    """A declared 40 MB body: 413 at once, without the server waiting for (or reading) the bytes; a body sent chunked
    (no Content-Length) is cut as soon as it passes the limit.  Before: no limit (a 300 MB body was accepted)."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: 41943040\r\n\r\n" + b'{"prompt": "' + b"a" * 1000)
    t0 = time.perf_counter()
    head = s.recv(65536).decode("latin-1")
    s.close()
    assert head.startswith("HTTP/1.1 413") and "max_body_mb" in head, head
    assert time.perf_counter() - t0 < 5

    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):                         # 40 x 64 KB = 2.5 MB > 1 MB
            yield b"a" * 65536
        yield b'"}'
    r = httpx.post(server.base + "/v1/completions", content=chunks(), headers=H, timeout=30)
    _error(r, 413, text="max_body_mb")
    assert _health_ms(server) < 1000


def test_parsing_and_tokenization_run_off_the_event_loop(server, eng, monkeypatch):
    """While one request's prompt is being tokenized (here: a tokenizer that takes 3 s), /health answers at once.
    Before: JSON parsing and tokenization ran on the event loop (a 40 MB body: /health timed out at 10 s)."""
    tok = eng.tokenizer
    real = tok.encode
    started = threading.Event()

    def slow(text):
        started.set()
        time.sleep(3)
        return real(text)
    monkeypatch.setattr(tok, "encode", slow)
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", _post(server, "/v1/completions",
                                                                   {"prompt": "ROMEO:", "max_tokens": 2},
                                                                   timeout=600)))
    th.start()
    assert started.wait(10)
    assert _health_ms(server) < 1000
    th.join(600)          # the module's first generation also compiles
    assert out["r"].status_code == 200


def test_a_prompt_beyond_the_context_is_refused_before_tokenizing(server, eng, monkeypatch):
    """A prompt whose bytes cannot fit the context (each token covers at most the longest vocabulary entry) is
    refused without being tokenized, so its size never reaches the tokenizer's memory.  Before: a 10 MB prompt was
    tokenized whole (RSS 0.22 -> 2.21 GB) before the context check refused it."""
    calls = []
    real = eng.tokenizer.encode
    monkeypatch.setattr(eng.tokenizer, "encode", lambda text: (calls.append(len(text)), real(text))[1])
    big = "ROMEO " * 150_000                       # 900 KB (< --max_body_mb=1)
    for path, body, param in (("/v1/completions", {"prompt": big}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages")):
        e = _error(_post(server, path, body), 400, param=param, text="context limit is 256 tokens")
        assert e["code"] == "context_length_exceeded"
    assert calls == []
    e = _error(_post(server, "/v1/completions", {"prompt": [7] * 100_000}), 400, param="prompt",
               text="context limit is 256 tokens")
    assert e["code"] == "context_length_exceeded"
    # a prompt that may fit is still tokenized and checked exactly
    e = _error(_post(server, "/v1/completions", {"prompt": "ROMEO " * 300}), 400, param="prompt",
               text="context limit is 256 tokens")
    assert calls


def _closed_within(s, seconds) -> bool:
    s.settimeout(seconds)
    try:
        while True:
            if not s.recv(65536):
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_half_open_connections_are_closed_after_read_timeout(server):
    """Headers never finished, or a body that stops arriving: the connection is closed --read_timeout_s after it
    opened.  Before: never closed (uvicorn only times out idle keep-alive connections)."""
    for data in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Length: 100\r\n\r\n{\"prompt\""):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(data)
        t0 = time.perf_counter()
        assert _closed_within(s, READ_TIMEOUT + 5), data
        assert READ_TIMEOUT - 0.5 < time.perf_counter() - t0 < READ_TIMEOUT + 5
        s.close()
    assert _health_ms(server) < 1000
    # a request that arrives in time is answered, and its connection's keep-alive still works
    with httpx.Client(headers=H, timeout=30) as c:
        for _ in range(2):
            assert c.post(server.base + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 1}).status_code \
                == 200


# ----------------------------------------------------------------------------- input errors: 400 / 401, never 500
@pytest.mark.parametrize("path,raw,param,text", [
    ("/v1/completions", b'{"prompt": "ROMEO \\ud800"}', None, "lone surrogate"),
    ("/v1/completions", b'{"prompt": ["\\udfff"]}', None, "lone surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}', None, "lone surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     None, "lone surrogate"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', None, "lone surrogate"),
    ("/v1/completions", b"[" * 50_000 + b"]" * 50_000, None, "nested too deeply"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None, "nested too deeply"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', "top_p", "'top_p': 0.0 is out of range (expected (0.0, 1.0])"),
    ("/v1/completions", b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": "no"}}',
     "stream_options.include_usage", "expected a boolean"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": true, '
     b'"stream_options": {"include_usage": 1}}', "stream_options.include_usage", "expected a boolean"),
])
def test_input_errors_are_400_never_500(server, path, raw, param, text):
    """Before: lone surrogates and deep nesting were plain-text 500s, "include_usage": "no" was taken as true, and
    top_p 0's 400 named 'prompt' and said "completions:"."""
    e = _error(_post(server, path, raw=raw), 400, param=param, text=text)
    assert "completions:" not in e["message"]


def test_non_ascii_bearer_keys(server, monkeypatch):
    """A non-ASCII bearer key is a 401 (before: a 500 from compare_digest on str); with a non-ASCII --api_key the
    right key (sent as UTF-8) is accepted (before: a 500 even then)."""
    def send(key: bytes):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        body = b'{"prompt": "ROMEO:", "max_tokens": 1}'
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer " + key +
                  b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" +
                  body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        s.close()
        head, _, rest = out.partition(b"\r\n\r\n")
        return int(head.split()[1]), rest
    status, rest = send("clé".encode())
    assert status == 401 and json.loads(rest)["error"]["code"] == "invalid_api_key"
    from glm_jax.serve.tenancy import Keys

    monkeypatch.setattr(server, "keys", Keys("clé-ü"))
    assert send("clé-ü".encode())[0] == 200
    assert send("cle-u".encode())[0] == 401
    assert send("clé-ü".encode("latin-1"))[0] == 401


def test_an_unexpected_error_is_a_counted_logged_json_500(server, monkeypatch, caplog):
    """A bug in a handler: an OpenAI-style JSON 500, counted in /metrics and logged with its traceback.  Before:
    starlette's plain-text 500, not counted.  Unknown paths and methods: JSON 404 / 405."""
    before = _requests_total(server, "completions", 500)

    def boom(*a, **k):
        raise RuntimeError("a bug")
    monkeypatch.setattr(server, "_prompt", boom)
    with caplog.at_level("ERROR", logger="glm_jax.server"):
        e = _error(_post(server, "/v1/completions", {"prompt": "x"}), 500, text="a bug")
    assert e["type"] == "server_error"
    assert _requests_total(server, "completions", 500) == before + 1
    assert any("a bug" in r.getMessage() and r.exc_info for r in caplog.records)
    monkeypatch.undo()
    _error(httpx.get(server.base + "/v2/nothing", timeout=10), 404)
    _error(httpx.get(server.base + "/v1/completions", timeout=10), 405)


def test_a_request_the_memory_plan_refuses_is_a_400_not_a_500(server, eng, monkeypatch):
    """Engine.memory_guard refuses a request whose K/V growth does not fit the RAM budget (RamBudgetError, one
    line): the client gets a 400 naming it (code insufficient_memory), streamed or not, and the server serves on.
    Before, a request's error from the scheduler was always an internal-error 500."""
    from glm_jax.experts.store import RamBudgetError

    msg = "this request needs the K/V cache grown by 512 positions x 2 rows (9 MB), 70 MB more than the RAM budget"

    def refuse(kv_positions=0, rows=1):
        raise RamBudgetError(msg)
    before = (_requests_total(server, "completions", 400), _requests_total(server, "completions", 500))
    monkeypatch.setattr(eng, "memory_guard", refuse)
    e = _error(_post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4}), 400, text=msg)
    assert e["code"] == "insufficient_memory"
    r = _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "stream": True})
    events = [json.loads(ln[5:]) for ln in r.text.splitlines() if ln.startswith("data:") and "[DONE]" not in ln]
    assert events[-1]["error"]["code"] == "insufficient_memory" and msg in events[-1]["error"]["message"]
    assert (_requests_total(server, "completions", 400), _requests_total(server, "completions", 500)) == \
        (before[0] + 2, before[1])
    monkeypatch.undo()
    assert _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4}).status_code == 200


def test_serve_flags_have_ranges():
    from glm_jax import options as O

    o = O.SERVE_BY_NAME["max_body_mb"]
    with pytest.raises(O.OptionError, match=r"flag --max_body_mb: invalid value 0 \(expected a number in \(0, 4096\]"):
        O.check_value(o, 0.0, "flag --max_body_mb")
    assert O.check_value(o, 2.5, "flag --max_body_mb") == 2.5
    with pytest.raises(O.OptionError, match="read_timeout_s"):
        O.check_value(O.SERVE_BY_NAME["read_timeout_s"], -1.0, "flag --read_timeout_s")


# ----------------------------------------------------------------------------- fuzz: hypothesis-generated bodies
FIELDS = ["model", "prompt", "messages", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "frequency_penalty",
          "presence_penalty", "logit_bias", "tools", "tool_choice", "response_format", "user", "suffix"]
scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from([0, 1, 2, 3, -1, 255, 256])
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
           | st.sampled_from(["glm-jax-default", "ROMEO:", "\ud800", "user", "auto", "none", "required",
                              "json_object", "text"]))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "include_usage", "function", "name", "json_schema",
                     "schema", "x"]), c, max_size=4), max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                 "content": st.text(max_size=20) | values})
bodies = st.fixed_dictionaries(
    {"max_tokens": st.integers(0, 3)},
    optional={**{f: values for f in FIELDS}, "messages": st.lists(message, max_size=3) | values,
              "prompt": st.text(max_size=40) | st.lists(st.integers(-1, 3000), max_size=5) | values})


def _check(r):
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code != 200:
        _error(r, r.status_code)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies, chat=st.booleans(), raw_edit=st.sampled_from([None, b"\xff", b"{", b"\x00", b'"\\ud800"']))
def test_fuzz_http_bodies(server, body, chat, raw_edit):
    """Never a 500 (an input error is a JSON 400/401/404/413), never a hang (each request within 60 s), /health
    answering after each."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body).encode()
    if raw_edit is not None:
        raw = raw[:len(raw) // 2] + raw_edit + raw[len(raw) // 2:]
    _check(_post(server, path, raw=raw, timeout=60))
    assert _health_ms(server) < 2000


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(mid=st.text(min_size=1, max_size=30), key=st.sampled_from([KEY, "", "x", "clé"]))
def test_fuzz_get_endpoints(server, mid, key):
    headers = {"Authorization": f"Bearer {key}".encode("utf-8")} if key else {}
    from urllib.parse import quote

    for path in (f"/v1/models/{quote(mid, safe='')}", "/v1/models", "/metrics"):
        r = httpx.get(server.base + path, headers=headers, timeout=30)
        assert r.status_code < 500 and (r.status_code != 200 or key == KEY), (path, r.status_code, r.text)
        if r.status_code != 200:
            _error(r, r.status_code)


R_FIELDS = ["input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
            "temperature", "top_p", "store", "previous_response_id", "include", "reasoning", "metadata", "x"]
r_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "name", "call_id", "arguments", "output", "format",
                     "schema", "parameters", "strict"]), c, max_size=4), max_leaves=12)
r_items = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call",
                                                                     "function_call_output", "x"])},
                                         optional={k: r_values for k in ("role", "content", "call_id", "name",
                                                                         "arguments", "output")}), max_size=3)
r_bodies = st.fixed_dictionaries({"max_output_tokens": st.integers(0, 3)},
                                 optional={**{f: r_values for f in R_FIELDS}, "input": st.text(max_size=20) | r_items})
schema_kw = st.sampled_from(["type", "properties", "items", "required", "additionalProperties", "maxLength",
                             "minLength", "enum", "anyOf", "maxItems", "minimum", "maximum", "patternProperties",
                             "$ref", "const"])
schemas = st.recursive(scalars | st.sampled_from(["object", "string", "integer", "number", "array", "boolean"]),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(schema_kw | st.text(max_size=3), c,
                                                                           max_size=4), max_leaves=14)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=r_bodies, schema=schemas, where=st.sampled_from(["responses", "response_format", "tool", "auto"]))
def test_fuzz_responses_and_schemas(server, body, schema, where):
    """/v1/responses bodies, and random JSON schemas as a response_format, a forced tool's parameters or both
    (tool_choice auto: calls or the JSON): never a 500, never a hang."""
    path, chat = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"a": schema}}}}
    if where == "responses":
        path = "/v1/responses"
    elif where == "response_format":
        body = dict(chat, response_format=rf)
    elif where == "tool":
        body = dict(chat, tools=[tool], tool_choice="required")
    else:
        body = dict(chat, tools=[tool], response_format=rf)
    _check(_post(server, path, raw=json.dumps(body).encode(), timeout=60))
    assert _health_ms(server) < 2000

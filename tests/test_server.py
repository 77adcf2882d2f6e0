"""glm-jax-serve in-process on a free port, driven by the official `openai` client and by raw HTTP (every error case);
the scheduler: batch invariance of greedy output, chunked prefill, disconnects freeing their row, the context limit;
the CLI's streamed output and Ctrl-C.  One engine (the shipped model, 4 rows) and one server for the module."""

import socket
import threading
import time

import httpx
import pytest

import glm_jax
from glm_jax import scheduler as SCH
from glm_jax.scheduler import Request, Sampling, TextStream

KEY = "test-key"
ROMEO = "ROMEO:\n"


@pytest.fixture(scope="module")
def eng():
    e = glm_jax.Engine.load(max_batch=4, prefill_chunk=16)
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(eng):
    import uvicorn

    from glm_jax.server import Server

    srv = Server(eng, api_key=KEY, max_queue=16)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(srv.app, log_level="warning"))
    th = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(200):
        if uv.started:
            break
        time.sleep(0.05)
    srv.base = f"http://127.0.0.1:{port}"
    yield srv
    uv.should_exit = True
    th.join(timeout=30)
    assert not th.is_alive()
    assert srv.thread is not None and not srv.thread.is_alive()      # lifespan shutdown stopped the engine thread


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _alone(eng, prompt, n=24, **kw):
    return eng.generate(prompt, max_new_tokens=n, **kw)


# ----------------------------------------------------------------------------- the openai client
def test_completions_and_chat_stream_and_not(server, client, eng):
    assert [m.id for m in client.models.list().data] == ["glm-jax-default"]
    ref = _alone(eng, ROMEO, 24)
    r = client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_tokens), 24)
    pieces = [c.choices[0].text for c in client.completions.create(model="glm-jax-default", prompt=ROMEO,
                                                                       max_tokens=24, temperature=0, stream=True)]
    assert len(pieces) > 1 and "".join(pieces) == ref.text
    # chat: the checkpoint's template; streamed == not streamed; usage in the last chunk when asked
    msgs = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who are you?"}]
    cref = eng.generate(msgs, chat=True, max_new_tokens=20)
    c = client.chat.completions.create(model="glm-jax-default", messages=msgs, max_tokens=20, temperature=0)
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content == cref.text
    assert c.usage.prompt_tokens == len(cref.prompt_tokens) == len(eng.encode(msgs, chat=True))
    chunks = list(client.chat.completions.create(model="glm-jax-default", messages=msgs, max_tokens=20,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == cref.text
    assert chunks[-1].usage.completion_tokens == len(cref.tokens) and not chunks[-1].choices


def test_stop_strings_across_token_boundaries(client, eng):
    ref = _alone(eng, ROMEO, 40).text
    # a stop string that spans tokens: the two characters around the first token boundary inside the text
    toks = _alone(eng, ROMEO, 40).tokens
    cut = len(eng.decode(toks[:3]))
    stop = ref[cut - 1:cut + 2]
    assert len(stop) == 3 and stop in ref
    want = ref[:ref.index(stop)]
    r = client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="glm-jax-default", prompt=ROMEO, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed == want


def test_seeds(client):
    def gen(seed):
        return client.completions.create(model="glm-jax-default", prompt=ROMEO, max_tokens=24, temperature=0.9,
                                         top_p=0.95, seed=seed).choices[0].text
    a, b, c = gen(5), gen(5), gen(6)
    assert a == b and a != c


# ----------------------------------------------------------------------------- raw HTTP: every error case
def _post(server, path, body, key=KEY, raw=None):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(server.base + path, content=raw, headers=h, timeout=60)
    return httpx.post(server.base + path, json=body, headers=h, timeout=60)


@pytest.mark.parametrize("path,body,raw,status,param,text", [
    ("/v1/completions", None, b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", None, b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, None, 400, "model", "unknown model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, None, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, None, 400, "max_tokens", "out of range"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature", "out of range"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "top_p", "out of range"),
    ("/v1/completions", {"prompt": "x", "top_k": 10 ** 6}, None, 400, "top_k", "out of range"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, None, 400, "seed", "integer"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, None, 400, "stop", "strings"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400, "stream", "boolean"),
    ("/v1/completions", {"prompt": "x", "n": 2}, None, 400, "n", "n=1"),
    ("/v1/completions", {"prompt": 5}, None, 400, "prompt", "string or a list of token ids"),
    ("/v1/completions", {"prompt": [1, 99999]}, None, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": "ROMEO " * 300}, None, 400, "prompt", "context limit is 256 tokens"),
    ("/v1/chat/completions", {}, None, 400, "messages", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages", "list"),
])
def test_errors_are_openai_style(server, path, body, raw, status, param, text):
    r = _post(server, path, body, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["param"] == param and err["type"] == "invalid_request_error"
    assert "\n" not in err["message"]


def test_auth_queue_full_and_metrics(server, eng, monkeypatch):
    r = _post(server, "/v1/completions", {"prompt": "x"}, key="")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _post(server, "/v1/completions", {"prompt": "x"}, key="wrong").status_code == 401
    assert httpx.get(server.base + "/health").json()["status"] == "ok"          # no key needed
    assert httpx.get(server.base + "/metrics").status_code == 401
    # a full queue -> 429 (the scheduler's own refusal, tested below, mapped to HTTP)
    sched = eng.scheduler

    def full(req):
        raise SCH.QueueFull("the queue is full (16 requests waiting; --max_queue)")
    monkeypatch.setattr(sched, "submit", full)
    r = _post(server, "/v1/completions", {"prompt": "x"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    monkeypatch.undo()
    m = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("glmjax_requests_total", "glmjax_generated_tokens_total", "glmjax_queue_depth",
                 "glmjax_running_requests", "glmjax_time_to_first_token_seconds_bucket",
                 "glmjax_generated_tokens_per_second", "glmjax_expert_hit_rate", "glmjax_mtp_acceptance"):
        assert name in m
    assert 'glmjax_requests_total{endpoint="completions",status="429"} 1.0' in m


def test_scheduler_queue_limit(eng):
    s = SCH.Scheduler(eng, max_batch=1, max_queue=1)
    s.submit(Request([1, 2], Sampling(max_new_tokens=1)))
    with pytest.raises(SCH.QueueFull, match="max_queue"):
        s.submit(Request([1, 2], Sampling(max_new_tokens=1)))


def test_disconnect_frees_the_row(server, eng, monkeypatch):
    sched = eng.scheduler
    slow = sched._decode

    def decode(dec, n):          # slow the engine down so that the request cannot finish before the client leaves
        time.sleep(0.2)
        return slow(dec, n)
    monkeypatch.setattr(sched, "_decode", decode)
    before = sched.counters["finished_cancelled"]
    with httpx.stream("POST", server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": ROMEO, "max_tokens": 240, "temperature": 0, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
        assert sched.running == 1
    t0 = time.time()
    while sched.counters["finished_cancelled"] == before and time.time() - t0 < 20:
        time.sleep(0.05)
    assert sched.counters["finished_cancelled"] == before + 1
    assert sched.running == 0 and sched.waiting == 0


# ----------------------------------------------------------------------------- the scheduler
def test_batch_invariance_of_greedy_output(eng):
    """A request's greedy tokens are the same alone and beside others: other rows of other lengths (a long one
    widens the attention window), chunked prefills interleaved with decode, admitted at another time and row."""
    heldout = open(glm_jax.default_model_path() + "/heldout.txt").read()
    long_ids = eng.encode(heldout[:4000])[:150]              # 10 prefill chunks of 16
    a, b = "JULIET:\n", "To be, or not"
    alone = [_alone(eng, p, 30).tokens for p in (ROMEO, a, b)]
    alone_long = eng.generate(long_ids, max_new_tokens=30).tokens
    sched = eng.scheduler
    reqs = [eng.request(long_ids, max_new_tokens=30), eng.request(b, max_new_tokens=30),
            eng.request(ROMEO, max_new_tokens=30, temperature=0.8, seed=3), eng.request(a, max_new_tokens=30)]
    late = eng.request(ROMEO, max_new_tokens=30)
    for r in reqs:
        sched.submit(r)
    for _ in range(3):
        sched.step()
    assert sched.running == 4
    sched.submit(late)                                         # waits for a free row, then joins the others
    sched.run(reqs + [late])
    assert reqs[0].out == alone_long
    assert reqs[1].out == alone[2] and reqs[3].out == alone[1] and late.out == alone[0]
    assert len({r.row for r in reqs}) == 4                     # four rows: not all where they ran alone


def test_a_dispatch_runs_what_fits_in_dispatch_ms(eng, monkeypatch):
    """Resident decode runs several steps per compiled dispatch; tokens reach the stream (and a cancel lands) only
    between dispatches, so a dispatch runs what fits in --dispatch_ms at the measured step time: on a model whose
    step takes 20 ms, 2 steps of 50 ms, not 32 (a client would see 640 ms bursts, a disconnect would hold its row
    as long).  Same greedy tokens as one long dispatch."""
    ref = _alone(eng, ROMEO, 24)
    sched = eng.scheduler
    assert sched.dispatch_s == 0.05 and SCH.FUSED_CHUNK == 32
    monkeypatch.setattr(sched, "step_s", 0.02)                 # as if each decode step took 20 ms ...
    monkeypatch.setattr(sched, "observe_step", lambda s: None)  # ... and kept taking it
    monkeypatch.setattr(sched, "stream_interval", 0)           # tokens only between dispatches (--stream_interval=0)
    sizes = []
    req = eng.request(ROMEO, max_new_tokens=24, on_event=lambda r, text, toks, done: sizes.append(len(toks)))
    sched.submit(req)
    sched.run([req])
    assert req.out == ref.tokens
    assert max(sizes) == 2 and sum(sizes) == len(ref.tokens) == 24
    assert sched.steps_per_dispatch() == 2
    monkeypatch.setattr(sched, "step_s", 0.0001)
    assert sched.steps_per_dispatch() == SCH.FUSED_CHUNK
    monkeypatch.setattr(sched, "dispatch_s", 0.0)
    assert sched.steps_per_dispatch() == 1


def test_context_limit(eng):
    limit = eng.context_limit
    assert limit == eng.cfg.max_position_embeddings == 256
    with pytest.raises(SCH.ContextLengthError, match="prompt is 256 tokens but the context limit is 256 tokens"):
        eng.generate([7] * 256, max_new_tokens=4)
    r = eng.generate([7] * 250, max_new_tokens=20, stop_on_eos=False)
    assert len(r.tokens) == 6 and r.finish_reason == "length"


def test_text_stream_is_utf8_safe_and_holds_stop_prefixes(eng):
    tok = eng.tokenizer
    text = "O Romeo — é ü"
    ids = tok.encode(text)
    pieces = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)                # a character split over tokens
    ts = TextStream(eng.decode)
    out = []
    for t in ids:
        ts.add([t])
        out.append(ts.delta())
    out.append(ts.delta(final=True))
    assert "".join(out) == tok.decode(ids) and not any("\ufffd" in p for p in out)
    ts = TextStream(eng.decode, stop=("meo —",))
    got = ""
    for t in ids:
        n = ts.add([t])
        got += ts.delta()
        assert "meo" not in got
        if ts.stopped:
            break
    assert ts.stopped and n == 1 and got + ts.delta(final=True) == "O Ro"


def test_engine_stream_and_cancel(eng):
    ref = _alone(eng, ROMEO, 24)
    st = eng.stream(ROMEO, max_new_tokens=24)
    assert "".join(st) == ref.text and st.result.tokens == ref.tokens
    st = eng.stream(ROMEO, max_new_tokens=200)
    for _ in st:
        break
    st = None
    import gc

    gc.collect()
    assert eng.scheduler.running == 0


def test_cli_streams_and_ctrl_c(monkeypatch, capsys):
    from glm_jax import cli

    cli.FLAGS.unparse_flags()
    cli.parse_flags(["glm-jax", "--max_new_tokens=200", "--ignore_eos"])
    calls = [0]
    real = SCH.Scheduler.step

    def step(self):
        calls[0] += 1
        if calls[0] == 6:      # admit + prefill, 2 one-step dispatches (timing the step), then dispatches of many
            raise KeyboardInterrupt
        return real(self)
    monkeypatch.setattr(SCH.Scheduler, "step", step)
    closed = []
    real_close = glm_jax.Engine.close
    monkeypatch.setattr(glm_jax.Engine, "close", lambda self: (closed.append(1), real_close(self)))
    try:
        assert cli.main(["glm-jax"]) == 130
    finally:
        cli.FLAGS.unparse_flags()
    out, err = capsys.readouterr()
    assert out.startswith(ROMEO) and len(out) > len(ROMEO) + 20          # what was generated before Ctrl-C stays
    assert "interrupted" in err and "decode" in err and "Traceback" not in err
    assert closed


def test_sigterm_drains_in_flight_requests_and_exits_0():
    """glm-jax-serve as a process: SIGTERM mid-stream lets the stream finish (finish_reason, [DONE]) and the process
    exits 0.  Before, sse-starlette cut the open stream at shutdown and uvicorn re-raised the signal (exit -15)."""
    import http.client
    import json
    import re
    import signal
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.argv[0] = 'glm-jax-serve'; "
                          "from glm_jax.server import run; run()", "--port=0", "--max_batch=2"],
                         stderr=subprocess.PIPE, text=True)
    try:
        port = None
        while port is None:
            line = p.stderr.readline()
            assert line, "the server exited before serving"
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(m.group(1)) if m else None
        for _ in range(300):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/completions", json.dumps({"prompt": ROMEO, "max_tokens": 200, "stream": True}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        line = r.readline()
        while line.startswith(b": ping"):         # sse-starlette's keep-alive, every 15 s (a loaded machine compiling)
            line = r.readline()
        assert line.startswith(b"data: ")
        p.send_signal(signal.SIGTERM)
        rest = r.read().decode()
        assert '"finish_reason": "length"' in rest and rest.rstrip().endswith("data: [DONE]")
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()

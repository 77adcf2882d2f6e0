"""Soak test of a running glm-jax-serve: for ``--seconds``, ``--clients`` threads mix well-formed streaming and
non-streaming requests, clients that disconnect mid-stream, and malformed requests (bad JSON, bad fields, unknown
model, a prompt beyond the context).  Prints how many of each ran, the failed well-formed requests (must be 0), the
malformed ones not answered 400, and the server's RSS (``--pid``) idle before, at the end, and after it settles.

    glm-jax-serve --port=8000 & python -m tools.bench.soak --pid=$! --seconds=300
"""

from __future__ import annotations

import collections
import random
import threading
import time

import httpx
from absl import app, flags

FLAGS = flags.FLAGS


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


BAD = [b"{not json", b"[1,2]", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": "9"}',
       b'{"prompt": "x", "temperature": -3}', b'{"model": "nope", "prompt": "x"}', b'{"messages": "hi"}',
       ('{"prompt": "%s"}' % ("ROMEO " * 400)).encode()]


def main(argv):
    base = FLAGS.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    h = {"Authorization": f"Bearer {FLAGS.api_key}"}
    stats = collections.Counter()
    failures = []
    lock = threading.Lock()
    end = time.time() + FLAGS.seconds
    idle = rss_mb(FLAGS.pid) if FLAGS.pid else float("nan")

    def worker(c):
        rng = random.Random(c)
        with httpx.Client(timeout=120) as cl:
            while time.time() < end:
                kind = rng.choices(["stream", "plain", "chat", "disconnect", "bad"], [3, 2, 2, 2, 3])[0]
                try:
                    if kind == "bad":
                        i = rng.randrange(len(BAD))
                        path = "/v1/chat/completions" if b"messages" in BAD[i] else "/v1/completions"
                        r = cl.post(base + path, content=BAD[i], headers=h)
                        ok = r.status_code == 400 and "error" in r.json()
                        with lock:
                            stats["bad"] += 1
                            if not ok:
                                stats["bad_not_400"] += 1
                        continue
                    body = {"prompt": "ROMEO:\n", "max_tokens": rng.randrange(8, 96), "temperature": 0.8,
                            "seed": rng.randrange(1000)}
                    if kind == "chat":
                        body = {"messages": [{"role": "user", "content": "Who art thou?"}],
                                "max_tokens": rng.randrange(8, 64)}
                        r = cl.post(base + "/v1/chat/completions", json=body, headers=h)
                        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                    elif kind == "plain":
                        r = cl.post(base + "/v1/completions", json=body, headers=h)
                        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
                    else:
                        body["stream"] = True
                        with cl.stream("POST", base + "/v1/completions", json=body, headers=h) as r:
                            assert r.status_code == 200
                            done = False
                            for line in r.iter_lines():
                                if kind == "disconnect" and line.startswith("data: {"):
                                    break             # leave mid-stream
                                if line == "data: [DONE]":
                                    done = True
                            assert done or kind == "disconnect"
                    with lock:
                        stats[kind] += 1
                except Exception as e:
                    with lock:
                        stats[kind + "_failed"] += 1
                        failures.append(f"{kind}: {type(e).__name__}: {e}"[:200])

    th = [threading.Thread(target=worker, args=(c,)) for c in range(FLAGS.clients)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    at_end = rss_mb(FLAGS.pid) if FLAGS.pid else float("nan")
    time.sleep(FLAGS.settle)
    after = rss_mb(FLAGS.pid) if FLAGS.pid else float("nan")
    health = httpx.get(base + "/health").json()
    good = sum(stats[k] for k in ("stream", "plain", "chat"))
    failed = sum(stats[k + "_failed"] for k in ("stream", "plain", "chat"))
    print(f"soak {FLAGS.seconds} s, {FLAGS.clients} clients: {good} well-formed requests ({failed} failed), "
          f"{stats['disconnect']} disconnects ({stats['disconnect_failed']} failed), {stats['bad']} malformed "
          f"({stats['bad_not_400']} not answered 400); server RSS idle {idle:.0f} MB, at the end {at_end:.0f} MB, "
          f"{FLAGS.settle:g} s later {after:.0f} MB ({100 * (after - idle) / idle:+.1f}% vs idle); health {health}")
    for f in failures[:10]:
        print("  " + f)
    return 1 if failed else 0


def run():
    flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "the server")
    flags.DEFINE_string("api_key", "unused", "API key")
    flags.DEFINE_integer("pid", 0, "the server's process id (for its RSS)")
    flags.DEFINE_integer("seconds", 300, "duration")
    flags.DEFINE_integer("clients", 8, "concurrent clients")
    flags.DEFINE_float("settle", 5.0, "seconds to wait before the last RSS reading")
    app.run(main)


if __name__ == "__main__":
    run()

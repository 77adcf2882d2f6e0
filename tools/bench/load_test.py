"""Load test for any OpenAI-compatible server (glm-jax-serve, llama-server, ...) with the official `openai` client.

    python -m tools.bench.load_test --base_url=http://127.0.0.1:8000/v1 --clients=1,2,4,8 --requests=6 --max_tokens=128

Each of N clients (threads) sends ``--requests`` streaming completions one after the other; prompts are windows of
the embedded model's held-out text (``glm_jax/default_model/heldout.txt``), the same sequence for every server.
Per concurrency level it prints one table row: aggregate generated tokens per second (completion tokens of every
request / wall time of the level), per-client tok/s, p50/p99 time to first token, p50/p99 time per output token
after the first (a request's (last chunk - first chunk) / (tokens - 1)), p99 gap between chunks (stalls),
tokens per chunk, and errors.  Token counts are the server's ``usage`` (stream_options.include_usage).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "the server's OpenAI base URL")
    flags.DEFINE_string("api_key", "unused", "API key sent as Bearer token")
    flags.DEFINE_string("model", "", "model id (default: the first of /v1/models)")
    flags.DEFINE_string("clients", "1,2,4,8", "comma-separated concurrency levels")
    flags.DEFINE_integer("requests", 4, "requests per client per level")
    flags.DEFINE_integer("max_tokens", 128, "max_tokens per request")
    flags.DEFINE_float("temperature", 0.8, "sampling temperature")
    flags.DEFINE_integer("prompt_chars", 120, "characters of held-out text per prompt")
    flags.DEFINE_integer("seed", 1, "prompt selection seed")
    flags.DEFINE_integer("warmup", 2, "requests before the first level (compiles, caches)")
    flags.DEFINE_string("label", "", "a name for this server in the table")


def prompts(n: int, chars: int, seed: int) -> list:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "glm_jax", "default_model",
                        "heldout.txt")
    if not os.path.exists(path):
        import glm_jax

        path = os.path.join(glm_jax.default_model_path(), "heldout.txt")
    text = open(path).read()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = rng.randrange(0, len(text) - chars)
        j = text.rfind("\n", 0, i) + 1
        out.append(text[j:j + chars])
    return out


def one_request(client, model, prompt, max_tokens, temperature, seed):
    t0 = time.perf_counter()
    times, usage = [], None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                       seed=seed, stream=True, stream_options={"include_usage": True})
    for ch in stream:
        if ch.choices and ch.choices[0].text:
            times.append(time.perf_counter())
        if getattr(ch, "usage", None):
            usage = ch.usage
    n = usage.completion_tokens if usage is not None else len(times)
    return dict(t0=t0, times=times, tokens=n)


def run_level(client, model, n_clients: int, n_req: int, ps: list, args) -> dict:
    results, errors = [], []
    lock = threading.Lock()

    def worker(c):
        for r in range(n_req):
            p = ps[(c * n_req + r) % len(ps)]
            try:
                res = one_request(client, model, p, args["max_tokens"], args["temperature"], 1000 * c + r)
                with lock:
                    results.append(res)
            except Exception as e:          # counted, not fatal
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    th = [threading.Thread(target=worker, args=(c,)) for c in range(n_clients)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in results)
    ttft = [r["times"][0] - r["t0"] for r in results if r["times"]]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1 and
            len(r["times"]) > 1]
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    chunks = sum(len(r["times"]) for r in results)
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")      # noqa: E731
    return dict(clients=n_clients, requests=len(results), errors=len(errors), tokens=toks, wall=wall,
                agg=toks / wall if wall else 0.0, per_client=toks / wall / n_clients if wall else 0.0,
                ttft50=pct(ttft, 50), ttft99=pct(ttft, 99), tpot50=pct(tpot, 50), tpot99=pct(tpot, 99),
                gap99=pct(gaps, 99), tok_per_chunk=toks / chunks if chunks else 0.0, error_text=errors[:3])


def main(argv):
    import openai

    client = openai.OpenAI(base_url=FLAGS.base_url, api_key=FLAGS.api_key, max_retries=0, timeout=600)
    model = FLAGS.model or client.models.list().data[0].id
    levels = [int(x) for x in FLAGS.clients.split(",") if x.strip()]
    ps = prompts(max(levels) * FLAGS.requests + FLAGS.warmup, FLAGS.prompt_chars, FLAGS.seed)
    args = dict(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature)
    for i in range(FLAGS.warmup):
        one_request(client, model, ps[-1 - i], FLAGS.max_tokens, FLAGS.temperature, i)
    rows = []
    for n in levels:
        r = run_level(client, model, n, FLAGS.requests, ps, args)
        rows.append(r)
        print(f"  {FLAGS.label or FLAGS.base_url}: {n} clients: {r['agg']:.0f} tok/s aggregate, "
              f"{r['errors']} errors {r['error_text']}", file=sys.stderr, flush=True)
    base = rows[0]["agg"] if rows else 0.0
    print(f"\n{FLAGS.label or FLAGS.base_url} ({model}), {FLAGS.requests} streaming requests per client, "
          f"max_tokens {FLAGS.max_tokens}, temperature {FLAGS.temperature:g}\n")
    print("| clients | requests | tokens | aggregate tok/s | vs 1 client | per-client tok/s | TTFT p50 / p99 ms | "
          "time/token p50 / p99 ms | chunk gap p99 ms | tokens/chunk | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['agg']:.0f} | "
              f"{r['agg'] / base if base else 0:.2f}x | {r['per_client']:.0f} | {1e3 * r['ttft50']:.0f} / "
              f"{1e3 * r['ttft99']:.0f} | {1e3 * r['tpot50']:.2f} / {1e3 * r['tpot99']:.2f} | "
              f"{1e3 * r['gap99']:.0f} | {r['tok_per_chunk']:.1f} | {r['errors']} |")
    return 0


def run():
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()

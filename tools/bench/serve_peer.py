"""glm-jax-serve against llama-server on the same model at the same bits, interleaved.

    python -m tools.bench.serve_peer --model=CONTAINER --gguf=MODEL-Q4_0.gguf --llamacpp=PREFIX
                                     [--clients=1,2,4,8] [--requests=3] [--max_tokens=64] [--rounds=2]

Both servers are started once (127.0.0.1, each on a free port, ``--threads`` threads): glm-jax-serve with its
defaults but the model (``--serve_args`` adds flags), llama-server with ``-np --np -c --np x --ctx_per_slot -t``
(its other defaults).  Each is warmed with two requests.  Then, per round, per concurrency level, both are load-tested
one after the other (the order alternates between rounds) with ``tools/bench/load_test.py``'s clients: the official
``openai`` client, streaming completions, the same prompts (windows of the shipped model's held-out text) and seeds.
The table gives per level the median over rounds of each server's aggregate tok/s and p50 TTFT, and the ratio.

Then (``--chat_turns``, 0 skips it) a multi-turn chat per server, the turns of the two servers interleaved: every
turn resends the whole conversation as token ids (the previous turns' user and reply tokens, then
``--chat_user_tokens`` new random ids), greedy, ``--chat_reply_tokens`` tokens, streamed; per turn its time to first
token (median over ``--chat_rounds`` conversations with other ids) and the prompt tokens each server reports as
cached (``usage.prompt_tokens_details.cached_tokens``; "-" where a server does not report it).  The reply tokens
appended to the history are fixed ids, the same for both servers (their own replies differ: other quantizers), so a
turn can reuse the previous turn's prompt, not its reply, as a client retokenizing a reply's text gets.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time

from absl import app, flags

from tools.bench import load_test as LT
from tools.bench import peer as bp

FLAGS = flags.FLAGS


def start_servers(logdir: str):
    os.makedirs(logdir, exist_ok=True)
    servers = {}
    pg = bp.free_port()
    cmd = [sys.executable, "-m", "glm_jax.serve.app", f"--model={FLAGS.model}", "--host=127.0.0.1", f"--port={pg}",
           *FLAGS.serve_args.split()]
    lg = os.path.join(logdir, "glm-jax-serve.log")
    env = dict(os.environ, OMP_NUM_THREADS=str(FLAGS.threads))
    with open(lg, "w") as out:                  # the child keeps its own copy of the descriptor
        srv = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    servers["glm-jax-serve"] = (srv,
                                f"http://127.0.0.1:{pg}", lg, " ".join(cmd[1:]))
    pl = bp.free_port()
    ll = os.path.join(logdir, "llama-server.log")
    # llama.cpp's defaults, unless they crash here (its weight repacking, on an AMX Xeon VM): then --no-repack,
    # the flag such a user falls back to (said in the table's caption)
    crash = bp.llama_defaults_crash(FLAGS.llamacpp, FLAGS.gguf, FLAGS.threads, ll)
    cmd = [os.path.join(FLAGS.llamacpp, "bin", "llama-server"), "-m", FLAGS.gguf, "--host", "127.0.0.1", "--port",
           str(pl), "-t", str(FLAGS.threads), "-np", str(FLAGS.np), "-c", str(FLAGS.np * FLAGS.ctx_per_slot),
           *(("--no-repack",) if crash else ())]
    if crash:
        print(f"llama.cpp's defaults crashed on {FLAGS.gguf} ({crash}): llama-server runs with --no-repack",
              flush=True)
    with open(ll, "w") as out:
        srv = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    servers["llama-server"] = (srv,
                               f"http://127.0.0.1:{pl}", ll, " ".join(cmd[1:]))
    for name, (p, url, lp, _) in servers.items():
        bp.wait_healthy(url, p, lp, name, timeout=600.0)        # glm-jax-serve compiles its warm-up first
    return servers


def chat_turn(client, model, ids: list):
    """One streamed greedy completion of token ids: (seconds to the first token, cached prompt tokens or None)."""
    t0 = time.perf_counter()
    first, cached = None, None
    stream = client.completions.create(model=model, prompt=ids, max_tokens=FLAGS.chat_reply_tokens, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True})
    for ch in stream:
        if first is None and ch.choices and ch.choices[0].text:
            first = time.perf_counter() - t0
        u = getattr(ch, "usage", None)
        d = getattr(u, "prompt_tokens_details", None) if u is not None else None
        if d is not None and getattr(d, "cached_tokens", None) is not None:
            cached = int(d.cached_tokens)
    return (first if first is not None else time.perf_counter() - t0), cached


def multiturn(clients: dict, names: list) -> dict:
    """Per server, per turn: [(prompt tokens, TTFT s, cached tokens)] over --chat_rounds conversations."""
    out = {n: [[] for _ in range(FLAGS.chat_turns)] for n in names}
    # with --warm_levels an untimed conversation first: each longer turn's first prefill at a new attention window
    # compiles in glm-jax-serve (once per server; --compile_cache keeps them for the next start)
    for rnd in range(-1 if FLAGS.warm_levels else 0, FLAGS.chat_rounds):
        rng = random.Random(1000 + rnd)
        hist = {n: [] for n in names}
        for t in range(FLAGS.chat_turns):
            user = [rng.randrange(FLAGS.chat_id_lo, FLAGS.chat_id_hi) for _ in range(FLAGS.chat_user_tokens)]
            for name in (names if (rnd + t) % 2 == 0 else names[::-1]):
                c, model = clients[name]
                hist[name] += user
                ttft, cached = chat_turn(c, model, hist[name])
                if rnd >= 0:
                    out[name][t].append((len(hist[name]), ttft, cached))
                print(f"chat {rnd} turn {t + 1} {name}: {len(hist[name])} prompt tokens, TTFT {1e3 * ttft:.0f} ms, "
                      f"cached {cached}", file=sys.stderr, flush=True)
            reply = [rng.randrange(FLAGS.chat_id_lo, FLAGS.chat_id_hi) for _ in range(FLAGS.chat_reply_tokens)]
            for name in names:
                hist[name] += reply
    return out


def main(argv):
    import openai

    levels = [int(x) for x in FLAGS.clients.split(",") if x.strip()]
    ps = LT.prompts(max(levels) * FLAGS.requests + 4, FLAGS.prompt_chars, FLAGS.seed)
    args = dict(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature)
    servers = start_servers(FLAGS.logdir)
    load0 = os.getloadavg()[0]
    t_start = time.time()
    try:
        clients = {}
        for name, (_, url, _, _) in servers.items():
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            model = c.models.list().data[0].id
            for i in range(2):
                LT.one_request(c, model, ps[-1 - i], FLAGS.max_tokens, FLAGS.temperature, i)
            clients[name] = (c, model)
        if FLAGS.warm_levels:        # one untimed pass of every level: each width's first compile is not timed
            for name in servers:
                c, model = clients[name]
                for lv in levels:
                    LT.run_level(c, model, lv, 1, ps, args)
        res = {(n, lv): [] for n in servers for lv in levels}
        names = list(servers)
        for rnd in range(FLAGS.rounds):
            for lv in levels:
                for name in (names if rnd % 2 == 0 else names[::-1]):
                    c, model = clients[name]
                    r = LT.run_level(c, model, lv, FLAGS.requests, ps, args)
                    res[(name, lv)].append(r)
                    print(f"round {rnd} {name} {lv} clients: {r['agg']:.1f} tok/s, TTFT p50 {1e3 * r['ttft50']:.0f} "
                          f"ms, {r['tok_per_chunk']:.1f} tok/chunk, errors {r['errors']} {r['error_text']}",
                          file=sys.stderr, flush=True)
        chat = multiturn(clients, names) if FLAGS.chat_turns else None
    finally:
        for p, _, _, _ in servers.values():
            p.terminate()
        for p, _, _, _ in servers.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    med = lambda xs: statistics.median(xs)       # noqa: E731
    g, ll = names
    print(f"glm-jax-serve vs llama-server, {FLAGS.requests} streaming completions per client per level, max_tokens "
          f"{FLAGS.max_tokens}, temperature {FLAGS.temperature:g}, {FLAGS.threads} threads each, medians of "
          f"{FLAGS.rounds} interleaved rounds" + (" after an untimed pass of every level" if FLAGS.warm_levels else "")
          + "\n")
    print("| clients | glm-jax-serve aggregate tok/s | llama-server aggregate tok/s | ratio | glm-jax TTFT p50 ms | "
          "llama TTFT p50 ms | glm-jax tokens/chunk | llama tokens/chunk | errors (glm-jax / llama) | rounds glm-jax "
          "| rounds llama |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for lv in levels:
        a, b = res[(g, lv)], res[(ll, lv)]
        ag, al = med([r["agg"] for r in a]), med([r["agg"] for r in b])
        ra, rb = (", ".join(f"{r['agg']:.0f}" for r in x) for x in (a, b))
        print(f"| {lv} | {ag:.1f} | {al:.1f} | {ag / al if al else 0:.2f}x | {1e3 * med([r['ttft50'] for r in a]):.0f} "
              f"| {1e3 * med([r['ttft50'] for r in b]):.0f} | {med([r['tok_per_chunk'] for r in a]):.1f} | "
              f"{med([r['tok_per_chunk'] for r in b]):.1f} | {sum(r['errors'] for r in a)} / "
              f"{sum(r['errors'] for r in b)} | {ra} | {rb} |")
    print()
    if chat is not None:
        print(f"{FLAGS.chat_turns}-turn chat, {FLAGS.chat_user_tokens} new user tokens and {FLAGS.chat_reply_tokens}"
              f" reply tokens per turn, greedy, streamed; TTFT: median of {FLAGS.chat_rounds} conversations\n")
        print("| turn | prompt tokens | glm-jax TTFT ms | glm-jax cached tokens | llama TTFT ms | llama cached tokens |")
        print("|---|---|---|---|---|---|")
        for t in range(FLAGS.chat_turns):
            cells = []
            for name in (g, ll):
                xs = chat[name][t]
                cached = [x[2] for x in xs]
                cells += [f"{1e3 * med([x[1] for x in xs]):.0f}",
                          "-" if any(c is None for c in cached) else ", ".join(str(c) for c in cached)]
            print(f"| {t + 1} | {chat[g][t][0][0]} | " + " | ".join(cells) + " |")
        print()
    for name, (_, _, _, cmd) in servers.items():
        print(f"- {name}: `{cmd}`")
    print(f"- load average (1 min) at the start / end: {load0:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} "
          f"CPUs; wall {time.time() - t_start:.0f} s")
    return 0


def run():
    flags.DEFINE_string("model", "", "glm-jax-serve --model (a container)")
    flags.DEFINE_string("gguf", "", "llama-server -m (the same model at the same bits)")
    flags.DEFINE_string("llamacpp", "/work/llamacpp", "llama.cpp prefix (bin/llama-server)")
    flags.DEFINE_string("serve_args", "", "extra glm-jax-serve flags (space-separated)")
    flags.DEFINE_string("clients", "1,2,4,8", "concurrency levels")
    flags.DEFINE_integer("requests", 3, "requests per client per level per round")
    flags.DEFINE_integer("max_tokens", 64, "max_tokens per request")
    flags.DEFINE_float("temperature", 0.8, "sampling temperature")
    flags.DEFINE_integer("prompt_chars", 120, "characters of held-out text per prompt")
    flags.DEFINE_integer("seed", 1, "prompt selection seed")
    flags.DEFINE_bool("warm_levels", True, "an untimed pass of every level first (compiles each decode width; "
                      "without it the first round times glm-jax-serve's first compile of each width)")
    flags.DEFINE_integer("rounds", 2, "interleaved rounds (medians)")
    flags.DEFINE_integer("threads", 2, "threads of each server")
    flags.DEFINE_integer("np", 8, "llama-server -np (parallel slots)")
    flags.DEFINE_integer("ctx_per_slot", 512, "llama-server context per slot (-c = np x this)")
    flags.DEFINE_string("logdir", "/tmp/glm-jax-serve-peer", "server logs")
    flags.DEFINE_integer("chat_turns", 10, "turns of the multi-turn chat table (0: none)")
    flags.DEFINE_integer("chat_user_tokens", 32, "new user tokens per turn")
    flags.DEFINE_integer("chat_reply_tokens", 8, "reply tokens per turn (generated; fixed ids appended)")
    flags.DEFINE_integer("chat_rounds", 2, "conversations per server (medians)")
    flags.DEFINE_integer("chat_id_lo", 16, "the chat's random token ids: from")
    flags.DEFINE_integer("chat_id_hi", 1000, "... to (exclusive; inside both vocabularies)")
    app.run(main)


if __name__ == "__main__":
    run()

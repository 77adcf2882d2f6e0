"""The prefix cache on a multi-turn chat (docs/serving-prefix.md): every turn resends the whole conversation, as chat
clients and agents do; per turn, with and without ``--prefix_cache``: prompt tokens, tokens reused, time to first
token, and the routed-expert bytes the turn read from the container (the embedded model streamed with fetch=loop and
a small expert cache, so a prefill's experts are read from disk; or, with --synth_dir, a synthetic container with
more experts (tools/fixtures/synth_model.py, written there once; no tokenizer: each user turn is --user_tokens random token
ids)).  Greedy replies, checked identical both ways.

    python -m tools.bench.prefix [--turns=10] [--reply_tokens=8] [--cache_cap=2] [--rounds=3] [--synth_dir=DIR]
"""

from __future__ import annotations

import os
import statistics
import sys

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS

USER = ["Who are you?", "Speak of love.", "And of death?", "What of the king?", "Who is Juliet?", "Why so sad?",
        "Where is Romeo?", "Tell me more.", "What now?", "Farewell."]


def chat(e, turns: int, reply: int) -> list:
    """One chat from a cold start: the store's cache dropped, no row's K/V known to the prefix cache."""
    e.store.drop_cache()
    e.scheduler.forget()
    hist, ids, rows = [], [], []
    rng = np.random.default_rng(0)
    for t in range(turns):
        if e.tokenizer is not None:
            hist.append({"role": "user", "content": USER[t % len(USER)]})
            r = e.generate(hist, chat=True, max_new_tokens=reply)     # the store's counters: this call's
            hist.append({"role": "assistant", "content": r.text})
        else:
            ids += [int(x) for x in rng.integers(2, e.cfg.vocab_size, FLAGS.user_tokens)]
            r = e.generate(ids, max_new_tokens=reply, stop_on_eos=False)
            ids += r.tokens
        st = r.stats
        rows.append(dict(prompt=len(r.prompt_tokens), cached=st["cached_tokens"], ttft=st["ttft_s"],
                         bytes=st["bytes_read"], prefill_bytes=st["bytes_read"] - st.get("decode_bytes_read", 0),
                         tokens=r.tokens))
    return rows


def synth(d: str) -> str:
    from glm_jax.experts.convert import convert
    from tools.fixtures import synth_model

    out = os.path.join(d, "container")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        cfg = synth_model.bench_config(hidden=256, moe_inter=256, experts=64, layers=4, top_k=4, vocab=4096)
        synth_model.write_hf_checkpoint(os.path.join(d, "hf"), cfg, dtype="bfloat16", zipf=1.1, keep_reference=False)
        convert(os.path.join(d, "hf"), out, expert_format="int4_g64", progress=False)
    return out


def main(argv):
    base = dict(fetch="loop", cache_cap=FLAGS.cache_cap, max_batch=1,
                state_dir="off")
    import glm_jax

    model = synth(FLAGS.synth_dir) if FLAGS.synth_dir else None
    engines = {on: glm_jax.Engine.load(model, **base, prefix_cache=on) for on in (False, True)}
    for e in engines.values():              # compile every shape first (the timed rounds run compiled programs)
        chat(e, FLAGS.turns, FLAGS.reply_tokens)
    runs = {False: [], True: []}
    for _ in range(FLAGS.rounds):
        for on, e in engines.items():
            runs[on].append(chat(e, FLAGS.turns, FLAGS.reply_tokens))
            print(f"  prefix_cache={on}: done", file=sys.stderr, flush=True)
    same = all(a["tokens"] == b["tokens"] for r0 in runs[False] for r1 in runs[True] for a, b in zip(r0, r1))
    if not same:
        for on in (False, True):
            for k, r in enumerate(runs[on]):
                print(f"  prefix_cache={on} round {k}: turns equal to round 0 without: "
                      f"{[a['tokens'] == b['tokens'] for a, b in zip(r, runs[False][0])]}", file=sys.stderr)
    what = (f"a synthetic container ({FLAGS.synth_dir}: 4 layers, 64 experts of 256 x 256, top-4, int4_g64; "
            f"{FLAGS.user_tokens}-token user turns)") if FLAGS.synth_dir else "the embedded model's container"
    print(f"\n{FLAGS.turns}-turn chat on {what}, streamed (fetch=loop, cache_cap {FLAGS.cache_cap}, max_batch 1, "
          f"the store's cache dropped at the start), {FLAGS.reply_tokens}-token greedy replies; TTFT: median of "
          f"{FLAGS.rounds} rounds, interleaved; greedy replies identical with and without: {same}\n")
    print("| turn | prompt tokens | reused (prefix cache) | TTFT without | TTFT with | expert bytes read by the "
          "prefill without | with | whole turn without | with |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in range(FLAGS.turns):
        off = [r[t] for r in runs[False]]
        on = [r[t] for r in runs[True]]
        print(f"| {t + 1} | {off[0]['prompt']} | {on[0]['cached']} | "
              f"{statistics.median(x['ttft'] for x in off) * 1e3:.1f} ms | "
              f"{statistics.median(x['ttft'] for x in on) * 1e3:.1f} ms | {off[0]['prefill_bytes'] / 1e3:.0f} kB | "
              f"{on[0]['prefill_bytes'] / 1e3:.0f} kB | {off[0]['bytes'] / 1e3:.0f} kB | "
              f"{on[0]['bytes'] / 1e3:.0f} kB |")
    return 0 if same else 1


def run():
    flags.DEFINE_integer("turns", 10, "chat turns")
    flags.DEFINE_integer("reply_tokens", 8, "tokens per reply")
    flags.DEFINE_integer("cache_cap", 2, "experts cached per layer")
    flags.DEFINE_integer("rounds", 3, "rounds per mode (interleaved)")
    flags.DEFINE_integer("user_tokens", 48, "--synth_dir: token ids per user turn")
    flags.DEFINE_string("synth_dir", "", "a synthetic container's directory (written there when absent) instead "
                        "of the embedded model")
    app.run(main)


if __name__ == "__main__":
    run()

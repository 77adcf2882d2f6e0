"""`glm-jax`: generate text with a GLM MoE model.  `glm-jax --helpfull` documents every flag."""

from __future__ import annotations

import json
import sys

from absl import app, flags

from . import options as O

FLAGS = flags.FLAGS

O.define_once(flags.DEFINE_string, "model", "", "Model directory: a Hugging Face checkpoint (config.json + "
              "safetensors) or a container written by glm-jax-convert. Default: the embedded model shipped with "
              "glm-jax.")
O.define_once(flags.DEFINE_string, "prompt", "ROMEO:\n", "Prompt text.")
O.define_once(flags.DEFINE_string, "prompt_ids", "", "Comma-separated prompt token ids (instead of --prompt).")
O.define_once(flags.DEFINE_integer, "max_new_tokens", 64, "Tokens to generate.", lower_bound=0)
O.define_once(flags.DEFINE_float, "temperature", 0.0, "Sampling temperature; 0 = greedy.", lower_bound=0.0)
O.define_once(flags.DEFINE_integer, "top_k", 0, "Sample from the top-k tokens only (0 = off).", lower_bound=0)
O.define_once(flags.DEFINE_float, "top_p", 1.0, "Nucleus sampling: smallest token set with probability >= top_p "
              "(1 = off). Unrelated to --expert_topp.")
O.define_once(flags.DEFINE_integer, "seed", 0, "Random seed for sampling.")
O.define_once(flags.DEFINE_boolean, "chat", False, "Wrap the prompt in GLM chat format "
              "([gMASK]<sop><|user|>...<|assistant|>).")
O.define_once(flags.DEFINE_boolean, "ignore_eos", False, "Do not stop at the end-of-sequence token(s).")
O.define_once(flags.DEFINE_string, "output_json", "", "Also write tokens, text and stats to this JSON file.")
O.define_flags()        # the engine options, --plugin / --plugin_args included (shared with glm-jax-eval)


def format_stats(s: dict) -> str:
    parts = [f"prefill {s['prefill_tokens']} tokens in {s['prefill_s']:.3f} s",
             f"decode {s['decode_tokens']} tokens in {s['decode_s']:.3f} s ({s['decode_tok_s']:.2f} tok/s)"]
    if s.get("compile_s"):
        parts.append(f"compile {s['compile_s']:.1f} s")
    if "hit_rate" in s:
        parts.append(f"expert hit rate {100 * s['hit_rate']:.1f}%")
    if "bytes_read" in s:
        parts.append(f"read {s['bytes_read'] / 1e6:.1f} MB")
    if "bytes_read_per_token" in s:
        parts.append(f"{s['bytes_read_per_token'] / 1e6:.2f} MB/token")
    if s.get("prefetch_loads"):
        parts.append(f"prefetch {int(s['prefetch_hits'])}/{int(s['prefetch_loads'])} loads used"
                     + (f", recall {100 * s['prefetch_recall']:.0f}%" if "prefetch_recall" in s else ""))
    if "mtp_acceptance" in s:
        parts.append(f"MTP acceptance {100 * s['mtp_acceptance']:.1f}% ({s['tokens_per_forward']:.2f} tok/forward)")
    if s.get("experts_dropped"):
        parts.append(f"experts dropped {int(s['experts_dropped'])}")
    return " | ".join(parts)


def main(argv):
    from absl import logging

    if not FLAGS["verbosity"].present:       # keep jax's backend-probe INFO lines off the terminal
        logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from .config import GlmJaxError
    from .engine import Engine

    try:
        engine = Engine.load(FLAGS.model or None, **O.from_flags())
        if FLAGS.prompt_ids:
            try:
                prompt = [int(t) for t in FLAGS.prompt_ids.split(",") if t.strip()]
            except ValueError:
                raise GlmJaxError(f"flag --prompt_ids: expected comma-separated integers, got {FLAGS.prompt_ids!r}")
        else:
            prompt = FLAGS.prompt
        res = engine.generate(prompt, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                              top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed, chat=FLAGS.chat,
                              stop_on_eos=not FLAGS.ignore_eos)
    except GlmJaxError as e:
        print(f"glm-jax: error: {e}", file=sys.stderr)
        return 2
    if isinstance(prompt, str) and not FLAGS.chat:
        sys.stdout.write(prompt)
    print(res.text if engine.tokenizer is not None else " ".join(map(str, res.tokens)))
    print(format_stats(res.stats), file=sys.stderr)
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(res.to_json(), f, indent=1)
    engine.close()
    return 0


def run():
    app.run(main)


if __name__ == "__main__":
    run()

"""`glm-jax`: generate text with a GLM MoE model.  `glm-jax --help` lists the main flags, `--helpfull` every flag."""

from __future__ import annotations

import os
import secrets
import signal
import sys

from absl import app, flags

from . import options as O
from .errors import GlmJaxError

FLAGS = flags.FLAGS

O.define_model_flag()
O.define_once(flags.DEFINE_string, "prompt", "ROMEO:\n", "Prompt text ('-': read it from stdin). With --chat and no "
              "--prompt: an interactive chat.")
O.define_once(flags.DEFINE_string, "prompt_ids", "", "Comma-separated prompt token ids (instead of --prompt).")
O.define_once(flags.DEFINE_integer, "max_new_tokens", 64, "Tokens to generate.", lower_bound=0)
O.define_once(flags.DEFINE_float, "temperature", 0.0, "Sampling temperature; 0 = greedy.", lower_bound=0.0)
O.define_once(flags.DEFINE_integer, "top_k", 0, "Sample from the top-k tokens only (0 = off).", lower_bound=0)
O.define_once(flags.DEFINE_float, "top_p", 1.0, "Nucleus sampling: smallest token set with probability >= top_p, in "
              "(0, 1] (1 = off). Unrelated to --expert_topp.")
O.define_once(flags.DEFINE_integer, "seed", None, "Random seed for sampling (default: a fresh random seed each run, "
              "printed with the stats; the same rule as glm-jax-serve's `seed` field).")
O.define_once(flags.DEFINE_boolean, "chat", False, "Format the prompt as one user message with the checkpoint's "
              "chat_template (tokenizer_config.json), or the GLM format ([gMASK]<sop><|user|>...<|assistant|>) "
              "without one.")
O.define_once(flags.DEFINE_boolean, "ignore_eos", False, "Do not stop at the end-of-sequence token(s).")
O.define_once(flags.DEFINE_string, "output_json", "", "Also write tokens, text and stats to this JSON file.")
O.define_flags()        # the engine options, --plugin / --plugin_args included (shared with glm-jax-eval, -serve)


def format_stats(s: dict) -> str:
    parts = [f"prefill {s['prefill_tokens']} tokens in {s['prefill_s']:.3f} s",
             f"decode {s['decode_tokens']} tokens in {s['decode_s']:.3f} s ({s['decode_tok_s']:.2f} tok/s)"]
    if s.get("compile_s"):
        parts.append(f"compile {s['compile_s']:.1f} s")
    if "dtype" in s:
        parts.append(f"{s['fetch']}, {s['kernels']} kernels, compute {s['dtype']} (checkpoint {s['checkpoint_dtype']}), "
                     f"K/V {s.get('kv_dtype', s['dtype'])}")
    if "mesh" in s:
        parts.append(f"mesh {s['mesh']}" + (f" over {s['processes']} processes" if s.get("processes", 1) > 1 else ""))
    if "hit_rate" in s and s.get("fetch") != "resident":      # resident: every expert in RAM, nothing fetched
        parts.append(f"expert hit rate {100 * s['hit_rate']:.1f}%")
    if "bytes_read" in s and s.get("fetch") != "resident":
        parts.append(f"read {s['bytes_read'] / 1e6:.1f} MB")
    if "bytes_read_per_token" in s and s.get("fetch") != "resident":
        parts.append(f"{s['bytes_read_per_token'] / 1e6:.2f} MB/token")
    if s.get("prefetch_loads"):
        parts.append(f"prefetch {int(s['prefetch_hits'])}/{int(s['prefetch_loads'])} loads used"
                     + (f", recall {100 * s['prefetch_recall']:.0f}%" if "prefetch_recall" in s else ""))
    if "mtp_acceptance" in s:
        parts.append(f"MTP acceptance {100 * s['mtp_acceptance']:.1f}% ({s['tokens_per_forward']:.2f} tok/forward)")
    if s.get("experts_dropped"):
        parts.append(f"experts dropped {int(s['experts_dropped'])}")
    return " | ".join(parts)


MAIN_FLAGS = ("model", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "chat",
              "ignore_eos", "output_json")


def help_text() -> str:
    """What `glm-jax --help` prints: usage, this command's flags and the main engine options."""
    return O.command_help(
        FLAGS, ["glm-jax: generate text with a GLM MoE model (default: the embedded Shakespeare model).", "",
                "usage: glm-jax [--model=DIR] [--prompt=TEXT] [--max_new_tokens=N] [--temperature=T] [flags]", ""],
        O.main_flag_names(MAIN_FLAGS),
        "glm-jax --helpfull documents every flag (expert store, routing plugins, speculative decoding, ...).")


_one_line = O.one_line


def parse_flags(argv):
    """absl flag parsing, with `--help` answered here and a bad flag as one `glm-jax: error:` line (exit 2)."""
    return O.parse_command_flags(FLAGS, argv, "glm-jax", help_text)


class _StdoutGone(Exception):
    """stdout's reader went away (``glm-jax ... | head``)."""


def _ensure_std_streams():
    """A closed stdin/stdout/stderr (``glm-jax >&-``) becomes /dev/null: nothing opened later lands on fd 1 or 2,
    and no write raises."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            nul = os.open(os.devnull, os.O_RDWR)
            if nul != fd:
                os.dup2(nul, fd)
                os.close(nul)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)


def _emit(text: str):
    """Write to stdout; a closed pipe (EPIPE) puts /dev/null under fd 1 (so neither this process's later writes
    nor the exit flush raise) and raises _StdoutGone."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (BrokenPipeError, ValueError) as e:      # ValueError: stdout was closed from Python
        nul = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(nul, sys.stdout.fileno())
        except (OSError, ValueError):
            sys.stdout = open(os.devnull, "w")
        finally:
            os.close(nul)
        raise _StdoutGone() from e


def _say(msg: str):
    """One line on stderr (a closed stderr pipe is not an error of the generation)."""
    try:
        print(msg, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class _Terminated(KeyboardInterrupt):
    """SIGTERM: handled like Ctrl-C (what was generated kept, the stats line, the usage history saved by
    Engine.close), exit 128 + 15."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def _interrupted(e: BaseException) -> int:
    return 128 + signal.SIGTERM if isinstance(e, _Terminated) else 130


def _locale_text(text: str) -> str:
    """``text`` as the UTF-8 its bytes are where the locale (POSIX / C without UTF-8 mode) decoded argv as ASCII:
    its surrogate-escaped bytes put back together; unchanged where they are not UTF-8."""
    if not any("\udc80" <= c <= "\udcff" for c in text):
        return text
    try:
        return text.encode(sys.getfilesystemencoding(), "surrogateescape").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return text


def _prompt_problem(text: str) -> str | None:
    """Why ``--prompt`` is not text (bytes that are not UTF-8 arrive as lone surrogates), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        c = ord(e.object[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"character U+{c:04X}"
        return f"not valid UTF-8 ({what} at position {e.start}); pass UTF-8 text, or token ids with --prompt_ids"


def _prompt_arg():
    """--prompt (text) or --prompt_ids (a list of ids), checked."""
    if FLAGS.prompt_ids or FLAGS["prompt_ids"].present:
        if FLAGS["prompt"].present:
            raise GlmJaxError("flags --prompt and --prompt_ids: give one of them, not both")
        try:
            prompt = [int(t) for t in FLAGS.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise GlmJaxError(f"flag --prompt_ids: expected comma-separated integers, got "
                              f"{O.one_line(FLAGS.prompt_ids)[:80]!r}")
        if not prompt:
            raise GlmJaxError("flag --prompt_ids: no token ids given (expected comma-separated integers)")
        return prompt
    prompt = sys.stdin.read() if FLAGS.prompt == "-" else _locale_text(FLAGS.prompt)
    why = _prompt_problem(prompt)
    if why:
        raise GlmJaxError(f"flag --prompt: {why}")
    return prompt


def _read_line(prompt: str) -> str:
    return input(prompt)


def interactive(engine, kw: dict) -> int:
    """glm-jax --chat without --prompt: a chat on the terminal.  Each line is a user turn, the reply streams as it
    is generated, the conversation is kept (``/reset`` forgets it, ``/exit`` or end of input ends the session);
    Ctrl-C while a reply is generated stops that reply (its row is freed) and the session goes on."""
    history = []
    _say("glm-jax: chat; /exit or Ctrl-D ends it, /reset forgets the conversation, Ctrl-C stops a reply")
    while True:
        try:
            line = _read_line("> ")
        except (EOFError, KeyboardInterrupt):
            _emit("\n")
            return 0
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            history = []
            continue
        if not cmd:
            continue
        try:
            it = iter(engine.stream(history + [{"role": "user", "content": line}], **kw))
        except GlmJaxError as e:         # the conversation outgrew the context, ...: say it, keep the session
            _say(f"glm-jax: {_one_line(e)} (/reset starts over)")
            continue
        reply = ""
        try:
            for piece in it:
                _emit(piece)
                reply += piece
        except KeyboardInterrupt:
            it.close()                   # cancels the request: its row is free for the next turn
            _emit(" [stopped]")
        _emit("\n")
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]


def main(argv):
    from absl import logging

    _ensure_std_streams()
    try:
        prev = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:                       # not the main thread
        prev = None
    if not FLAGS["verbosity"].present:       # keep jax's backend-probe INFO lines off the terminal
        logging.set_verbosity(logging.WARNING)
    engine = None
    try:
        if len(argv) > 1:
            raise GlmJaxError(f"unexpected arguments: {' '.join(argv[1:])} (flags are --name=value)")
        opts = O.from_flags()
        if FLAGS.output_json:      # before the generation, so that its result is never lost at the end
            O.check_writable(FLAGS.output_json, "--output_json")
        prompt = _prompt_arg()
        # one seed rule for glm-jax and glm-jax-serve: no --seed -> a fresh random seed (printed with the stats
        # when sampling, and in --output_json), --seed=N -> reproducible
        seed = FLAGS.seed if FLAGS.seed is not None else secrets.randbits(63)
        talk = FLAGS.chat and not FLAGS["prompt"].present and not FLAGS.prompt_ids
        if not opts.where("reserve_tokens") and not talk:      # the RAM plan reserves KV for what this run can use
            n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.encode("utf-8")) + 64 * FLAGS.chat
            opts["reserve_tokens"] = max(1, n_prompt + FLAGS.max_new_tokens)
        from .engine import Engine

        engine = Engine.from_options(FLAGS.model or None, opts)
        import jax

        kw = dict(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                  top_p=FLAGS.top_p, seed=seed, chat=FLAGS.chat, stop_on_eos=not FLAGS.ignore_eos)
        if jax.process_index() != 0:    # a multi-process run (--coordinator): process 0 prints and writes
            engine.generate(prompt, **kw)
            return 0
        if talk:
            return interactive(engine, kw)
        st = engine.stream(prompt, **kw)      # checked here (context limit, ...): nothing is echoed before
        interrupted = gone = False
        shown = 0
        try:
            if isinstance(prompt, str) and not FLAGS.chat:
                _emit(prompt)
            if engine.tokenizer is not None:
                for piece in st:             # text as it is generated (a character split over tokens: whole)
                    try:
                        _emit(piece)
                    except _StdoutGone:
                        if not FLAGS.output_json:
                            raise
                        gone = True          # keep generating: the result still goes to --output_json
            else:                            # no tokenizer: the ids, as they are generated
                for _ in st._each_token():
                    toks = st.tokens
                    if not gone:
                        try:
                            _emit("".join(f"{t} " for t in toks[shown:]))
                        except _StdoutGone:
                            if not FLAGS.output_json:
                                raise
                            gone = True
                    shown = len(toks)
        except KeyboardInterrupt as e:   # Ctrl-C / SIGTERM: keep what was printed, say how far it got
            interrupted = _interrupted(e)
        except _StdoutGone:
            gone = True
        if not gone:
            try:
                if engine.tokenizer is None and st.tokens[shown:]:     # ids a Ctrl-C cut off before they showed
                    _emit("".join(f"{t} " for t in st.tokens[shown:]))
                _emit("\n")
            except _StdoutGone:
                gone = True
        res = st.result or engine.scheduler.result(st.req, st.compile0)
        tail = (f" | seed {seed}" if FLAGS.temperature > 0 and FLAGS.seed is None else "") + \
            ({130: " | interrupted", 143: " | terminated"}.get(interrupted, "")) + (" | stdout closed" if gone else "")
        _say(format_stats(res.stats) + tail)
        if FLAGS.output_json:            # an interrupted run's too: what was generated is kept
            O.write_json_output(FLAGS.output_json, dict(res.to_json(), seed=seed, interrupted=bool(interrupted)))
        if interrupted:
            return interrupted
    except GlmJaxError as e:
        _say(f"glm-jax: error: {_one_line(e)}")
        return 2
    except KeyboardInterrupt as e:       # before the generation started (loading, compiling): no traceback
        _say("\nglm-jax: " + ("terminated" if isinstance(e, _Terminated) else "interrupted"))
        return _interrupted(e)
    finally:
        if engine is not None:
            engine.close()
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)
    return 0


def run():
    try:
        app.run(main, flags_parser=parse_flags)
    except KeyboardInterrupt as e:      # outside main (absl's start-up): no traceback either
        _say("\nglm-jax: interrupted")
        sys.exit(_interrupted(e))


if __name__ == "__main__":
    run()

"""The console entries (`glm-jax`, `glm-jax-serve`, `glm-jax-convert`, `glm-jax-eval`): Ctrl-C / SIGTERM handling first (standard library only), then the CLI's imports.

Importing the CLI takes seconds (jax, the engine); an interrupt in that time printed a 29-63-line KeyboardInterrupt
traceback, and SIGTERM killed the process without a word.  Here either is one line and exit 130 / 143."""

import importlib
import signal
import sys


class _Terminated(KeyboardInterrupt):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated()


def _run(name: str, module: str, attr: str):
    signal.signal(signal.SIGTERM, _on_sigterm)      # the command's own handling (if any) from its start on
    try:
        mod = importlib.import_module(module, __package__)
    except KeyboardInterrupt as e:
        term = isinstance(e, _Terminated)
        print(f"\n{name}: " + ("terminated" if term else "interrupted"), file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGTERM if term else 130)
    signal.signal(signal.SIGTERM, getattr(mod, "_on_sigterm", signal.SIG_DFL))
    getattr(mod, attr)()


def glm_jax():
    _run("glm-jax", ".cli", "run")           # the CLI's SIGTERM handler: stats line, state saved, exit 143


def serve():
    _run("glm-jax-serve", ".serve.app", "run")


def convert():
    _run("glm-jax-convert", ".experts.convert", "run")


def evaluate():
    _run("glm-jax-eval", ".evaluate", "run")

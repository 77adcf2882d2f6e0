"""The `glm-jax` console entry: Ctrl-C / SIGTERM handling first (standard library only), then the CLI's imports.

Importing the CLI takes seconds (jax, the engine); an interrupt in that time printed a 29-63-line KeyboardInterrupt
traceback, and SIGTERM killed the process without a word.  Here either is one line and exit 130 / 143."""

import signal
import sys


class _Terminated(KeyboardInterrupt):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated()


def glm_jax():
    signal.signal(signal.SIGTERM, _on_sigterm)      # the CLI installs its own (state saved) once it runs
    try:
        from . import cli
    except KeyboardInterrupt as e:
        term = isinstance(e, _Terminated)
        print("\nglm-jax: " + ("terminated" if term else "interrupted"), file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGTERM if term else 130)
    signal.signal(signal.SIGTERM, cli._on_sigterm)    # the CLI's own from here: exit 143 through its handling
    cli.run()

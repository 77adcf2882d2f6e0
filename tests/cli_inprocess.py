"""Run a command's main in-process (no subprocess: no second jax import, and the session's compilation cache
applies): glm-jax and glm-jax-eval share one absl FLAGS registry (options.define_flags / define_once), so both can be
defined in one process.  Flags are reset after each run."""
import importlib


def define_all():
    from glm_jax import evaluate as ev
    from glm_jax import options as O

    importlib.import_module("glm_jax.cli")          # defines glm-jax's flags at import
    ev.define_flags()
    O.define_flags()


def run(argv, capsys):
    """argv[0] is "glm-jax" or "glm-jax-eval".  Returns (exit status, stdout, stderr)."""
    from absl import flags

    define_all()
    F = flags.FLAGS
    F(argv)
    try:
        if argv[0] == "glm-jax":
            from glm_jax import cli

            rc = cli.main([argv[0]])
        else:
            from glm_jax import evaluate as ev

            rc = ev.main([argv[0]])
    finally:
        F.unparse_flags()
    out = capsys.readouterr()
    return rc, out.out, out.err

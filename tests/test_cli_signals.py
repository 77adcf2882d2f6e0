"""The CLI's edges: SIGTERM behaves like Ctrl-C (the text kept, the stats line, the usage history saved, exit 143;
before: killed with no stats and the history lost); a prompt in a POSIX locale
without UTF-8 mode is the UTF-8 it was typed as (was refused as 'not valid UTF-8'); an empty --prompt_ids is an
error (it silently ran the default prompt); Engine.logits refuses a sequence past the context limit (257 tokens were
accepted at a limit of 256, 30,000 died of an XLA out-of-memory error)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import glm_jax
from glm_jax.errors import GlmJaxError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**kw):
    env = dict(os.environ)
    env.update({k: str(v) for k, v in kw.items()})
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(args, **env):
    return subprocess.Popen([sys.executable, "-m", "glm_jax.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(**env))


def test_sigterm_while_generating_is_like_ctrl_c(tmp_path):
    state = tmp_path / "state"
    # a simulated slow disk: each expert load waits ~0.2 s, so the run is still generating when the signal comes
    p = _start(["--cache_cap=1", "--fetch=loop", "--sim_disk_gbps=0.005", "--sim_expert_mb=1", "--ignore_eos",
                "--max_new_tokens=200", f"--state_dir={state}", "--compile_cache=off",
                f"--output_json={tmp_path / 'out.json'}"])
    first = p.stdout.read(8)                         # the prompt echoed and a generated token: decoding
    assert first.startswith(b"ROMEO:"), first
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "terminated" in err and "prefill" in err, err[-2000:]
    assert json.loads((tmp_path / "out.json").read_text())["interrupted"] is True
    assert any(n.endswith(".json") for _, _, fs in os.walk(state) for n in fs), list(os.walk(state))


def test_posix_locale_prompt_is_its_utf8(tmp_path):
    r = subprocess.run([sys.executable, "-m", "glm_jax.cli", "--prompt=Ромео:", "--max_new_tokens=1",
                        f"--output_json={tmp_path / 'o.json'}", "--state_dir=off"],
                       capture_output=True, env=_env(LC_ALL="POSIX", PYTHONUTF8="0", PYTHONIOENCODING="utf-8"),
                       timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    ids = glm_jax.Engine.load().encode("Ромео:")
    assert json.loads((tmp_path / "o.json").read_text())["prompt_tokens"] == ids


def test_empty_prompt_ids_is_an_error(capsys):
    from absl import flags

    from glm_jax import cli
    cli.parse_flags(["glm-jax", "--prompt_ids="])
    try:
        rc = cli.main(["glm-jax"])
    finally:
        flags.FLAGS.unparse_flags()
    err = capsys.readouterr().err
    assert rc == 2 and "--prompt_ids" in err and "no token ids" in err, err


def test_logits_past_the_context_limit():
    eng = glm_jax.Engine.load()
    try:
        n = eng.context_limit
        assert eng.logits(list(range(1, n + 1))).shape[0] == n
        with pytest.raises(GlmJaxError, match="context limit"):
            eng.logits(list(range(1, n + 2)))
        with pytest.raises(GlmJaxError, match="context limit"):
            eng.logits([1] * 30000)
    finally:
        eng.close()


def _console_entry(script):
    """A console script as pyproject.toml declares it (module, function)."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        mod, fn = tomllib.load(f)["project"]["scripts"][script].split(":")
    return mod, fn


@pytest.mark.parametrize("script", ["glm-jax", "glm-jax-serve", "glm-jax-convert", "glm-jax-eval"])
@pytest.mark.parametrize("sig,rc", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_while_importing_is_one_line(tmp_path, sig, rc, script):
    # a stand-in jax whose import delivers the signal: it arrives exactly while the entry is importing the engine
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text(f"import os\nos.kill(os.getpid(), {int(sig)})\n")
    mod, fn = _console_entry(script)
    env = _env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    p = subprocess.run([sys.executable, "-c", f"import {mod}; {mod}.{fn}()"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == rc and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().count("\n") == 0 and f"{script}:" in p.stderr, p.stderr

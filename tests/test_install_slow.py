"""The README's two install commands, one after the other, in a scratch venv, and a second start
that compiles nothing.  Slow (two installs, three runs): only with GLM_JAX_SLOW=1.

`pip install .` + a run used to write the usage history into site-packages/glm_jax/default_model/; the later
`pip install -e .` left that folder behind as an empty namespace package that shadowed the editable install
(`ImportError: cannot import name 'Engine' from 'glm_jax'`).  `--no-deps`: the
dependencies come from this venv's site-packages through a .pth file (the build backend, setuptools, is fetched by
pip as usual)."""

import json
import os
import subprocess
import sys
import sysconfig

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("GLM_JAX_SLOW") != "1", reason="slow: set GLM_JAX_SLOW=1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_readme_install_commands_in_sequence(tmp_path):
    src = tmp_path / "checkout"
    files = _run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO).stdout.split()
    for f in files:
        if os.path.isfile(os.path.join(REPO, f)):
            os.makedirs(src / os.path.dirname(f), exist_ok=True)
            with open(os.path.join(REPO, f), "rb") as a, open(src / f, "wb") as b:
                b.write(a.read())
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py, binp = str(venv / "bin" / "python"), str(venv / "bin")
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    with open(os.path.join(site, "zz_glm_jax_test_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")            # jax, numpy, ... from this venv
    env = dict(os.environ, PATH=binp + os.pathsep + os.environ["PATH"], VIRTUAL_ENV=str(venv))
    env.pop("PYTHONPATH", None)
    pip = [py, "-m", "pip", "install", "-q", "--no-deps"]           # build isolation: setuptools>=68 + wheel
    # README command 1: pip install . && glm-jax ...
    _run(pip + ["."], cwd=str(src), env=env)
    pkg = os.path.join(site, "glm_jax")
    before = sorted(os.listdir(os.path.join(pkg, "default_model")))
    out = str(tmp_path / "first.json")
    _run([os.path.join(binp, "glm-jax"), "--max_new_tokens=2", f"--output_json={out}"], cwd=str(tmp_path), env=env)
    assert sorted(os.listdir(os.path.join(pkg, "default_model"))) == before      # nothing written into the package
    state = os.path.join(os.environ["XDG_STATE_HOME"], "glm-jax", "usage")
    assert any(n.startswith("default_model-") for n in os.listdir(state))        # the history is in the state dir
    # README command 2: pip install -e '.[test]' (deps already there), then the engine from another directory
    _run(pip + ["-e", ".[test]"], cwd=str(src), env=env)
    r = _run([py, "-c", "import glm_jax; from glm_jax import Engine; print(glm_jax.__file__)"], cwd="/tmp", env=env)
    assert r.stdout.strip().startswith(str(src)), r.stdout
    # a second start compiles (almost) nothing: the persistent XLA cache in the per-user cache dir
    out2 = str(tmp_path / "second.json")
    _run([os.path.join(binp, "glm-jax"), "--max_new_tokens=2", f"--output_json={out2}"], cwd="/tmp", env=env)
    c1, c2 = (json.load(open(p))["stats"]["compile_s"] for p in (out, out2))
    print(f"compile_s first start {c1:.2f}, second start {c2:.2f}")
    assert c2 < 0.5 * c1, (c1, c2)

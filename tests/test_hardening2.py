"""Issue 22 (hardening 2), the command-line side: cached native code checked before it is loaded, outputs written
through links / devices / FIFOs, the converter never replacing a finished container, broken pipes and full disks
ending or continuing cleanly, memory promises, self-healing compile caches, opt-in environment aliases.

Each test injects the fault (a truncated / empty / foreign-owned library, a symlink / FIFO / device as output, ...).
The kernel tests compile the kernels in a subprocess (about 20 s each); everything else is cheap."""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from glm_jax import fileio, kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line(s: str):
    assert "\n" not in s.strip() and "Traceback" not in s, s


def _env(**kw):
    env = dict(os.environ)
    env.update({k: str(v) for k, v in kw.items()})
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ----------------------------------------------------------------------------- item 1: the kernel cache
_LOAD = "from glm_jax import kernels; ok = kernels.load(); print('LOADED', ok, kernels.last_error())"


def _built_cache(tmp_path):
    """A copy of this session's built kernels (the cache layout) under tmp_path/cache; returns (XDG dir, .so path)."""
    if not kernels.load():
        pytest.skip(f"native kernels unavailable: {kernels.last_error()}")
    src = kernels._cache_dir()
    xdg = tmp_path / "cache"
    dst = xdg / "glm-jax" / "kernels"
    shutil.copytree(src, dst)
    os.chmod(dst, 0o700)
    libs = sorted(p for p in os.listdir(dst) if p.endswith(".so") and "portable" not in p)
    return str(xdg), [str(dst / p) for p in libs]


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_cached_kernel_library_is_rebuilt_never_loaded(tmp_path, damage):
    """Before: a truncated .so -> 'Fatal Python error: Bus error' in dlopen on every run (exit 135); an empty one ->
    'file too short', the XLA path forever.  After: the size/sha256 stamp fails, the library is rebuilt and loads."""
    xdg, libs = _built_cache(tmp_path)
    for lib in libs:
        size = os.path.getsize(lib)
        with open(lib, "r+b") as f:
            f.truncate(size // 2 if damage == "truncated" else 0)
    r = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, timeout=600,
                       env=_env(XDG_CACHE_HOME=xdg))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "LOADED True None" in r.stdout, r.stdout + r.stderr
    assert "building the native kernels" in r.stderr
    ours = [p for p in libs if os.path.exists(p)]
    assert ours and all(kernels.file_problem(p) is None for p in ours)


_PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANT_MARKER"), "w"); if (f) { fputs("ran", f); fclose(f); }
}
"""


def test_a_library_planted_by_another_user_is_never_loaded(tmp_path):
    """Before: a world-writable cache dir with a library of another user under the expected name: loaded, its
    constructor ran.  After: the directory fails the owner/mode check; the kernels are built privately instead."""
    if os.getuid() != 0:
        pytest.skip("needs root to make files owned by another user")
    cxx = kernels._compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    xdg = tmp_path / "cache"
    d = xdg / "glm-jax" / "kernels"
    d.mkdir(parents=True)
    lib = kernels._library_path(cxx, (), str(d))
    (tmp_path / "plant.c").write_text("#include <stdlib.h>\n" + _PLANT)
    subprocess.run(["cc", "-shared", "-fPIC", str(tmp_path / "plant.c"), "-o", lib], check=True)
    marker = tmp_path / "marker"
    for p in (lib, str(d)):
        os.chown(p, 12345, 12345)
    os.chmod(d, 0o777)
    os.chmod(tmp_path, 0o755)
    r = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, timeout=600,
                       env=_env(XDG_CACHE_HOME=str(xdg), PLANT_MARKER=str(marker)))
    assert not marker.exists(), "the planted library's constructor ran"
    assert r.returncode == 0, r.stderr[-2000:]
    assert "LOADED True None" in r.stdout, r.stdout + r.stderr
    assert "owned by uid 12345" in r.stderr and "privately" in r.stderr


def test_foreign_owned_or_group_writable_library_files_are_untrusted(tmp_path):
    """The per-file half of the check (owner, mode, link, stamp), no compile needed."""
    lib = tmp_path / "qkernels-x.so"
    lib.write_bytes(b"\x7fELF" + b"\0" * 100)
    assert "build stamp" in kernels.file_problem(str(lib))
    (tmp_path / "qkernels-x.so.sha256").write_text(json.dumps({"size": 104, "sha256": kernels._sha256(str(lib))}))
    assert kernels.file_problem(str(lib)) is None
    os.chmod(lib, 0o666)
    assert "writable by other users" in kernels.file_problem(str(lib))
    os.chmod(lib, 0o644)
    with open(lib, "r+b") as f:
        f.truncate(50)
    assert "truncated" in kernels.file_problem(str(lib))
    os.unlink(lib)
    os.symlink("/bin/true", lib)
    assert "regular file" in kernels.file_problem(str(lib))


def test_a_relative_xdg_cache_home_is_ignored_for_kernels(monkeypatch, tmp_path):
    """Before: XDG_CACHE_HOME=rel built and loaded kernels under the working directory.  After: paths.py's rule
    (the XDG spec: a relative value is ignored) applies, as it does for the compile cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", "rel-cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setitem(kernels._state, "dir", None)
    assert kernels.build_dir() == os.path.join(str(tmp_path), ".cache", "glm-jax", "kernels")

"""Suite-wide settings.  Engines built by different tests compile many identical XLA programs (every Engine makes
its own jitted closures); a per-session persistent compilation cache lets the second engine reuse the first one's
executables, which keeps the suite within its time budget on 2 cores.

The suite is hermetic: XDG_CACHE_HOME and XDG_STATE_HOME point at one temp dir (removed at the end), so the engine's
per-user defaults (the compilation cache in $XDG_CACHE_HOME/glm-jax/xla, the native kernels built once per session
in $XDG_CACHE_HOME/glm-jax/kernels, usage histories in
$XDG_STATE_HOME/glm-jax) land there, for this process and every subprocess a test starts; nothing is written into the
real ~/.cache or ~/.local/state.  Under pytest-xdist (README's test command: -n auto) every worker process imports
this file and so gets its own temp dir and caches (JAX's cache writes its entries non-atomically: a worker must not
read one another is writing).

The native kernels are built once for the whole session: the workers' (and their subprocesses')
$XDG_CACHE_HOME/glm-jax/kernels is a link to the first process's (the xdist controller's) directory; the build
takes a lock and renames its finished files into place (glm_jax/kernels), so one worker builds while the other
waits, instead of both compiling the same library (and its portable variant).

Scheduling under xdist (``--dist=loadgroup``, set in pyproject.toml's addopts): the tests of one module form one
group, run by one worker, so a module fixture is built once and a test's own engine finds the programs its
module's other tests compiled in that worker's persistent cache (two tests of test_mtp loading the same engine: 41
s for the first, 6 s for the second in one process; scattered over both workers, each compiled everything).  The
groups are handed out longest first (the order of ``_FIRST``, then by test count): a worker that finishes
early takes the next, and the small ones even out the end."""

import os
import shutil
import tempfile

import numpy as np
import pytest

_ROOT = tempfile.mkdtemp(prefix="glm-jax-test-home-")
os.environ["XDG_CACHE_HOME"] = os.path.join(_ROOT, "cache")
os.environ["XDG_STATE_HOME"] = os.path.join(_ROOT, "state")
_KERNELS = os.path.join(os.environ["XDG_CACHE_HOME"], "glm-jax", "kernels")     # == glm_jax.kernels.build_dir()
# the first process's (xdist's controller, started before its workers: they inherit its environment)
_SHARED_KERNELS = os.environ.setdefault("GLM_JAX_TEST_SHARED_KERNELS", _KERNELS)
os.makedirs(os.path.dirname(_KERNELS), exist_ok=True)
if _SHARED_KERNELS != _KERNELS and os.path.isdir(_SHARED_KERNELS):
    os.symlink(_SHARED_KERNELS, _KERNELS)
else:
    os.makedirs(_KERNELS, mode=0o700, exist_ok=True)

import jax  # noqa: E402  (after the environment is set)

_CACHE = os.path.join(os.environ["XDG_CACHE_HOME"], "glm-jax", "xla")     # == glm_jax.paths.cache_root()
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_ROOT, ignore_errors=True)


# handed out in this order (the longest first, from CI's --durations: test_mesh / test_multiprocess are a few
# subprocesses, not many tests); the rest after them by test count
_FIRST = ("test_mesh", "test_multiprocess", "test_scheduler", "test_server", "test_mtp", "test_streaming",
          "test_plugins", "test_hardening", "test_convert", "test_fit", "test_store", "test_hardening2", "test_fused",
          "test_server_hardening", "test_fuzz", "test_eval", "test_engine_golden", "test_engine_plugins")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False        # xdist's order by test count: the order below instead


def pytest_itemcollected(item):
    # per item as it is collected: xdist's pytest_collection_modifyitems (which turns the marks into scheduling
    # groups) runs before a conftest's, so the mark is added here
    item.add_marker(pytest.mark.xdist_group(item.module.__name__.rpartition(".")[2]))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # under xdist only (a worker: its collection is what the controller schedules, in this order); one process (-n 0)
    # runs the files in their usual order
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    mods = {}
    for it in items:
        mods.setdefault(it.module.__name__.rpartition(".")[2], []).append(it)

    def rank(m):
        return (0, _FIRST.index(m)) if m in _FIRST else (1, -len(mods[m]))
    items[:] = [it for m in sorted(mods, key=rank) for it in mods[m]]


# ----------------------------------------------------------------------------- the streamed golden model
# tests/test_streaming.py and tests/test_fused.py: glm4moe_full's expected outputs and its int4 container (one per
# module, as a module fixture each had)
GLM4MOE_FULL = os.path.join(os.path.dirname(__file__), "golden", "glm4moe_full")


@pytest.fixture(scope="module")
def exp():
    return dict(np.load(os.path.join(GLM4MOE_FULL, "expected.npz")))


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    from glm_jax.experts.convert import convert

    dst = str(tmp_path_factory.mktemp("c") / "int4")
    convert(GLM4MOE_FULL, dst, expert_format="int4_g64", mtp_format="int8_row", dense_format="f32", progress=False)
    return dst

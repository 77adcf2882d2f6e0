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

Scheduling under xdist (``--dist=loadgroup``, set in pyproject.toml's addopts): the tests of one module that use a
module-scoped fixture (an engine, a server, a converted container, the mesh subprocess) form one group, run by one
worker, so the fixture is built once; every other test is scheduled on its own.  xdist hands out the biggest groups
first and the single tests last, which evens out the workers' finishing times."""

import os
import shutil
import tempfile

import numpy as np
import pytest

_ROOT = tempfile.mkdtemp(prefix="glm-jax-test-home-")
os.environ["XDG_CACHE_HOME"] = os.path.join(_ROOT, "cache")
os.environ["XDG_STATE_HOME"] = os.path.join(_ROOT, "state")

import jax  # noqa: E402  (after the environment is set)

_CACHE = os.path.join(os.environ["XDG_CACHE_HOME"], "glm-jax", "xla")     # == glm_jax.paths.cache_root()
os.makedirs(_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_ROOT, ignore_errors=True)


def pytest_itemcollected(item):
    # per item as it is collected: xdist's pytest_collection_modifyitems (which turns the marks into scheduling
    # groups) runs before a conftest's, so the mark is added here
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    shared = [name for name, defs in info.name2fixturedefs.items()
              if defs and defs[-1].scope in ("module", "package", "session") and defs[-1].baseid]
    if shared:                             # baseid "": a plugin's fixture (tmp_path_factory), not the suite's own
        item.add_marker(pytest.mark.xdist_group(item.module.__name__.rpartition(".")[2]))


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


@pytest.fixture
def over_budget_container(tmp_path):
    """A converted model whose experts do not fit beside the runtime in a 300 MB budget (4 layers, H 512, 64 bf16
    experts of 1.5 MB a layer, top-8): ``make(**config overrides) -> container dir`` (tests/test_store.py's peak
    RSS test, tests/test_fit.py's outgrown plan)."""
    from glm_jax.experts.convert import convert
    from tools.fixtures.synth_model import tiny_config, write_hf_checkpoint

    def make(**over):
        kw = dict(vocab_size=256, hidden_size=512, intermediate_size=512, moe_intermediate_size=512,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  n_routed_experts=64, num_experts_per_tok=8, num_nextn_predict_layers=0, torch_dtype="bfloat16")
        cfg = tiny_config(**{**kw, **over})
        write_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=1, dtype="bfloat16", keep_reference=False)
        convert(str(tmp_path / "hf"), str(tmp_path / "c"), expert_format="bf16", progress=False)
        return str(tmp_path / "c")

    return make

"""Suite-wide settings.  Engines built by different tests compile many identical XLA programs (every Engine makes
its own jitted closures); a per-session persistent compilation cache lets the second engine reuse the first one's
executables, which keeps the suite within its time budget on 2 cores.

The suite is hermetic: XDG_CACHE_HOME and XDG_STATE_HOME point at one temp dir (removed at the end), so the engine's
per-user defaults (the compilation cache in $XDG_CACHE_HOME/glm-jax/xla, the native kernels built once per session
in $XDG_CACHE_HOME/glm-jax/kernels, usage histories in
$XDG_STATE_HOME/glm-jax) land there, for this process and every subprocess a test starts; nothing is written into the
real ~/.cache or ~/.local/state."""

import os
import shutil
import tempfile

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

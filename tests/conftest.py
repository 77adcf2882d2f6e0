"""Suite-wide settings.  Engines built by different tests compile many identical XLA programs (every Engine makes
its own jitted closures); a per-session persistent compilation cache lets the second engine reuse the first one's
executables, which keeps the suite within its time budget on 2 cores.  The cache lives in a temp dir and dies with
the session (no state is shared between runs)."""

import os
import shutil
import tempfile

import jax

_CACHE = tempfile.mkdtemp(prefix="glm-jax-xla-cache-")
# per-user caches (the native kernels' build) go to the session's temp dir, inherited by subprocesses: the suite
# builds the kernels once and never writes into the real ~/.cache
os.environ["XDG_CACHE_HOME"] = os.path.join(_CACHE, "xdg")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)

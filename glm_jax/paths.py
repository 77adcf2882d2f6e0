"""Per-user directories for what glm-jax writes at run time: the experts' usage history (state) and the persistent
XLA compilation cache (cache).  Never the installed package, never a model directory.

    state_root(opt)   --state_dir: '' -> $XDG_STATE_HOME/glm-jax (~/.local/state/glm-jax); 'off' -> None; else opt
    cache_root(opt)   --compile_cache: '' -> $XDG_CACHE_HOME/glm-jax/xla (~/.cache/glm-jax/xla); 'off' -> None
    usage_file(root, model_dir)   <root>/usage/<model dir name>-<hash of its real path>.json
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Optional


def _xdg(var: str, fallback: str) -> str:
    v = os.environ.get(var, "")
    if v and os.path.isabs(v):         # the XDG spec: relative values are ignored
        return v
    return os.path.join(os.path.expanduser("~"), fallback)


def state_root(opt: str = "") -> Optional[str]:
    if opt == "off":
        return None
    return os.path.abspath(opt) if opt else os.path.join(_xdg("XDG_STATE_HOME", ".local/state"), "glm-jax")


def cache_root(opt: str = "") -> Optional[str]:
    if opt == "off":
        return None
    return os.path.abspath(opt) if opt else os.path.join(_xdg("XDG_CACHE_HOME", ".cache"), "glm-jax", "xla")


def model_key(model_dir: str) -> str:
    """A readable, collision-free file stem for a model directory (its name + a hash of its real path)."""
    real = os.path.realpath(model_dir)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(real.rstrip("/")) or "model")[:48]
    return f"{name}-{hashlib.sha256(real.encode()).hexdigest()[:12]}"


def usage_file(root: Optional[str], model_dir: str) -> Optional[str]:
    return None if root is None else os.path.join(root, "usage", model_key(model_dir) + ".json")

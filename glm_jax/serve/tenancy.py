"""Who a request belongs to: the server's API keys (--api_key, --api_key_file, $GLM_JAX_API_KEY) and the prefix
cache's tenant.

The prefix cache reuses a finished request's K/V for a later prompt that starts with the same tokens, and reports it
as ``usage.prompt_tokens_details.cached_tokens``: across clients that number (and the time to the first token) tells
one client how much of another's prompt it guessed.  So by default (``--prefix_cache_scope=key``) K/V is reused only
between requests made with the same API key, and a request's ``cache_salt`` (vLLM's field) splits its key's cache
further; ``--prefix_cache_scope=global`` shares it between keys (faster for clients that share system prompts, and
the side channel is then open between them)."""

from __future__ import annotations

import hmac
import os
from typing import Optional

from .. import fileio
from ..errors import GlmJaxError

ENV_KEY = "GLM_JAX_API_KEY"        # the key from the environment: not in /proc/PID/cmdline for every local user
SCOPES = ("key", "global")
MAX_SALT = 1024                    # characters of a cache_salt
KEY_FILE_MAX = 1 << 20


class Keys:
    """The accepted API keys (none: no authentication); ``match`` gives the tenant of an Authorization header."""

    def __init__(self, keys):
        if isinstance(keys, str):
            keys = [keys]
        self.keys = [k.encode("utf-8") for k in keys or () if k]

    def __bool__(self):
        return bool(self.keys)

    def match(self, header: bytes) -> Optional[int]:
        """The index of the key a 'Bearer KEY' header carries (every key compared in constant time), or None."""
        if not header.startswith(b"Bearer "):
            return None
        got, found = header[7:].strip(), None
        for i, k in enumerate(self.keys):
            if hmac.compare_digest(got, k) and found is None:
                found = i
        return found


def read_key_file(path: str) -> list:
    """--api_key_file: one key a line (blank lines and '#' comments skipped); a file others may read is refused
    (the key's point is that they can't)."""
    try:
        st = os.stat(path)
        data = fileio.read_bounded(path, KEY_FILE_MAX)
    except OSError as e:
        raise GlmJaxError(f"--api_key_file={path}: cannot read ({e.strerror or e})") from None
    if st.st_mode & 0o077:
        raise GlmJaxError(f"--api_key_file={path}: readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise GlmJaxError(f"--api_key_file={path}: not UTF-8 text") from None
    keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise GlmJaxError(f"--api_key_file={path}: no key in it")
    return keys


def api_keys(flag_key: str, key_file: str, environ=os.environ) -> tuple[list, Optional[str]]:
    """(the keys, a warning or None) from --api_key, --api_key_file and $GLM_JAX_API_KEY (all of them accepted)."""
    keys = [flag_key] if flag_key else []
    if key_file:
        keys += read_key_file(key_file)
    if environ.get(ENV_KEY):
        keys.append(environ[ENV_KEY])
    warn = None
    if flag_key:
        warn = (f"--api_key is visible to every local user in /proc/PID/cmdline; use --api_key_file or "
                f"${ENV_KEY}")
    return keys, warn


def cache_salt(body: dict, tenant: Optional[int], scope: str):
    """The prefix cache's salt of a request: its key (scope "key") and its ``cache_salt``; GlmJaxError naming the
    field for a bad one."""
    cs = body.get("cache_salt")
    if cs is not None and (not isinstance(cs, str) or not cs or len(cs) > MAX_SALT):
        raise GlmJaxError(f"'cache_salt': expected a non-empty string of at most {MAX_SALT} characters")
    key = tenant if scope == "key" else None
    return None if key is None and cs is None else (key, cs)

"""The persistent XLA compilation cache, kept healthy: ``heal(d)`` removes entries that can't be read back.

JAX treats an unreadable entry (overwritten, truncated, a foreign file under an entry's name) as a miss, warns
("Error reading persistent compilation cache entry ..."), recompiles, and then does not replace it (its LRU cache
never overwrites an existing key): every later run warns and recompiles again.  ``heal`` decompresses every entry it
has not checked before (zlib, or zstd where JAX uses it: both carry checksums, so damage shows) and deletes the ones
that fail, so the next compile writes a good one.  Entries already checked are remembered by (size, mtime) in
``.glm-jax-checked.json`` in the cache directory; an entry younger than ``MIN_AGE_S`` may still be being written and
is left for the next start.
"""

from __future__ import annotations

import json
import os
import time
import zlib

INDEX = ".glm-jax-checked.json"
MIN_AGE_S = 2.0


def _decompresses(data: bytes) -> bool:
    try:
        zlib.decompress(data)
        return True
    except zlib.error:
        pass
    for mod, fn in (("compression.zstd", "decompress"), ("zstandard", None)):
        try:
            m = __import__(mod, fromlist=["_"])
        except ImportError:
            continue
        try:
            if fn:
                getattr(m, fn)(data)
            else:
                m.ZstdDecompressor().decompress(data)
            return True
        except Exception:           # noqa: BLE001  (each library has its own error class)
            return False
    return False


def heal(d: str) -> int:
    """Delete the unreadable entries (``*-cache`` files) of the compilation cache ``d``; returns how many.  Best
    effort: an I/O problem is never an error of the run."""
    try:
        names = [n for n in os.listdir(d) if n.endswith("-cache")]
    except OSError:
        return 0
    ipath = os.path.join(d, INDEX)
    try:
        with open(ipath) as f:
            seen = json.load(f)
        if not isinstance(seen, dict):
            seen = {}
    except (OSError, ValueError):
        seen = {}
    now, removed, out = time.time(), 0, {}
    for n in names:
        p = os.path.join(d, n)
        try:
            st = os.stat(p)
        except OSError:
            continue
        sig = [st.st_size, st.st_mtime_ns]
        if seen.get(n) == sig:
            out[n] = sig
            continue
        if now - st.st_mtime < MIN_AGE_S:
            continue
        try:
            with open(p, "rb") as f:
                ok = _decompresses(f.read())
        except OSError:
            continue
        if ok:
            out[n] = sig
            continue
        try:
            os.remove(p)
            removed += 1
        except OSError:
            pass
    if out != seen:
        tmp = f"{ipath}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, ipath)
        except OSError:
            try:
                os.remove(tmp)
            except OSError:
                pass
    return removed

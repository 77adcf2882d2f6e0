"""The persistent XLA compilation cache, kept healthy and trusted: ``heal(d)`` removes entries that can't be read
back or that this process did not write.

JAX treats an unreadable entry (overwritten, truncated, a foreign file under an entry's name) as a miss, warns
("Error reading persistent compilation cache entry ..."), recompiles, and then does not replace it (its LRU cache
never overwrites an existing key): every later run warns and recompiles again.  ``heal`` decompresses every entry it
has not checked before (zlib, or zstd where JAX uses it: both carry checksums, so damage shows) and deletes the ones
that fail, so the next compile writes a good one.  Entries already checked are remembered by (size, mtime) in
``.glm-jax-checked.json`` in the cache directory; an entry younger than ``MIN_AGE_S`` may still be being written and
is left for the next start.

An entry is a compiled program: native code the process loads and runs.  The directory itself is checked by the
engine like the kernels' (owner, no group / world write up to the root: ``kernels.dir_problem``); here every entry
must be a regular file of this user that nobody else may write (a symlink, a foreign or group/world-writable file is
removed), and an entry already checked must be the same file it was (size, mtime, inode): JAX writes an entry once and
never overwrites a key, so a checked entry that changed -- swapped with another entry, rewritten -- was not JAX's doing
and is removed (a swapped pair crashed the run with 'result is incompatible with its layout annotation').
"""

from __future__ import annotations

import json
import os
import stat
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


def _foreign(st) -> bool:
    """Not a regular file of this user that only this user may write."""
    return not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or bool(st.st_mode & 0o022)


def _index(ipath: str) -> dict:
    try:
        st = os.lstat(ipath)
        if _foreign(st):
            return {}
        with open(ipath) as f:
            seen = json.load(f)
        return seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        return {}


def heal(d: str) -> int:
    """Delete the unreadable, foreign and changed entries (``*-cache`` files) of the compilation cache ``d``;
    returns how many.  Best effort: an I/O problem is never an error of the run."""
    try:
        names = [n for n in os.listdir(d) if n.endswith("-cache")]
    except OSError:
        return 0
    ipath = os.path.join(d, INDEX)
    seen = _index(ipath)
    now, removed, out = time.time(), 0, {}
    for n in names:
        p = os.path.join(d, n)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        sig = [st.st_size, st.st_mtime_ns, st.st_ino]
        old = seen.get(n)
        ok = None
        if _foreign(st):
            ok = False
        elif isinstance(old, list) and old:
            if old == sig[:len(old)]:            # (an index of older releases holds no inode)
                out[n] = sig
                continue
            ok = False                           # checked before and changed since: not JAX's write
        elif now - st.st_mtime < MIN_AGE_S:
            continue
        if ok is None:
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

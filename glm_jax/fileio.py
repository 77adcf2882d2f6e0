"""Writing what the user named, and locks: the one place for both (a leaf module: stdlib only).

    write_output(path, data)     an output file the user gave (--output_json, ...): a regular file (or a name not
                                 there yet) is written to a temp file in the directory of the file it resolves to
                                 (through symlinks) and renamed over it, so a reader never sees half of it and a
                                 symlink stays a symlink; anything else that exists (a device such as /dev/stdout, a
                                 FIFO, a pipe, a hard-linked file) is written through, in place.  A FIFO with no
                                 reader is an error after ``fifo_wait_s``, never a hang.
    append_output(path, text)    the same rules for appending a line (--route_trace): a regular file is opened for
                                 appending, anything else written through
    output_problem(path)         None, or why ``write_output`` would fail (checked before long work; creates and
                                 opens nothing: a FIFO is not opened, a device is not touched)
    exclusive_lock(path)         an flock on ``path`` (created if needed) held for a ``with`` block; blocking, or
                                 raising LockBusy at once with ``blocking=False``; ``remove=True`` unlinks it at the
                                 end, safely (the inode is re-checked after locking)
    directory_lock(path)         the same on a directory itself
    read_bounded(path, limit)    every file the project reads whole (JSON, tokenizer, manifest, index, keys): a
                                 regular file of at most ``limit`` bytes, else FileProblem (an OSError) -- a FIFO is
                                 opened without blocking and never read, /dev/zero is refused, not read until OOM
    read_json(path, limit)       read_bounded + json.loads; a bad document (a 100,000-digit integer included) is a
                                 FileProblem naming why, never a traceback
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import time
from typing import Optional


JSON_MAX = 64 << 20          # config.json, generation_config, manifest.json, a sharded index, tokenizer_config
TOKENIZER_MAX = 256 << 20    # tokenizer.json (GLM-4.5's: 20 MB)


class FileProblem(OSError):
    """A file refused by ``read_bounded`` / ``read_json``: ``str()`` is the one-line reason, without the path."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self.strerror = msg

    def __str__(self):
        return self.strerror


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def read_bounded(path: str, limit: int) -> bytes:
    """The bytes of regular file ``path``, at most ``limit`` of them; FileProblem for anything else (a FIFO is
    opened O_NONBLOCK, so no writer is waited for, and never read; a file that grows past the limit while read is
    refused too)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem(f"{_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FileProblem(f"{st.st_size} bytes, more than the {limit >> 20} MB a file of this kind may have")
        parts, n = [], 0
        while True:
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            parts.append(b)
            n += len(b)
            if n > limit:
                raise FileProblem(f"more than the {limit >> 20} MB a file of this kind may have")
        return b"".join(parts)
    finally:
        os.close(fd)


def read_json(path: str, limit: int = JSON_MAX):
    """The JSON document in ``path`` (read_bounded); FileProblem for invalid JSON, invalid UTF-8, a number past
    Python's integer digit limit or nesting past its recursion limit."""
    import json

    data = read_bounded(path, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise FileProblem("invalid JSON (nested too deeply)") from None
    except UnicodeDecodeError as e:
        raise FileProblem(f"not UTF-8 (byte {e.start})") from None
    except ValueError as e:
        raise FileProblem(f"invalid JSON ({str(e).splitlines()[0][:200]})") from None


class LockBusy(OSError):
    """``exclusive_lock(blocking=False)``: another process holds the lock."""


def _via_proc(path: str) -> bool:
    """``path`` names an open file descriptor (/dev/stdout, /dev/fd/N, /proc/self/fd/N, through any links): its
    'target' is whatever the fd is open on, to be written through, never replaced by name."""
    p = os.path.abspath(path)
    for _ in range(40):
        if p.startswith("/proc/") or p.startswith("/dev/fd/"):
            return True
        if not os.path.islink(p):
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return False


def _through(st: os.stat_result, path: str) -> bool:
    """Write in place rather than replace: not a regular file, a file with other hard links, or an open fd."""
    return not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or _via_proc(path)


def output_problem(path: str) -> Optional[str]:
    """None if ``path`` can be written by ``write_output``, else what is wrong (one phrase)."""
    if not path:
        return "empty path"
    try:
        st = os.stat(path)          # follows links
    except FileNotFoundError:
        st = None
    except OSError as e:
        return f"cannot be reached ({e.strerror or e})"
    if st is not None and stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if st is not None and _through(st, path):
        return None if os.access(path, os.W_OK) else "not writable (permission denied)"
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    if st is not None and not os.access(real, os.W_OK):
        return "not writable (permission denied)"
    return None


def _open_through(path: str, fifo_wait_s: float) -> int:
    """An fd writing into an existing non-regular file; a FIFO without a reader: OSError(ENXIO) after the wait."""
    deadline = time.monotonic() + fifo_wait_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            break
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() >= deadline:
                if e.errno == errno.ENXIO:
                    raise OSError(errno.ENXIO, f"a FIFO with no reader (waited {fifo_wait_s:g} s)") from None
                raise
            time.sleep(0.05)
    os.set_blocking(fd, True)
    return fd


def write_output(path: str, data, fifo_wait_s: float = 5.0):
    """Write ``data`` (str: UTF-8, or bytes) to the user's ``path`` (module docstring); OSError on failure, with
    nothing half-written left under the path of a regular file."""
    b = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    real = os.path.realpath(path)
    if st is not None and _through(st, path):
        fd = _open_through(path, fifo_wait_s)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                if _via_proc(path):          # `> file` shared with the text on stdout: after it, not over it
                    os.lseek(fd, 0, os.SEEK_END)
                else:                        # a hard-linked file: its content replaced, every name sees it
                    os.ftruncate(fd, 0)
            _write_all(fd, b)
        finally:
            os.close(fd)
        return
    parent = os.path.dirname(real)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(real) + ".", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b)
            f.flush()
            os.fsync(f.fileno())
        mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _write_all(fd: int, b: bytes):
    """os.write until every byte of ``b`` is written (a pipe or device may take less per call)."""
    view = memoryview(b)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def append_output(path: str, data, fifo_wait_s: float = 5.0):
    """Append ``data`` to ``path`` (created if absent); a FIFO / device is written through, a FIFO without a reader
    is OSError(ENXIO) after the wait, never a hang."""
    b = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        fd = _open_through(path, fifo_wait_s)
    else:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        _write_all(fd, b)
    finally:
        os.close(fd)


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


@contextlib.contextmanager
def exclusive_lock(path: str, blocking: bool = True, remove: bool = False):
    """flock(LOCK_EX) on the file ``path`` (created if needed) for the ``with`` block.  ``blocking=False``: LockBusy
    at once if another process (or another open of it in this one) holds it.  ``remove``: the file is unlinked when
    the block ends (while still held); a lock taken on a file that was unlinked meanwhile is retaken on the new one,
    so two holders can never both believe they have it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise LockBusy(errno.EWOULDBLOCK, "held by another process", path) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield fd
    finally:
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def directory_lock(path: str, blocking: bool = True):
    """flock(LOCK_EX) on the directory ``path`` itself (no file created: for a directory whose parent is not
    writable); LockBusy as ``exclusive_lock``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LockBusy(errno.EWOULDBLOCK, "held by another process", path) from None
        yield fd
    finally:
        os.close(fd)

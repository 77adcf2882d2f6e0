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

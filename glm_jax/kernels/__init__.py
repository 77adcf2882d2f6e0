"""Native CPU kernels (qkernels.cc), registered with XLA through ``jax.ffi``: they run inside the jitted step.

The C++ source ships with the package and is compiled on first use with the machine's C++ compiler (``$CXX`` or
g++/c++, ``-O3 -march=native``) against the FFI headers of the installed jaxlib, into the per-user cache
(``$XDG_CACHE_HOME/glm-jax/kernels``, or ``~/.cache/glm-jax/kernels``; ``set_build_dir`` moves it).  The library name
carries a hash of the source, compiler, flags, jaxlib version and CPU flags, so an upgrade or another CPU builds
anew, and nothing is written into the installed package (a relative ``$XDG_CACHE_HOME`` is ignored, as paths.py
does).  Building is atomic (temp file + rename) and serialised between processes by a lock file; a size + sha256
stamp is written beside the library, and a cached library is loaded only after the checks of ``file_problem`` /
``dir_problem`` (owner, mode, stamp: below); anything failing them is rebuilt, never handed to dlopen.  Where no compiler is found or the build fails, ``available()`` is False and the
engine runs its XLA path (``--kernels=auto``; ``--kernels=native`` makes that an error).

Formats (glm_jax/kernels/formats.py is the numpy reference): f32, bf16 row-major (f32 activations, exact dot
products); int8_row and int4_g<G>/int4_row in the tiles layout (formats.to_tiles; activations quantized to int8
per 64-block, integer dot products with AVX-512 VNNI where present, the same integer sums in portable C++ elsewhere).
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from typing import Optional

import numpy as np

from .. import fileio, paths

FMT_CODE = {"f32": 0, "bf16": 1, "int8_row": 2, "int4": 3}
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qkernels.cc")
CXXFLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w"]

_lock = threading.Lock()
_state = {"lib": None, "error": None, "tried": False, "dir": None}


class KernelError(RuntimeError):
    pass


def set_build_dir(path: str | None):
    """Where built libraries go (None: the per-user cache).  Must be called before the first ``load``."""
    _state["dir"] = path


def build_dir() -> str:
    if _state["dir"]:
        return _state["dir"]
    return os.path.join(paths._xdg("XDG_CACHE_HOME", ".cache"), "glm-jax", "kernels")   # relative: ignored


# ----------------------------------------------------------------------------- trusting a cached library
# A cached library is loaded only when (1) no other user can have put it there: the directory and every directory
# above it are owned by this user or root and writable by nobody else (a sticky world-writable one like /tmp is
# fine), as OpenSSH checks ~/.ssh; (2) the file itself is a regular file (not a link) owned by this user, writable
# by nobody else; (3) its size and sha256 match the stamp written beside it when it was built.  (3) is what keeps a
# truncated or emptied library (a full disk, a killed copy) from reaching dlopen, where it would end the process
# with SIGBUS; any failed check rebuilds it.
def _stamp_path(lib: str) -> str:
    return lib + ".sha256"


def dir_problem(d: str) -> str | None:
    """None if only this user (or root) can change what ``d`` holds, else why not (one phrase)."""
    uid = os.getuid()
    p = os.path.realpath(d)
    while True:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid not in (uid, 0):
                return f"{p} is owned by uid {st.st_uid}"
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                return f"{p} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
        up = os.path.dirname(p)
        if up == p:
            return None
        p = up


def file_problem(lib: str) -> str | None:
    """None if ``lib`` is a library this user built here, intact (its stamp's size and sha256), else why not."""
    try:
        st = os.lstat(lib)
    except FileNotFoundError:
        return "not built yet"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    try:
        stamp = fileio.read_json(_stamp_path(lib), 1 << 20)
        want_size, want_hash = int(stamp["size"]), str(stamp["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "no valid build stamp"
    if os.lstat(_stamp_path(lib)).st_uid != os.getuid():
        return "build stamp owned by another user"
    if st.st_size != want_size:
        return f"size {st.st_size} bytes, built as {want_size} (truncated?)"
    if _sha256(lib) != want_hash:
        return "content differs from its build stamp"
    return None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_dir() -> str:
    """The build directory, made private if it is ours; a directory others can write into (or above ours) is not
    used: this process builds into a private temporary directory instead (and says so, once)."""
    d = build_dir()
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.stat(d)
        if st.st_uid == os.getuid() and st.st_mode & 0o022:
            os.chmod(d, stat.S_IMODE(st.st_mode) & ~0o022)
    except OSError:
        pass
    why = dir_problem(d)
    if why is None:
        return d
    if _state.get("private") is None:
        _state["private"] = tempfile.mkdtemp(prefix="glm-jax-kernels-")
        atexit.register(shutil.rmtree, _state["private"], True)
        print(f"glm-jax: note: not using the kernel cache {d} ({why}); building the kernels privately for this "
              f"run (make it yours and mode 700, or set XDG_CACHE_HOME)", file=sys.stderr, flush=True)
    return _state["private"]


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor()


def _library_path(cxx: str, extra=(), d: str | None = None) -> str:
    import jaxlib

    with open(SOURCE, "rb") as f:
        src = f.read()
    try:
        ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        ver = cxx
    h = hashlib.sha256()
    for part in (src, ver.encode(), " ".join(CXXFLAGS + list(extra)).encode(), jaxlib.__version__.encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return os.path.join(d or build_dir(), f"qkernels-{h.hexdigest()[:20]}.so")


def _build(cxx: str, out: str, extra=()):
    """Build ``out`` unless a trusted copy is there (checked again under the lock: another process may just have
    built it); an untrusted one is removed first.  The stamp is written after the library: a library without one is
    rebuilt."""
    import jax

    d = os.path.dirname(out)
    os.makedirs(d, mode=0o700, exist_ok=True)
    with open(os.path.join(d, ".lock"), "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if file_problem(out) is None:
            return
        for p in (out, _stamp_path(out)):
            if os.path.lexists(p):
                os.unlink(p)
        fd, tmp = tempfile.mkstemp(prefix=".qkernels-", suffix=".so.tmp", dir=d)
        os.close(fd)
        print(f"glm-jax: building the native kernels into {d} (once per machine and jaxlib, "
              "about 10 s)", file=sys.stderr, flush=True)
        try:
            cmd = [cxx, *CXXFLAGS, *extra, "-isystem", jax.ffi.include_dir(), SOURCE, "-o", tmp]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                msg = (r.stderr or r.stdout).strip().splitlines()
                raise KernelError(f"{os.path.basename(cxx)} failed on {SOURCE}: {msg[-1] if msg else r.returncode}")
            os.chmod(tmp, 0o755)
            stamp = json.dumps({"size": os.path.getsize(tmp), "sha256": _sha256(tmp)})
            os.replace(tmp, out)
            with open(tmp, "w") as f:
                f.write(stamp)
            os.replace(tmp, _stamp_path(out))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _checked_library(cxx: str, extra=()):
    """The kernels library, loaded only after ``file_problem`` found nothing wrong (rebuilt otherwise)."""
    path = _library_path(cxx, extra, _cache_dir())
    if file_problem(path) is not None:
        _build(cxx, path, extra)
    why = file_problem(path)
    if why is not None:
        raise KernelError(f"{path}: {why} (after building it)")
    return ctypes.cdll.LoadLibrary(path)


def load(required: bool = False) -> bool:
    """Build (once per machine) and register the kernels.  False (with ``last_error()``) if they can't be had here;
    ``required`` raises KernelError instead."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                _state["lib"] = _load()
            except (KernelError, OSError, subprocess.SubprocessError) as e:
                _state["error"] = str(e)
    if required and _state["lib"] is None:
        raise KernelError(f"native kernels unavailable: {_state['error']}")
    return _state["lib"] is not None


def _load():
    import jax

    if jax.default_backend() != "cpu":
        raise KernelError(f"the native kernels are CPU kernels (backend is {jax.default_backend()})")
    cxx = _compiler()
    if cxx is None:
        raise KernelError("no C++ compiler found ($CXX, g++, c++, clang++)")
    lib = _checked_library(cxx)
    jax.ffi.register_ffi_target("glmjax_qlinear", jax.ffi.pycapsule(lib.GlmJaxQLinear), platform="cpu")
    jax.ffi.register_ffi_target("glmjax_qlinear_grouped", jax.ffi.pycapsule(lib.GlmJaxQLinearGrouped), platform="cpu")
    jax.ffi.register_ffi_target("glmjax_moe", jax.ffi.pycapsule(lib.GlmJaxMoe), platform="cpu")
    jax.ffi.register_ffi_target("glmjax_moe_clamped", jax.ffi.pycapsule(lib.GlmJaxMoeClamped), platform="cpu")
    jax.ffi.register_ffi_target("glmjax_sink", jax.ffi.pycapsule(lib.GlmJaxSink), platform="cpu")
    jax.ffi.register_ffi_target("glmjax_attn", jax.ffi.pycapsule(lib.GlmJaxAttn), platform="cpu")
    i32, i64, p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    for name, res, args in (("glmjax_sink_open", i32, ()), ("glmjax_sink_close", None, (i32,)),
                            ("glmjax_sink_reset", ctypes.c_int, (i32, i64)),
                            ("glmjax_sink_wait", i64, (i32, i64, i64, p, i64, p, i64, p)),
                            ("glmjax_sink_set", None, (i32, p, i64, i32)), ("glmjax_set_spin_ns", i64, (i64,))):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, list(args)
    return lib


def load_portable() -> str:
    """Build and register the portable variant (no AVX-512 VNNI code: what a CPU without it runs) under the target
    suffix returned ("_portable"), beside the native one (tests compare the two)."""
    import jax

    with _lock:
        if _state.get("portable") is None:
            cxx = _compiler()
            if cxx is None:
                raise KernelError("no C++ compiler found ($CXX, g++, c++, clang++)")
            lib = _checked_library(cxx, ("-DGLMJAX_PORTABLE",))
            for name, sym in (("glmjax_qlinear", lib.GlmJaxQLinear), ("glmjax_qlinear_grouped", lib.GlmJaxQLinearGrouped),
                              ("glmjax_moe", lib.GlmJaxMoe), ("glmjax_moe_clamped", lib.GlmJaxMoeClamped),
                              ("glmjax_attn", lib.GlmJaxAttn)):
                jax.ffi.register_ffi_target(name + "_portable", jax.ffi.pycapsule(sym), platform="cpu")
            _state["portable"] = lib
    return "_portable"


def available() -> bool:
    return load()


def last_error() -> str | None:
    return _state["error"]


def has_vnni() -> bool:
    return bool(load() and _state["lib"].glmjax_has_vnni())


def set_helper_spin_ns(ns: int) -> int:
    """How long a kernel call's helper thread waits on XLA's pool for the next call (qkernels.cc "Sticky helpers");
    0: each call schedules its own helpers.  Returns the previous value.  Results never depend on it (the kernel
    tests check both); the engine keeps the default."""
    load(required=True)
    return int(_state["lib"].glmjax_set_spin_ns(int(ns)))


def fmt_code(fmt: str) -> int:
    """Kernel format code of a quant.py format name."""
    if fmt.startswith("int4"):
        return FMT_CODE["int4"]
    return FMT_CODE[fmt]


def supported(fmt: str, in_dim: int, group: int) -> bool:
    """Can the kernels run this weight format / input width / group size (int4: group a multiple of 64 or the
    whole row; even width)."""
    if fmt in ("f32", "bf16", "int8_row"):
        return True
    if fmt.startswith("int4"):
        return in_dim % 2 == 0 and (group >= in_dim or group % 64 == 0)
    return False


# ----------------------------------------------------------------------------- jax-facing calls
def _scales(scale, rank: int):
    """A weight's scales as the kernels take them: f16 or f32 as stored (f16: the int4_g formats'; an
    astype here would add an f32 copy of every scale to each step), anything else as f32; none: an f32 placeholder."""
    import jax.numpy as jnp

    if scale is None:
        return jnp.zeros((1,) * rank, jnp.float32)
    return scale if scale.dtype in (jnp.float16, jnp.float32) else scale.astype(jnp.float32)


def qlinear(x, q, scale, fmt: str, group: int, out: int, rows=None, variant: str = ""):
    """x [T, in] f32 @ W[out, in]^T -> [T, out] f32; W = (q, scale) in ``fmt``: float row-major, quantized in the
    tiles layout (quant.to_tiles).  ``rows`` (bool [T], optional): only those rows are computed, the others are 0
    (padding rows of a fixed-width forward)."""
    import jax
    import jax.numpy as jnp

    T, n_in = x.shape
    s = _scales(scale, 3)
    r = jnp.zeros((0,), jnp.int32) if rows is None else rows.reshape(T).astype(jnp.int32)
    return jax.ffi.ffi_call("glmjax_qlinear" + variant, jax.ShapeDtypeStruct((T, out), jnp.float32))(
        x.astype(jnp.float32), q, s, r, fmt=np.int32(fmt_code(fmt)),
        group=np.int64(group if group else n_in), out=np.int64(out))


def qlinear_grouped(x, q, scale, fmt: str, group: int, out: int, variant: str = ""):
    """x [G, T, in] f32, W G matrices [out, in] (q [G, ...], scale [G, ...]: ``qlinear``'s layout per group) ->
    y [G, T, out] f32, y[g] = x[g] @ W[g]^T; each group's rows bitwise ``qlinear`` of that group."""
    import jax
    import jax.numpy as jnp

    G, T, n_in = x.shape
    s = _scales(scale, 3)
    return jax.ffi.ffi_call("glmjax_qlinear_grouped" + variant, jax.ShapeDtypeStruct((G, T, out), jnp.float32))(
        x.astype(jnp.float32), q, s, fmt=np.int32(fmt_code(fmt)),
        group=np.int64(group if group else n_in), out=np.int64(out))


def moe(x, slots, weights, gate_up, gate_up_scale, down, down_scale, fmt: str, gu_group: int, dn_group: int,
        inter: int, terms: bool = False, variant: str = "", limit: Optional[float] = None):
    """The MoE seam.  x [T, H] f32; slots [T, K] int32 (bank slot, -1 = invalid); weights [T, K] f32; the bank's
    arrays (float row-major or quantized tiles, quant.py), ``inter`` the experts' intermediate size.  Returns out
    [T, H] f32 = sum_k weights * expert(x) in routing order, or with ``terms`` the unweighted per-(t, k) expert
    outputs [T, K, H] f32 (0 where invalid).  ``limit``: the SwiGLU clamp (gate <= limit, |up| <= limit) through
    the glmjax_moe_clamped target; None calls glmjax_moe, the program every unclamped family compiles."""
    import jax
    import jax.numpy as jnp

    T, H = x.shape
    K = slots.shape[1]
    shape = (T, K, H) if terms else (T, H)
    extra = {} if limit is None else {"limit": np.float32(limit)}
    target = "glmjax_moe" if limit is None else "glmjax_moe_clamped"
    return jax.ffi.ffi_call(target + variant, jax.ShapeDtypeStruct(shape, jnp.float32))(
        x.astype(jnp.float32), slots.astype(jnp.int32), weights.astype(jnp.float32), gate_up,
        _scales(gate_up_scale, 4), down, _scales(down_scale, 4),
        fmt=np.int32(fmt_code(fmt)), gu_group=np.int64(gu_group), dn_group=np.int64(dn_group),
        mode=np.int32(1 if terms else 0), inter=np.int64(inter), **extra)


def attention(q, k, v, pos, rows, scale: float, variant: str = ""):
    """GQA attention of q [B, T, nh, hd] over the cache k, v [B, S, nkv, hd] (f32 or f16, as it lies): row (b, t) attends
    to positions 0..pos[b, t]; ``rows`` [B, T] bool: real rows (the others' output is 0).  Returns [B, T, nh, hd]
    f32; each row's numbers do not depend on B, T or the other rows (qkernels.cc, "attention")."""
    import jax
    import jax.numpy as jnp

    B, T, nh, hd = q.shape
    if k.dtype not in (jnp.float32, jnp.float16):
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    y = jax.ffi.ffi_call("glmjax_attn" + variant, jax.ShapeDtypeStruct((B * T, nh * hd), jnp.float32))(
        q.reshape(B * T, nh, hd).astype(jnp.float32), k, v,
        pos.reshape(B * T).astype(jnp.int32), rows.reshape(B * T).astype(jnp.int32), T=np.int64(T),
        scale=np.float32(scale))
    return y.reshape(B, T, nh, hd)


def sink_call(slot, out, cnt, final: bool = False):
    """Inside a compiled decode loop: hand ``out`` [C, B] int32 (tokens so far) and ``cnt`` [B] int32 to the host
    ``StreamSink`` of ``slot`` (int32 scalar, a traced operand: one program serves every sink) without calling
    Python; returns (stop [B] bool, brk bool), the flags the host last set.  ``final``: the call after the loop."""
    import jax
    import jax.numpy as jnp

    B = cnt.shape[0]
    return jax.ffi.ffi_call("glmjax_sink", (jax.ShapeDtypeStruct((B,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.bool_)),
                            has_side_effect=True)(jnp.asarray(slot, jnp.int32), out.astype(jnp.int32),
                                                  cnt.astype(jnp.int32), final_call=np.int32(1 if final else 0))


class StreamSink:
    """The host end of ``sink_call`` (qkernels.cc "Stream sink"): a thread waits for the running loop's snapshots
    (``wait``, the GIL released) and answers with stop / break flags (``set``) that the loop reads at its next call;
    the loop never waits for the host."""

    def __init__(self):
        load(required=True)
        self.lib = _state["lib"]
        self.slot = int(self.lib.glmjax_sink_open())
        self.seen = 0

    def reset(self, B: int, C: int):
        """Before a dispatch of ``B`` rows with ``C`` token slots."""
        self.lib.glmjax_sink_reset(self.slot, B)
        self.out = np.zeros((C, B), np.int32)
        self.cnt = np.zeros(B, np.int32)
        self.seen = 0

    def wait(self, timeout_s: float):
        """(new, done): whether a newer snapshot arrived within ``timeout_s`` (then in ``.out`` / ``.cnt``), and
        whether it is the loop's final one."""
        done = ctypes.c_int32(0)
        seq = self.lib.glmjax_sink_wait(self.slot, self.seen, int(timeout_s * 1000), self.out.ctypes.data,
                                        self.out.size, self.cnt.ctypes.data, self.cnt.size, ctypes.byref(done))
        if seq <= self.seen:
            return False, False
        self.seen = seq
        return True, bool(done.value)

    def set(self, stop, brk: bool):
        st = np.ascontiguousarray(stop, np.uint8)
        self.lib.glmjax_sink_set(self.slot, st.ctypes.data, st.size, int(bool(brk)))

    def close(self):
        if self.slot:
            self.lib.glmjax_sink_close(self.slot)
            self.slot = 0

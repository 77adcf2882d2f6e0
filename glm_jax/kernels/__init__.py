"""Native CPU kernels (qkernels.cc), registered with XLA through ``jax.ffi``: they run inside the jitted step.

The C++ source ships with the package and is compiled on first use with the machine's C++ compiler (``$CXX`` or
g++/c++, ``-O3 -march=native``) against the FFI headers of the installed jaxlib, into the per-user cache
(``$XDG_CACHE_HOME/glm-jax/kernels``, or ``~/.cache/glm-jax/kernels``; ``set_build_dir`` moves it).  The library name
carries a hash of the source, compiler, flags, jaxlib version and CPU flags, so an upgrade or another CPU builds
anew, and nothing is written into the installed package.  Building is atomic (temp file + rename) and serialised
between processes by a lock file.  Where no compiler is found or the build fails, ``available()`` is False and the
engine runs its XLA path (``--kernels=auto``; ``--kernels=native`` makes that an error).

Formats (glm_jax/quant.py is the numpy reference): f32, bf16 row-major (f32 activations, exact dot products); int8_row
and int4_g<G>/int4_row in the tiles layout (quant.to_tiles; activations quantized to int8 per 64-block, integer dot
products with AVX-512 VNNI where present, the same integer sums in portable C++ elsewhere).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import numpy as np

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
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "glm-jax", "kernels")


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


def _library_path(cxx: str, extra=()) -> str:
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
    return os.path.join(build_dir(), f"qkernels-{h.hexdigest()[:20]}.so")


def _build(cxx: str, out: str, extra=()):
    import fcntl

    import jax

    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(os.path.join(os.path.dirname(out), ".lock"), "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if os.path.exists(out):
            return
        fd, tmp = tempfile.mkstemp(prefix=".qkernels-", suffix=".so.tmp", dir=os.path.dirname(out))
        os.close(fd)
        import sys

        print(f"glm-jax: building the native kernels into {os.path.dirname(out)} (once per machine and jaxlib, "
              "about 10 s)", file=sys.stderr, flush=True)
        try:
            cmd = [cxx, *CXXFLAGS, *extra, "-isystem", jax.ffi.include_dir(), SOURCE, "-o", tmp]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                msg = (r.stderr or r.stdout).strip().splitlines()
                raise KernelError(f"{os.path.basename(cxx)} failed on {SOURCE}: {msg[-1] if msg else r.returncode}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


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
    path = _library_path(cxx)
    if not os.path.exists(path):
        _build(cxx, path)
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target("glmjax_qlinear", jax.ffi.pycapsule(lib.GlmJaxQLinear), platform="cpu")
    jax.ffi.register_ffi_target("glmjax_moe", jax.ffi.pycapsule(lib.GlmJaxMoe), platform="cpu")
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
            extra = ("-DGLMJAX_PORTABLE",)
            path = _library_path(cxx, extra)
            if not os.path.exists(path):
                _build(cxx, path, extra)
            lib = ctypes.cdll.LoadLibrary(path)
            for name, sym in (("glmjax_qlinear", lib.GlmJaxQLinear), ("glmjax_moe", lib.GlmJaxMoe)):
                jax.ffi.register_ffi_target(name + "_portable", jax.ffi.pycapsule(sym), platform="cpu")
            _state["portable"] = lib
    return "_portable"


def available() -> bool:
    return load()


def last_error() -> str | None:
    return _state["error"]


def has_vnni() -> bool:
    return bool(load() and _state["lib"].glmjax_has_vnni())


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
def qlinear(x, q, scale, fmt: str, group: int, out: int, rows=None, variant: str = ""):
    """x [T, in] f32 @ W[out, in]^T -> [T, out] f32; W = (q, scale) in ``fmt``: float row-major, quantized in the
    tiles layout (quant.to_tiles).  ``rows`` (bool [T], optional): only those rows are computed, the others are 0
    (padding rows of a fixed-width forward)."""
    import jax
    import jax.numpy as jnp

    T, n_in = x.shape
    s = scale if scale is not None else jnp.zeros((1, 1, 1), jnp.float32)
    r = jnp.zeros((0,), jnp.int32) if rows is None else rows.reshape(T).astype(jnp.int32)
    return jax.ffi.ffi_call("glmjax_qlinear" + variant, jax.ShapeDtypeStruct((T, out), jnp.float32))(
        x.astype(jnp.float32), q, s.astype(jnp.float32), r, fmt=np.int32(fmt_code(fmt)),
        group=np.int64(group if group else n_in), out=np.int64(out))


def moe(x, slots, weights, gate_up, gate_up_scale, down, down_scale, fmt: str, gu_group: int, dn_group: int,
        inter: int, terms: bool = False, variant: str = ""):
    """The MoE seam.  x [T, H] f32; slots [T, K] int32 (bank slot, -1 = invalid); weights [T, K] f32; the bank's
    arrays (float row-major or quantized tiles, quant.py), ``inter`` the experts' intermediate size.  Returns out
    [T, H] f32 = sum_k weights * expert(x) in routing order, or with ``terms`` the unweighted per-(t, k) expert
    outputs [T, K, H] f32 (0 where invalid)."""
    import jax
    import jax.numpy as jnp

    T, H = x.shape
    K = slots.shape[1]
    z = jnp.zeros((1, 1, 1, 1), jnp.float32)
    shape = (T, K, H) if terms else (T, H)
    return jax.ffi.ffi_call("glmjax_moe" + variant, jax.ShapeDtypeStruct(shape, jnp.float32))(
        x.astype(jnp.float32), slots.astype(jnp.int32), weights.astype(jnp.float32), gate_up,
        z if gate_up_scale is None else gate_up_scale, down, z if down_scale is None else down_scale,
        fmt=np.int32(fmt_code(fmt)), gu_group=np.int64(gu_group), dn_group=np.int64(dn_group),
        mode=np.int32(1 if terms else 0), inter=np.int64(inter))

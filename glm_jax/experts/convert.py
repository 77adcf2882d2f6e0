"""glm-jax-convert: Hugging Face GLM MoE checkpoint -> glm-jax expert container.

    glm-jax-convert --src=HF_DIR --dst=OUT_DIR [--expert_format=int4_g64] [--group_size=64]
                    [--mtp_format=int8_row] [--dense_format=auto|bf16|int8|int4_g64|f32] [--verify] [--overwrite]

Reads the source tensor by tensor (raw safetensors headers + pread; one expert or one dense tensor in memory at
a time), writes one experts/layer_LLL.bin per MoE layer (fixed-size, 4096-aligned records, one per expert, see
glm_jax/experts/container.py), dense.safetensors (HF key names) and manifest.json LAST.  Every file is written to a temp
name then renamed.  Each finished layer leaves a done record with per-record crc32s; a re-run skips a layer only
if its done record matches the requested format/source AND every record's checksum re-verifies (a corrupted or
truncated finished layer is redone).  ``--verify`` re-checks an existing container (all checksums) and exits.

``--dst`` must be empty (or absent) or hold this conversion's own resumable (unfinished) state (same source);
anything else, a finished container included, is refused unless ``--overwrite``, which converts into a sibling work
directory (beside a symlinked --dst's target) and swaps it in only when complete (the old directory stays valid
until then).  One conversion per --dst at a time: a lock file beside it (fileio.exclusive_lock), a second run is
refused at once.  --dst inside --src (or --src inside --dst) is refused.  Free space is checked up front (the output size is known), and a failed
write (ENOSPC, EIO) leaves no partial file behind.  Every problem is one ``glm-jax-convert: error:`` line, exit 2.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from typing import Optional

import numpy as np

from .. import fileio
from ..errors import GlmJaxError
from ..fileio import LockBusy, directory_lock, exclusive_lock
from ..kernels import formats as quant
from ..model.config import load_config
from ..options import one_line
from . import weights as W
from . import glm5_next_weights as G5W
from .glm5_next_weights import TextTensors
from .container import (
    ALIGN,
    CONVERT_MARKER,
    DENSE_NAME,
    DENSE_SCALE_SUFFIX,
    EXPERT_DIR,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ContainerError,
    HFExperts,
    RecordLayout,
    SafeTensorsDir,
    SourceError,
    check_not_partial,
    config_fields,
    config_hash,
    done_file_name,
    expert_layers,
    file_crc,
    is_container,
    is_routed_expert_key,
    layer_file_name,
    make_layout,
    normalize_format,
    open_container,
    verify_dense,
)


class ConvertError(ContainerError):
    """A problem with the conversion's destination or arguments (one line)."""

_NP_TO_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "I8", "uint8": "U8", "int32": "I32",
             "int64": "I64", "bool": "BOOL", "float64": "F64"}
_ITEM = {"F8_E4M3": 1, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "BOOL": 1, "F64": 8}


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str = "convert"):
        self.enabled = enabled
        self.bar = None
        self.n, self.total, self.t0, self.last = 0, total, time.time(), 0.0
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="t", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, k: int = 1, note: str = ""):
        self.n += k
        if self.bar is not None:
            self.bar.update(k)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
        elif self.enabled and (time.time() - self.last > 0.5 or self.n == self.total):
            self.last = time.time()
            sys.stderr.write(f"\rconvert {self.n}/{self.total} {note}   ")
            sys.stderr.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


@contextlib.contextmanager
def _tmp_for(path: str):
    """Yields ``path + '.tmp'``; the caller writes it and renames it over ``path``.  On any failure (ENOSPC, an
    interrupt, ...) the partial temp file is removed, so nothing half-written is ever left to be read as valid."""
    tmp = path + ".tmp"
    try:
        yield tmp
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _atomic_json(path: str, obj):
    with _tmp_for(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _load_json(path: str) -> Optional[dict]:
    try:
        d = fileio.read_json(path)
    except OSError:
        return None
    return d if isinstance(d, dict) else None


def source_fingerprint(st: SafeTensorsDir, src: str) -> str:
    h = hashlib.sha256()
    h.update(fileio.read_bounded(os.path.join(src, "config.json"), fileio.JSON_MAX))
    for k in sorted(st.tensors):
        t = st.tensors[k]
        h.update(f"{k}|{t.dtype}|{t.shape}|{t.nbytes}\n".encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- experts
def _layer_done_ok(dst: str, L: int, want: dict) -> bool:
    """The done record matches ``want`` and every record's crc32 re-verifies from the file (not assumed)."""
    rec = _load_json(os.path.join(dst, done_file_name(L)))
    if not rec or any(rec.get(k) != v for k, v in want.items()):
        return False
    path = os.path.join(dst, layer_file_name(L))
    try:
        lay = RecordLayout.from_json(rec["layout"])
        E = int(rec["num_experts"])
        if not isinstance(rec["crcs"], list) or len(rec["crcs"]) != E:
            return False
    except (KeyError, TypeError, ValueError):
        return False
    if not os.path.exists(path) or os.path.getsize(path) != E * lay.record_len:
        return False
    buf = bytearray(lay.record_len)
    with open(path, "rb", buffering=0) as f:
        for e in range(E):
            f.seek(e * lay.record_len)
            if f.readinto(buf) != lay.record_len:
                return False
            crc = 0
            mv = memoryview(buf)
            for s in lay.sections:
                crc = zlib.crc32(mv[s.offset:s.offset + s.nbytes], crc)
            if crc != rec["crcs"][e]:
                return False
    return True


def _convert_layer(hf: HFExperts, dst: str, L: int, lay: RecordLayout, E: int, want: dict, prog: _Progress):
    path = os.path.join(dst, layer_file_name(L))
    crcs = []
    with _tmp_for(path) as tmp:
        with open(tmp, "wb") as f:
            for e in range(E):
                g, u, d = hf.get(L, e)
                try:
                    buf, crc = lay.encode(g, u, d)
                except quant.FormatError as err:        # (the int4 scales' range): which tensor
                    raise ConvertError(f"{hf.describe(L, e)}: {err}") from None
                f.write(buf)
                crcs.append(crc)
                prog.update(1, f"layer {L}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    _atomic_json(os.path.join(dst, done_file_name(L)), dict(want, layout=lay.to_json(), num_experts=E, crcs=crcs))


# ----------------------------------------------------------------------------- dense
DENSE_FORMATS = ("auto", "bf16", "int8", "int4_g64", "f32")


def auto_dense_format(expert_format: str) -> str:
    """--dense_format=auto (the default): the dense weights at the experts' bits, as llama-quantize stores a GGUF's
    (Q8_0: every matrix Q8_0; Q4_0: every matrix Q4_0 but the output head, kept above 4 bits -- here int8; F32 / BF16:
    float).  Chosen from the quality table in docs/formats.md (KL, top-1, PPL on the shipped model)."""
    kind = quant.parse_format(expert_format)[0]
    if kind.startswith("int4"):
        return "int4_g64"
    if kind == "int8_row":
        return "int8"
    return "f32" if kind == "f32" else "bf16"


def _dense_kind(key: str, shape: tuple, dtype: str, dense_format: str, tied: bool = False) -> str:
    """'f32' | 'bf16' | 'int8' | 'int4' | 'keep' for one dense tensor.  int4_g64: 2-D weights int4 (groups of 64),
    except the output heads (lm_head, the MTP layer's shared head; with tied embeddings the token embedding, which
    is the output head), kept int8 as llama-quantize keeps its output matrix above 4 bits (Q6_K for Q4_0), and rows
    of odd length (int8).  The untied token embedding is int4 like llama.cpp's token_embd under Q4_0."""
    if not (dtype.startswith("float") or dtype == "bfloat16"):
        return "keep"
    last = key.split(".")[-2] if key.count(".") else key
    router = key.endswith("mlp.gate.weight") or key.endswith("e_score_correction_bias")
    # glm5_next's short convolutions: f32 as transformers keeps them (_keep_in_fp32_modules_strict)
    if router or "norm" in last or key.endswith(".bias") or len(shape) < 2 or "conv1d" in last:
        return "f32"
    if dense_format in ("int8", "int4_g64") and len(shape) == 2 and key.endswith(".weight"):
        head = (key == "lm_head.weight" or key.endswith("shared_head.head.weight")
                or (tied and key == "model.embed_tokens.weight"))
        return "int4" if dense_format == "int4_g64" and not head and shape[1] % 2 == 0 else "int8"
    return "bf16" if dense_format in ("bf16", "int8", "int4_g64") else "f32"


def _dense_plan(st: SafeTensorsDir, dense_format: str, tied: bool = False) -> list:
    """[(out_key, st_dtype, shape, producer)] for every non-expert tensor, sorted by key."""
    plan = []
    for k in sorted(st.keys()):
        if is_routed_expert_key(k):
            continue
        if k.endswith("_scale_inv") and k[: -len("_scale_inv")] in st:
            continue        # consumed by the FP8 dequant of its weight
        ti = st.info(k)
        dt = "float32" if ti.dtype.startswith("float8") else ti.dtype
        kind = _dense_kind(k, ti.shape, dt, dense_format, tied)
        if kind == "keep":
            plan.append((k, _NP_TO_ST[ti.dtype], ti.shape, lambda k=k: st.read(k)))
        elif kind == "int8":
            out = ti.shape[0]
            cache = {}

            def q(k=k, cache=cache):
                cache["qs"] = quant.quantize(st.read_float(k), "int8_row")
                return cache["qs"][0]

            def s(cache=cache):
                return cache.pop("qs")[1]
            plan.append((k, "I8", ti.shape, q))
            plan.append((k + DENSE_SCALE_SUFFIX, "F32", (out, 1), s))
        elif kind == "int4":
            out, n_in = ti.shape
            cache = {}

            def q4(k=k, cache=cache):
                cache["qs"] = quant.quantize(st.read_float(k), "int4_g64")
                return cache["qs"][0]

            def s4(cache=cache):
                return cache.pop("qs")[1]
            plan.append((k, "U8", (out, n_in // 2), q4))
            plan.append((k + DENSE_SCALE_SUFFIX, "F16", (out, -(-n_in // 64) if n_in > 64 else 1), s4))
        elif kind == "bf16":
            plan.append((k, "BF16", ti.shape, lambda k=k: st.read_float(k).astype(quant._bf16())))
        else:
            plan.append((k, "F32", ti.shape, lambda k=k: st.read_float(k)))
    return plan


def write_safetensors_streaming(path: str, plan: list, metadata: dict, prog: Optional[_Progress] = None) -> tuple:
    """Write a safetensors file one tensor at a time (header from the plan's shapes/dtypes); returns (size, crc)."""
    hb = _header_bytes(plan, metadata)
    crc = 0
    with _tmp_for(path) as tmp:
        with open(tmp, "wb") as f:
            for chunk in (len(hb).to_bytes(8, "little"), hb):
                f.write(chunk)
                crc = zlib.crc32(chunk, crc)
            for key, dt, shape, produce in plan:
                a = np.ascontiguousarray(produce())
                if tuple(a.shape) != tuple(shape):
                    raise SourceError(f"tensor '{key}': produced shape {a.shape}, expected {tuple(shape)}")
                b = memoryview(a.reshape(-1).view(np.uint8))
                f.write(b)
                crc = zlib.crc32(b, crc)
                if prog:
                    prog.update(1, "dense")
            f.flush()
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        os.replace(tmp, path)
    return size, crc


def _header_bytes(plan: list, metadata: dict) -> bytes:
    header, off = {}, 0
    for key, dt, shape, _ in plan:
        n = int(np.prod(shape, dtype=np.int64)) * _ITEM[dt]
        header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    return hb + b" " * ((8 - len(hb) % 8) % 8)


def safetensors_size(plan: list, metadata: dict) -> int:
    """The byte size ``write_safetensors_streaming`` will write for this plan."""
    return 8 + len(_header_bytes(plan, metadata)) + sum(int(np.prod(sh, dtype=np.int64)) * _ITEM[dt]
                                                        for _, dt, sh, _ in plan)


def check_dense_shapes(st: SafeTensorsDir, cfg) -> None:
    """Every dense tensor the engine loads is in the source with the shape config.json implies (a transposed
    k_proj, an embedding larger than vocab_size: converted and --verify'd OK before, then refused by the engine)."""
    shapes = G5W.dense_shapes if cfg.model_type == "glm5_next" else W.dense_shapes     # each family's key map
    for k, shape in shapes(cfg, st.__contains__).items():
        if k not in st:
            raise ConvertError(f"{st.path}: missing tensor '{k}' (config.json implies shape {list(shape)})")
        got = _stored_shape(st, k)
        if tuple(got) != tuple(shape):
            raise ConvertError(f"{st.info(k).file}: tensor '{k}' has shape {list(got)}, but config.json implies "
                               f"{list(shape)}")


def _stored_shape(st: SafeTensorsDir, k: str) -> tuple:
    """The unquantized shape of ``k``: a container's int4 dense weight (uint8 beside a ``_scale``) packs two
    values a byte, so its rows hold twice the stored columns."""
    ti = st.info(k)
    if ti.dtype == "uint8" and k + DENSE_SCALE_SUFFIX in st and len(ti.shape) == 2:
        return (ti.shape[0], 2 * ti.shape[1])
    return tuple(ti.shape)


# ----------------------------------------------------------------------------- files to copy
_SKIP_COPY = {"model.safetensors.index.json", MANIFEST_NAME}


def _side_file(src: str, name: str) -> bool:
    return not (not os.path.isfile(os.path.join(src, name)) or name.endswith(".safetensors") or name in _SKIP_COPY
                or name.startswith(".") or name.endswith(".tmp"))


def _copy_side_files(src: str, dst: str):
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if not _side_file(src, name):
            continue
        out = os.path.join(dst, name)
        with _tmp_for(out) as tmp:
            shutil.copyfile(p, tmp)
            os.replace(tmp, out)


# ----------------------------------------------------------------------------- destination
def _dst_is_ours(dst: str, fp: str) -> bool:
    """``dst`` holds this conversion's state: its start marker, manifest or a done record name the same source."""
    for p in (os.path.join(dst, CONVERT_MARKER), os.path.join(dst, MANIFEST_NAME),
              os.path.join(dst, MANIFEST_NAME + ".old"), os.path.join(dst, DENSE_NAME + ".done.json")):
        d = _load_json(p)
        if d and fp in (d.get("source"), d.get("source_fingerprint")):
            return True
    ed = os.path.join(dst, EXPERT_DIR)
    if os.path.isdir(ed):
        for n in os.listdir(ed):
            if n.endswith(".done.json") and (_load_json(os.path.join(ed, n)) or {}).get("source") == fp:
                return True
    return False


def _work_dir(dst: str) -> str:
    """Where ``--overwrite`` builds the new container before swapping it in (same file system as ``dst``)."""
    d = os.path.abspath(dst).rstrip("/")
    return os.path.join(os.path.dirname(d), f".{os.path.basename(d)}.glm-jax-convert.partial")


def _exchange(a: str, b: str):
    """Swap two directories: ``renameat2(RENAME_EXCHANGE)`` (atomic) where the kernel has it, else two renames."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.renameat2
        f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        if f(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:      # AT_FDCWD, RENAME_EXCHANGE
            return
    except (AttributeError, OSError):
        pass
    aside = b + ".glm-jax-convert.old"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def _check_space(dst: str, need: int):
    free = shutil.disk_usage(dst).free
    if need > free:
        raise ConvertError(f"--dst={dst}: not enough free space: the conversion writes {need / 1e9:.3f} GB, the file "
                           f"system has {free / 1e9:.3f} GB free")


def _writable_dir(dst: str, flag: str = "--dst"):
    """Create ``dst`` if needed and prove it writable (a probe file), as one ConvertError line if not."""
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ConvertError(f"{flag}={dst}: is a file, not a directory")
    try:
        os.makedirs(dst, exist_ok=True)
        probe = os.path.join(dst, f".glm-jax-convert.probe.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConvertError(f"{flag}={dst}: not writable ({e.strerror or e})") from None


def check_formats(expert_format: str, group_size: Optional[int], mtp_format: str, dense_format: str) -> tuple:
    """(expert fmt, mtp fmt, group): normalised formats, or one ConvertError line naming the flag.  A group size in
    the format name (int4_g64) and a different explicit ``group_size`` conflict."""
    if dense_format not in DENSE_FORMATS:
        raise ConvertError(f"--dense_format={dense_format}: expected one of {', '.join(DENSE_FORMATS)}")
    if dense_format == "auto":
        try:
            dense_format = auto_dense_format(expert_format)
        except ValueError:
            dense_format = "bf16"        # the expert format's own error comes below, naming its flag
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or group_size < 2 or group_size % 2):
        raise ConvertError(f"--group_size={group_size}: expected an even integer >= 2")
    out = []
    for flag, fmt in (("--expert_format", expert_format), ("--mtp_format", mtp_format)):
        try:
            kind, g = quant.parse_format(fmt, group_size or 64)
        except ValueError as e:
            raise ConvertError(f"{flag}={fmt}: {e}") from None
        if kind == "int4_g" and fmt != "int4_g" and group_size is not None and g != group_size:
            raise ConvertError(f"{flag}={fmt} and --group_size={group_size} disagree (the format names its group: "
                               f"use --expert_format=int4_g{group_size}, or drop --group_size)")
        out.append(normalize_format(fmt, g or 64))
    gs = quant.parse_format(out[0])[1] or None
    return out[0], out[1], gs, dense_format


# ----------------------------------------------------------------------------- driver
def convert(src: str, dst: str, expert_format: str = "int4_g64", group_size: Optional[int] = None,
            mtp_format: str = "int8_row", dense_format: str = "bf16", progress: bool = True,
            fail_after_layers: Optional[int] = None, overwrite: bool = False) -> dict:
    """Convert ``src`` (HF dir) into ``dst``; returns the manifest.  ``fail_after_layers`` (tests): raise
    RuntimeError after that many layers were converted in this run (a simulated interrupt).

    ``dst`` must be absent, empty or this conversion's own (resumable) state; otherwise ``overwrite`` builds the
    container in a sibling work directory and swaps it in once complete (module docstring)."""
    fmt, mfmt, gsize, dense_format = check_formats(expert_format, group_size, mtp_format, dense_format)
    if not os.path.isdir(src):
        raise ConvertError(f"--src={src}: not a directory (expected a Hugging Face checkpoint directory)")
    if os.path.exists(os.path.join(src, MANIFEST_NAME)) or os.path.exists(os.path.join(src, CONVERT_MARKER)):
        raise ConvertError(f"--src={src}: is a glm-jax container (converter output), not a Hugging Face checkpoint; "
                           f"it runs as it is (glm-jax --model={src}), and glm-jax-convert --verify --dst={src} "
                           f"checks it")
    cfg = load_config(src)
    st = SafeTensorsDir(src)
    if cfg.model_type == "glm5_next":       # its text part under the flat names; the vision tower is not converted
        st = TextTensors(st, cfg)
    try:
        check_dense_shapes(st, cfg)
        fp = source_fingerprint(st, src)
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise ConvertError(f"--dst={dst}: is a file, not a directory")
        real, rsrc = os.path.realpath(dst), os.path.realpath(src)
        if real == rsrc:
            raise ConvertError(f"--dst={dst}: is the source directory (the converter never writes into --src)")
        if os.path.commonpath([real, rsrc]) == rsrc:
            raise ConvertError(f"--dst={dst}: is inside --src={src} (the converter never writes into --src)")
        if os.path.commonpath([real, rsrc]) == real:
            raise ConvertError(f"--src={src}: is inside --dst={dst} (converting would replace the source)")
        with _dst_lock(dst, real):
            return _convert_locked(st, cfg, src, dst, real, fp, fmt, mfmt, gsize, dense_format, progress,
                                   fail_after_layers, overwrite)
    finally:
        st.close()


def _finished(d: str) -> bool:
    """``d`` holds a finished container: its manifest, and no start marker of a conversion under way."""
    return os.path.exists(os.path.join(d, MANIFEST_NAME)) and not os.path.exists(os.path.join(d, CONVERT_MARKER))


def _lock_path(real: str) -> str:
    return os.path.join(os.path.dirname(real), f".{os.path.basename(real)}.glm-jax-convert.lock")


@contextlib.contextmanager
def _dst_lock(dst: str, real: str):
    """One conversion per destination at a time: a lock file beside the (resolved) ``--dst`` (removed at the end),
    or, where its parent is not writable, a lock on ``--dst`` itself.  A second conversion is refused at once."""
    busy = (f"--dst={dst}: another glm-jax-convert is writing it right now; wait for it to finish (or stop it), "
            f"then re-run")
    with contextlib.ExitStack() as stack:
        try:
            os.makedirs(os.path.dirname(real) or ".", exist_ok=True)     # mkdir -p, as for --dst itself
            stack.enter_context(exclusive_lock(_lock_path(real), blocking=False, remove=True))
        except LockBusy:
            raise ConvertError(busy) from None
        except OSError as e:
            if not os.path.isdir(real):
                raise ConvertError(f"--dst={dst}: cannot create it ({e.filename or os.path.dirname(real)}: "
                                   f"{e.strerror or e})") from None
            try:
                stack.enter_context(directory_lock(real, blocking=False))
            except LockBusy:
                raise ConvertError(busy) from None
        yield


def _convert_locked(st, cfg, src, dst, real, fp, fmt, mfmt, gsize, dense_format, progress, fail_after_layers,
                    overwrite) -> dict:
    """``convert`` under the destination's lock; ``real`` is ``dst`` resolved (a symlinked --dst: its target is
    converted into, or swapped with the new container; the link stays a link)."""
    fresh = not os.path.isdir(real) or not os.listdir(real)
    finished = not fresh and _finished(real)
    if fresh or (not finished and _dst_is_ours(real, fp)):
        return _convert_into(st, cfg, src, real, fp, fmt, mfmt, gsize, dense_format, progress, fail_after_layers)
    if not overwrite:
        if finished:
            same = ("a finished conversion of --src" if _dst_is_ours(real, fp)
                    else f"a finished container, not a conversion of --src={src}")
            raise ConvertError(f"--dst={dst}: holds {same} (manifest.json), which is never replaced without "
                               f"--overwrite (the old container stays valid until the new one is complete); "
                               f"glm-jax-convert --verify --dst={dst} checks it")
        names = sorted(os.listdir(real))
        raise ConvertError(f"--dst={dst}: not empty and not a conversion of --src={src} (holds "
                           f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}); use an empty directory, "
                           f"or --overwrite to replace it (the old content stays until the new one is complete)")
    work = _work_dir(real)
    if os.path.isdir(work) and os.listdir(work) and not _dst_is_ours(work, fp):
        shutil.rmtree(work)            # a stale work dir of another source: ours to remove
    man = _convert_into(st, cfg, src, work, fp, fmt, mfmt, gsize, dense_format, progress, fail_after_layers)
    _exchange(work, real)
    shutil.rmtree(work, ignore_errors=True)     # now the old content
    return man


def _convert_into(st, cfg, src, dst, fp, fmt, mfmt, gsize, dense_format, progress, fail_after_layers) -> dict:
    hf = HFExperts(st, cfg)
    drop_mtp = cfg.has_mtp and not hf.has_layer(cfg.mtp_layer_index)
    if drop_mtp:        # transformers' save_pretrained of a config declaring an MTP layer writes none of it
        L = cfg.mtp_layer_index
        have = sum(1 for k in st.keys() if k.startswith(f"model.layers.{L}."))
        print(f"glm-jax-convert: note: config.json declares num_nextn_predict_layers="
              f"{cfg.num_nextn_predict_layers} but --src has no MTP experts (model.layers.{L}.mlp.experts.*"
              + (f"; its {have} other MTP tensors are left out" if have else "") + "): converting without the MTP "
              "layer (the container's config.json says 0; no MTP drafts)", file=sys.stderr)
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
        hf = HFExperts(st, cfg)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    layers = [L for L in expert_layers(cfg) if L < cfg.num_hidden_layers or hf.has_layer(L)]
    for L in layers:
        if not hf.has_layer(L):
            raise SourceError(f"{src}: layer {L}: no routed expert tensors (expected "
                              f"'model.layers.{L}.mlp.experts.0.gate_proj.weight' or '...experts.gate_up_proj')")
    lay_of, notes = {}, []
    for L in layers:
        want_fmt = mfmt if L == cfg.mtp_layer_index else fmt
        got, note = quant.fit_format(want_fmt, H, I)
        if note and note not in notes:
            notes.append(note)
        lay_of[L] = make_layout(got, H, I)
    for n in notes:
        print(f"glm-jax-convert: note: {n}", file=sys.stderr)
    _writable_dir(dst)
    try:
        return _convert_steps(st, hf, cfg, src, dst, fp, fmt, mfmt, gsize, dense_format, progress,
                              fail_after_layers, layers, lay_of, drop_mtp)
    except OSError as e:           # ENOSPC, EIO, ...: the temp file of the step was removed (_tmp_for)
        where = e.filename or dst
        raise ConvertError(f"{where}: write failed ({e.strerror or e}); nothing partial was kept - free space or "
                           f"fix --dst and re-run (finished layers are kept)") from None


def _convert_steps(st, hf, cfg, src, dst, fp, fmt, mfmt, gsize, dense_format, progress, fail_after_layers, layers,
                   lay_of, drop_mtp=False) -> dict:
    E = cfg.n_routed_experts
    _atomic_json(os.path.join(dst, CONVERT_MARKER), {"created_by": "glm-jax-convert", "source": fp,
                                                     "src": os.path.abspath(src)})
    os.makedirs(os.path.join(dst, EXPERT_DIR), exist_ok=True)
    mpath = os.path.join(dst, MANIFEST_NAME)
    if os.path.exists(mpath):
        os.replace(mpath, mpath + ".old")   # the manifest is written last; an incomplete run has none
    plan = _dense_plan(st, dense_format, bool(cfg.tie_word_embeddings))
    if drop_mtp:
        mtp_pre = f"model.layers.{cfg.num_hidden_layers}."
        plan = [row for row in plan if not row[0].startswith(mtp_pre)]
    todo = []
    want_of = {L: {"layer": L, "fmt": lay_of[L].fmt, "source": fp, "format_version": FORMAT_VERSION,
                   "layout": lay_of[L].to_json()} for L in layers}
    skipped = []
    for L in layers:
        if _layer_done_ok(dst, L, want_of[L]):
            skipped.append(L)
        else:
            todo.append(L)
    dense_path = os.path.join(dst, DENSE_NAME)
    dense_want = {"format": dense_format, "source": fp, "format_version": FORMAT_VERSION}
    drec = _load_json(dense_path + ".done.json")
    dense_ok = bool(drec and all(drec.get(k) == v for k, v in dense_want.items()) and os.path.exists(dense_path)
                    and os.path.getsize(dense_path) == drec.get("size") and file_crc(dense_path) == drec.get("crc"))
    meta = {"glm_jax.dense_format": dense_format, "glm_jax.scale_suffix": DENSE_SCALE_SUFFIX, "format": "pt"}
    need = sum(E * lay_of[L].record_len for L in todo) + (0 if dense_ok else safetensors_size(plan, meta))
    need += sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src) if _side_file(src, n)) + (1 << 20)
    _check_space(dst, need)
    prog = _Progress(len(todo) * E + (0 if dense_ok else len(plan)), progress)
    try:
        for n, L in enumerate(todo):
            if fail_after_layers is not None and n >= fail_after_layers:
                raise RuntimeError(f"simulated interrupt after {n} layers")
            _convert_layer(hf, dst, L, lay_of[L], E, want_of[L], prog)
        if not dense_ok:
            size, crc = write_safetensors_streaming(dense_path, plan, meta, prog)
            _atomic_json(dense_path + ".done.json", dict(dense_want, size=size, crc=crc))
            drec = _load_json(dense_path + ".done.json")
    finally:
        prog.close()
    _copy_side_files(src, dst)
    if drop_mtp:
        c = _load_json(os.path.join(src, "config.json"))
        c["num_nextn_predict_layers"] = 0
        _atomic_json(os.path.join(dst, "config.json"), c)
    experts, linfo = [], {}
    for L in layers:
        rec = _load_json(os.path.join(dst, done_file_name(L)))
        lay = RecordLayout.from_json(rec["layout"])
        linfo[str(L)] = {"file": layer_file_name(L), "format": lay.fmt, "layout": lay.to_json(),
                         "num_experts": rec["num_experts"], "size": rec["num_experts"] * lay.record_len}
        experts += expert_records(L, lay, rec["crcs"])
    src_cfg_sha = hashlib.sha256(fileio.read_bounded(os.path.join(src, "config.json"), fileio.JSON_MAX)).hexdigest()
    man = {
        "format_version": FORMAT_VERSION,
        "created_by": "glm-jax-convert",
        "alignment": ALIGN,
        "source_config_sha256": src_cfg_sha,
        "source_fingerprint": fp,
        "config_hash": config_hash(cfg),
        "config_fields": config_fields(cfg),
        "expert_format": fmt, "mtp_format": mfmt, "group_size": gsize,
        "layer_formats": sorted({lay_of[L].fmt for L in layers}),
        "shapes": {"hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_intermediate_size,
                   "n_routed_experts": E},
        "dense": {"file": DENSE_NAME, "format": dense_format, "size": drec["size"],
                  "checksum": f"crc32:{drec['crc']:08x}", "scale_suffix": DENSE_SCALE_SUFFIX},
        "layers": linfo,
        "experts": experts,
        "resumed_layers": skipped,
    }
    _atomic_json(mpath, man)
    for p in (mpath + ".old", os.path.join(dst, CONVERT_MARKER)):
        if os.path.exists(p):
            os.remove(p)
    return man


def expert_records(L: int, lay: RecordLayout, crcs: list) -> list:
    """The manifest's ``experts`` entries of layer ``L``: record ``e`` at ``e * record_len`` (4096-aligned)."""
    f = layer_file_name(L)
    return [{"layer": L, "expert": e, "file": f, "offset": e * lay.record_len, "length": lay.record_len,
             "format": lay.fmt, "checksum": f"crc32:{c:08x}"} for e, c in enumerate(crcs)]


def verify(dst: str) -> str:
    """``--verify`` without --src: every record and the dense file against the manifest; one-line errors."""
    if not os.path.isdir(dst):
        raise ConvertError(f"--dst={dst}: not a directory")
    check_not_partial(dst)
    if not is_container(dst):
        raise ConvertError(f"--dst={dst}: not a glm-jax container (no manifest.json)")
    cfg = load_config(dst)
    c = open_container(dst, cfg, verify="all")
    try:
        verify_dense(dst, c.manifest)
    finally:
        c.close()
    check_dense_shapes(SafeTensorsDir(dst), cfg)
    return f"{dst}: OK (all record and dense checksums and dense shapes verified)"


_one_line = one_line


def main(argv, F=None) -> int:
    """The command on parsed flags ``F`` (a FlagValues); returns the exit status."""
    F = F or _FLAGS
    try:
        if len(argv) > 1:
            raise ConvertError(f"unexpected arguments: {' '.join(argv[1:])} (flags are --name=value)")
        if F.verify and not F.src:
            if not F.dst:
                raise ConvertError("--verify needs --dst (the container to check)")
            print(verify(F.dst))
            return 0
        if not F.src or not F.dst:
            raise ConvertError("--src and --dst are required")
        t0 = time.time()
        man = convert(F.src, F.dst, F.expert_format, F.group_size if F["group_size"].present else None,
                      F.mtp_format, F.dense_format, progress=F.progress, overwrite=F.overwrite)
        if F.verify:
            verify(F.dst)
    except GlmJaxError as e:
        print(f"glm-jax-convert: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("glm-jax-convert: interrupted; re-run the same command to resume (finished layers are kept)",
              file=sys.stderr)
        return 130
    n = len(man["experts"])
    size = sum(v["size"] for v in man["layers"].values())
    print(f"{F.dst}: {len(man['layers'])} expert layers, {n} records ({size / 1e9:.3f} GB), dense "
          f"{man['dense']['size'] / 1e9:.3f} GB ({man['dense']['format']}); resumed {len(man['resumed_layers'])} "
          f"layers; {time.time() - t0:.1f} s")
    return 0


def define_flags(fv):
    from absl import flags
    flags.DEFINE_string("src", None, "Hugging Face checkpoint directory (single or sharded safetensors)", flag_values=fv)
    flags.DEFINE_string("dst", None, "output container directory: absent, empty, or this conversion's own "
                        "unfinished state (resumed)", flag_values=fv)
    flags.DEFINE_string("expert_format", "int4_g64", "routed experts: int4_g<N> (N even; a row N doesn't divide "
                        "gets a shorter last group) | int4_row | int8_row | bf16", flag_values=fv)
    flags.DEFINE_integer("group_size", 64, "int4 group size for --expert_format=int4_g (must agree with a group "
                         "named in the format)", flag_values=fv)
    flags.DEFINE_string("mtp_format", "int8_row", "MTP layer experts (int4 MTP heads lose acceptance)", flag_values=fv)
    flags.DEFINE_string("dense_format", "auto", "dense weights: auto (the experts' bits, as llama-quantize does: "
                        "int4_g64 with int4 experts, int8 with int8_row, else bf16 / f32; docs/formats.md) | bf16 | "
                        "int8 (per-output-channel) | int4_g64 (groups of 64; output heads int8) | f32",
                        flag_values=fv)
    flags.DEFINE_bool("verify", False, "verify every checksum after converting (or, without --src, of --dst)",
                      flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace a non-empty --dst that is not this conversion's (the old "
                      "content stays valid until the new container is complete)", flag_values=fv)
    flags.DEFINE_bool("progress", True, "progress bar on stderr", flag_values=fv)


_FLAGS = None


def cli_main(argv: list) -> int:
    """Parse ``argv`` into a private FlagValues and run (the console script, and tests in-process)."""
    from absl import flags
    global _FLAGS
    fv = flags.FlagValues()
    define_flags(fv)
    if any(a in ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull") for a in argv[1:]):
        print(__doc__.strip().split("\n\n")[0] + "\n\nflags:\n" + fv.get_help())
        return 0
    try:
        rest = fv(argv)
    except flags.Error as e:
        print(f"glm-jax-convert: error: {_one_line(e)}", file=sys.stderr)
        return 2
    _FLAGS = fv
    return main(rest, fv)


def run():
    sys.exit(cli_main(sys.argv))


if __name__ == "__main__":
    run()

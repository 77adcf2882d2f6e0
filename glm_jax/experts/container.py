"""The glm-jax expert container: on-disk format, manifest, validation, and expert sources.

Layout of a converted model directory (written by ``glm-jax-convert``)::

    OUT_DIR/
      manifest.json                 versioned; written LAST (its presence means "complete")
      config.json, generation_config.json, tokenizer files   (copied)
      dense.safetensors             every non-routed-expert tensor, HF key names kept
      experts/layer_{L:03d}.bin     routed experts of HF layer L (the MTP layer is L = num_hidden_layers)
      experts/layer_{L:03d}.done.json   per-layer done record (format, layout, per-record crc32) used to resume

A layer file is ``E`` fixed-size records; record ``e`` starts at ``e * record_len`` (a multiple of 4096), so ONE
read fetches an expert.  Inside a record the sections follow each other, each starting on a 4096-byte boundary
(so O_DIRECT can scatter a record straight into page-aligned slot arrays)::

    gate_up        [2I, H] in the storage format (rows [:I] gate, [I:] up; int4: [2I, H/2] packed uint8)
    gate_up_scale  f16 [2I, ceil(H/g)] (int4_g; f32 in older containers, read as they are) |
                   f32 [2I, 1] (int4_row, int8_row) | absent (bf16, f32)
    down           [H, I] likewise
    down_scale     likewise

The checksum of a record is ``zlib.crc32`` chained over the section payloads in that order (padding excluded).

Validation (``open_container``): the manifest version, the config (the shape-relevant fields of ``ModelConfig``),
every file's existence and size (truncation) are checked at open; record checksums are checked when a record is
first read (``verify="first"``, the default: each record is hashed once per process, after its read and before
its bytes are used), on every read (``"always"``), for every record at open (``"all"``, what ``--verify`` means:
it reads the whole container) or never (``"none"``).  Every failure is a one-line ``ContainerError`` naming the
file, layer and expert.

Expert sources (what ``ExpertStore`` reads from) share one duck type::

    src.expert_layers -> tuple of layer indices      src.num_experts(layer) -> int
    src.layout(layer) -> RecordLayout                src.read_expert(layer, e, dests) -> bytes read
    src.read_jobs(layer, e, dests, chunk) -> (jobs, finish)   (the same read split into parallel byte ranges)
    src.files() -> list of paths                     src.close()
    src.read_buffer_bytes(io_threads) -> bytes the reads take beyond the slots (staging buffers)

``Container`` is the converted form; ``HFExpertSource`` (``open_expert_source`` on a plain HF directory) reads
the experts straight from the safetensors files (f32 or bf16 records).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import mmap
import os
import threading
import zlib
from typing import Optional

import numpy as np

from .. import fileio
from ..errors import GlmJaxError
from ..kernels import formats as quant
from ..model.config import ModelConfig
from .tensors import INDEX_NAME, check_finite, dequant_fp8, read_index

FORMAT_VERSION = 2         # 2: quantized experts in the native kernels' tiles layout (quant.to_tiles)
MANIFEST_NAME = "manifest.json"
DENSE_NAME = "dense.safetensors"
EXPERT_DIR = "experts"
CONVERT_MARKER = ".glm-jax-convert.json"   # written first by glm-jax-convert: this directory is its (resumable) work
ALIGN = 4096
DENSE_SCALE_SUFFIX = "_scale"     # int8 dense: key holds int8 [out, in], key + "_scale" holds f32 [out, 1]


class ContainerError(GlmJaxError):
    """A container or source checkpoint problem (one line, names file / layer / expert)."""


class UnknownVersionError(ContainerError):
    pass


class ConfigMismatchError(ContainerError):
    pass


class TruncatedError(ContainerError):
    pass


class ChecksumError(ContainerError):
    pass


class SourceError(ContainerError):
    """A problem with a Hugging Face source directory (missing key, bad shape, unsupported dtype)."""


def layer_file_name(layer: int) -> str:
    return f"{EXPERT_DIR}/layer_{layer:03d}.bin"


def done_file_name(layer: int) -> str:
    return f"{EXPERT_DIR}/layer_{layer:03d}.done.json"


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# ----------------------------------------------------------------------------- record layout
@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    offset: int            # byte offset inside the record (multiple of ALIGN)
    nbytes: int
    dtype: str             # numpy dtype name ("uint8", "int8", "float32", "float16", "bfloat16")
    shape: tuple           # per-expert shape

    @property
    def np_dtype(self):
        return np.dtype(quant._bf16()) if self.dtype == "bfloat16" else np.dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    fmt: str               # normalised, e.g. "int4_g64", "int4_row", "int8_row", "bf16", "f32"
    hidden: int
    inter: int
    sections: tuple
    record_len: int

    def section(self, name: str) -> Optional[Section]:
        for s in self.sections:
            if s.name == name:
                return s
        return None

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.sections)

    @property
    def direct_into_slots(self) -> bool:
        """Every section a multiple of ALIGN bytes: an O_DIRECT read scatters straight into a (page-aligned) slot
        arena's rows; otherwise ``record_reads`` stages the record in a per-thread buffer and copies it."""
        return all(s.nbytes % ALIGN == 0 for s in self.sections)

    def to_json(self) -> dict:
        return {"fmt": self.fmt, "hidden": self.hidden, "inter": self.inter, "record_len": self.record_len,
                "sections": [[s.name, s.offset, s.nbytes, s.dtype, list(s.shape)] for s in self.sections]}

    @staticmethod
    def from_json(d: dict) -> "RecordLayout":
        return RecordLayout(d["fmt"], d["hidden"], d["inter"],
                            tuple(Section(n, o, b, t, tuple(sh)) for n, o, b, t, sh in d["sections"]), d["record_len"])

    # -- encode / decode (numpy reference, used by the converter and the tests)
    def encode(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> tuple[bytearray, int]:
        """Quantize one expert (float ``gate``/``up`` [I, H], ``down`` [H, I]) into a record; returns (bytes, crc)."""
        gu = np.concatenate([np.asarray(gate, np.float32), np.asarray(up, np.float32)], axis=0)
        gq, gs = quant.quantize(gu, self.fmt)
        dq, ds = quant.quantize(np.asarray(down, np.float32), self.fmt)
        if self.fmt not in quant.FLOAT_FORMATS:          # records hold the native kernels' tiles layout
            gq, gs, dq, ds = quant.bank_tiles(gq, gs, dq, ds, self.fmt, self.hidden, self.inter)
        vals = {"gate_up": gq, "gate_up_scale": gs, "down": dq, "down_scale": ds}
        buf = bytearray(self.record_len)
        crc = 0
        for s in self.sections:
            a = np.ascontiguousarray(vals[s.name]).astype(s.np_dtype, copy=False)
            if a.shape != s.shape:
                raise ValueError(f"section {s.name}: shape {a.shape} != layout {s.shape}")
            b = a.tobytes()
            buf[s.offset:s.offset + s.nbytes] = b
            crc = zlib.crc32(b, crc)
        return buf, crc

    def decode(self, buf) -> dict:
        """Views of the sections of one record buffer: name -> array (per-expert shape)."""
        mv = np.frombuffer(buf, dtype=np.uint8)
        out = {}
        for s in self.sections:
            out[s.name] = mv[s.offset:s.offset + s.nbytes].view(s.np_dtype).reshape(s.shape)
        return out

    def rows(self, d: dict) -> dict:
        """Decoded sections (tiles layout for quantized formats) -> row-major, as ``quant.quantize`` writes them."""
        if self.fmt in quant.FLOAT_FORMATS:
            return dict(d)
        H, I = self.hidden, self.inter
        gq, gs = quant.from_tiles(d["gate_up"], d["gate_up_scale"], self.fmt, 2 * I, H)
        dq, ds = quant.from_tiles(d["down"], d["down_scale"], self.fmt, H, I)
        return {"gate_up": gq, "gate_up_scale": gs, "down": dq, "down_scale": ds}

    def dequantize(self, buf) -> tuple[np.ndarray, np.ndarray]:
        """Float32 (gate_up [2I, H], down [H, I]) of one record (numpy reference)."""
        d = self.rows(self.decode(buf))
        return (quant.dequantize(d["gate_up"], d.get("gate_up_scale"), self.fmt),
                quant.dequantize(d["down"], d.get("down_scale"), self.fmt))


def normalize_format(fmt: str, group_size: int = 64) -> str:
    kind, g = quant.parse_format(fmt, group_size)
    return f"int4_g{g}" if kind == "int4_g" else kind


def make_layout(fmt: str, hidden: int, inter: int, group_size: int = 64,
                scale_dtype: Optional[str] = None) -> RecordLayout:
    """The record layout glm-jax-convert writes for ``fmt``; ``scale_dtype`` "float32" for int4_g: the layout of a
    container written with f32 scales (older glm-jax-convert), still read."""
    fmt = normalize_format(fmt, group_size)
    kind, g = quant.parse_format(fmt)
    H, I = hidden, inter

    def q_shape(out, n_in):
        if kind == "f32":
            return (out, n_in), "float32", None
        if kind == "bf16":
            return (out, n_in), "bfloat16", None
        R = -(-out // quant.TILE) * quant.TILE          # quantized: the tiles layout (quant.to_tiles)
        if kind == "int8_row":
            return (R, -(-n_in // 4) * 4), "int8", (R // quant.TILE, 1, quant.TILE)
        if n_in % 2:
            raise quant.FormatError(f"{fmt}: int4 needs an even input dimension, got {n_in} "
                                    f"(quant.fit_format picks int8_row)")
        gg = quant.int4_group(kind, g, n_in)
        # a shorter last group when gg doesn't divide
        return (R, -(-n_in // 8) * 4), "uint8", (R // quant.TILE, -(-n_in // gg), quant.TILE)

    secs = []
    off = 0
    for name, out, n_in in (("gate_up", 2 * I, H), ("down", H, I)):
        shape, dt, sshape = q_shape(out, n_in)
        nb = int(np.prod(shape)) * (4 if dt == "float32" else 2 if dt == "bfloat16" else 1)
        secs.append(Section(name, off, nb, dt, shape))
        off = _round_up(off + nb)
        if sshape is not None:          # int4_g: f16 scales (quant.quantize); one a row: f32
            sdt = (scale_dtype or "float16") if kind == "int4_g" else "float32"
            nb = int(np.prod(sshape)) * np.dtype(sdt).itemsize
            secs.append(Section(name + "_scale", off, nb, sdt, sshape))
            off = _round_up(off + nb)
    return RecordLayout(fmt, H, I, tuple(secs), off)


# ----------------------------------------------------------------------------- config identity
# Every ModelConfig field that changes the math (a container's numbers are only right for this config); not: the
# context limit (max_position_embeddings), special token ids and the config's file name.
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts",
                 "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
                 "routed_scaling_factor", "rms_norm_eps", "rope_theta", "partial_rotary_factor", "rope_type",
                 "rope_parameters", "attention_bias", "use_qk_norm", "tie_word_embeddings",
                 "num_nextn_predict_layers", "mlp_layer_types", "hidden_act", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_head_dim",
                 "index_n_heads", "indexer_types")
CONFIG_FIELDS_IGNORED = ("max_position_embeddings", "eos_token_ids", "bos_token_id", "pad_token_id", "source")
# Fields added after containers were written: recorded only where they differ from this default (a container of
# an older glm-jax-convert, where they are absent, had the default)
CONFIG_FIELDS_DEFAULTED = {"rope_interleave": True,
                           # glm5_next's own fields: absent from every other family's manifest, as before
                           "layer_types": (), "linear_num_heads": None, "linear_head_dim": None,
                           "linear_conv_kernel_dim": None, "linear_lower_bound": None, "hc_mult": 0, "hc_eps": 1e-6,
                           "hc_sinkhorn_iters": 0, "swiglu_limit": None, "index_kpool": 0,
                           "index_kpool_always_select_tail": True}


def config_fields(cfg: ModelConfig) -> dict:
    """The math-relevant config fields as JSON values (what the manifest records and ``open_container`` compares)."""
    fields = CONFIG_FIELDS + tuple(f for f, d in CONFIG_FIELDS_DEFAULTED.items() if getattr(cfg, f) != d)
    return json.loads(json.dumps({f: (list(getattr(cfg, f)) if isinstance(getattr(cfg, f), tuple)
                                      else getattr(cfg, f)) for f in fields}))


def config_hash(cfg: ModelConfig) -> str:
    return hashlib.sha256(json.dumps(config_fields(cfg), sort_keys=True).encode()).hexdigest()[:16]


def expert_layers(cfg: ModelConfig) -> tuple:
    """HF layer indices that hold routed experts (MoE layers, then the MTP layer if any)."""
    return tuple(cfg.moe_layers) + ((cfg.mtp_layer_index,) if cfg.has_mtp else ())


# ----------------------------------------------------------------------------- scatter reads
_tls = threading.local()


def _aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned (mmap-backed) uint8 buffer; untouched pages cost no RAM."""
    if nbytes <= 0:
        return np.zeros(0, np.uint8)
    return np.frombuffer(mmap.mmap(-1, _round_up(nbytes)), dtype=np.uint8)[:nbytes]


def _scratch(nbytes: int) -> np.ndarray:
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _aligned_empty(_round_up(max(nbytes, ALIGN)))
        _tls.buf = buf
    return buf[:nbytes]


def _is_direct_ok(a: np.ndarray) -> bool:
    return a.ctypes.data % ALIGN == 0 and a.nbytes % ALIGN == 0


def _preadv_full(fd: int, bufs: list, offset: int) -> int:
    """preadv that loops over short reads; returns bytes read (== sum of buffer sizes, else raises EOFError)."""
    total = sum(b.nbytes for b in bufs)
    done = 0
    views = [memoryview(b).cast("B") for b in bufs]
    while done < total:
        n = os.preadv(fd, views, offset + done)
        if n <= 0:
            raise EOFError(f"short read at offset {offset + done}")
        done += n
        # drop the fully-read buffers, trim the partial one
        while n > 0 and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    return done


def read_record_into(fd: int, direct_fd: Optional[int], layout: RecordLayout, offset: int, dests: dict) -> int:
    """ONE read of the record at ``offset`` scattered into ``dests`` (name -> contiguous array of the section's
    bytes).  Padding between sections goes to scratch.  With ``direct_fd`` (O_DIRECT) the scatter is used when
    every destination is page-aligned, else the record is read into an aligned staging buffer and copied.
    Returns the bytes the read call returned."""
    return sum(r() for r in record_reads(fd, direct_fd, layout, offset, dests))


def balanced_chunk(length: int, threads: int, chunk: int) -> int:
    """The byte-range size the store reads a ``length``-byte record with: at most ``chunk`` bytes, and the record
    split into a multiple of ``threads`` near-equal ranges (4096-aligned), so that a batch of a few records ends
    with every thread finishing together (1 MB ranges of a 3.5 MB record on 4 threads leave the fourth thread a
    0.5 MB range: 11% of the batch's time with a thread idle).  0 stays 0 (one read per record)."""
    if chunk <= 0 or length <= 0:
        return 0
    threads = max(1, threads)
    n = threads * -(-length // (threads * chunk))          # ranges: a multiple of threads, each <= chunk
    return min(_round_up(-(-length // n)), _round_up(chunk))


def record_reads(fd: int, direct_fd: Optional[int], layout: RecordLayout, offset: int, dests: dict,
                 chunk: int = 0) -> list:
    """The read of one record as independent callables (run them in any order, on any threads; each returns the
    bytes its read call returned).  ``chunk`` > 0 splits the record into byte ranges of ``chunk`` bytes (a multiple
    of 4096: O_DIRECT-safe), one ``preadv`` each, so a few large records keep several I/O threads busy to the end
    of a batch; 0 = one ``preadv`` for the whole record."""
    secs = layout.sections
    length = layout.record_len     # the whole record (trailing padding included): bytes_read == record lengths
    targets = [dests[s.name].reshape(-1).view(np.uint8) for s in secs]   # must be contiguous views
    if direct_fd is not None and not all(_is_direct_ok(t) for t in targets):
        def staged():
            stage = _scratch(length)
            n = _preadv_full(direct_fd, [stage], offset)
            for s, t in zip(secs, targets):
                t[...] = stage[s.offset:s.offset + s.nbytes]
            return n
        return [staged]
    iov, pos = [], 0
    pad_at = []
    for s, t in zip(secs, targets):
        if s.offset > pos:
            pad_at.append((len(iov), s.offset - pos))
            iov.append(None)
        iov.append(t)
        pos = s.offset + s.nbytes
    if length > pos:
        pad_at.append((len(iov), length - pos))
        iov.append(None)
    if pad_at:      # padding bytes are discarded: one shared scratch (concurrent writes to it are harmless)
        scratch = _scratch(sum(p for _, p in pad_at))
        o = 0
        for i, p in pad_at:
            iov[i] = scratch[o:o + p]
            o += p
    dfd = direct_fd if direct_fd is not None else fd
    if chunk <= 0 or chunk >= length:
        return [lambda: _preadv_full(dfd, iov, offset)]
    chunk = _round_up(chunk)
    views, s0 = [], 0                   # (view, start, end) in record bytes; plain ints (numpy scalars are slow here)
    for b in iov:
        v = memoryview(b).cast("B")
        views.append((v, s0, s0 + len(v)))
        s0 += len(v)
    out, i = [], 0
    for a in range(0, length, chunk):
        b = min(a + chunk, length)
        part = []
        while i < len(views) and views[i][2] <= a:
            i += 1
        j = i
        while j < len(views) and views[j][1] < b:
            v, lo, hi = views[j]
            part.append(v[max(a, lo) - lo:min(b, hi) - lo])
            j += 1
        out.append(functools.partial(_preadv_full, dfd, part, offset + a))
    return out


def record_crc(layout: RecordLayout, dests: dict) -> int:
    crc = 0
    for s in layout.sections:
        crc = zlib.crc32(dests[s.name].reshape(-1).view(np.uint8), crc)
    return crc


def _open_direct(path: str) -> Optional[int]:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


# ----------------------------------------------------------------------------- the converted container
@dataclasses.dataclass
class LayerEntry:
    layer: int
    path: str
    layout: RecordLayout
    offsets: np.ndarray      # int64 [E]
    lengths: np.ndarray      # int64 [E]
    crcs: np.ndarray         # uint32 [E]
    verified: np.ndarray     # bool [E]
    fd: int = -1
    direct_fd: Optional[int] = None
    stale: bool = False      # a read failed: the file is opened again before the next (it may have been replaced)


class Container:
    """A validated, opened container (see the module docstring).  Thread-safe reads."""

    def __init__(self, path: str, manifest: dict, entries: dict, verify: str, direct_io: bool):
        self.path = path
        # the per-record list is in the LayerEntry arrays now: 19,200 dicts (~11 MB) are not kept for the process
        self.manifest = {k: v for k, v in manifest.items() if k != "experts"}
        self._entries = entries
        self.verify = verify
        self.direct_io = direct_io
        self.expert_layers = tuple(sorted(entries))
        for e in entries.values():
            self._open(e)

    def _open(self, e: LayerEntry):
        e.fd = os.open(e.path, os.O_RDONLY)
        try:   # whole-record reads: kernel readahead beyond a record only wastes disk bandwidth
            os.posix_fadvise(e.fd, 0, 0, os.POSIX_FADV_RANDOM)
        except (AttributeError, OSError):
            pass
        if self.direct_io:
            e.direct_fd = _open_direct(e.path)
            if e.direct_fd is None:
                raise ContainerError(f"{e.path}: O_DIRECT is not supported on this file system (drop --direct_io)")

    def _reopen(self, ent: LayerEntry):
        """After a failed read: the layer's file opened again by name (restored, or replaced by a good copy), its
        records checked again at their next read; a missing file is one error line."""
        for fd in (ent.fd, ent.direct_fd):
            if fd is not None and fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        ent.fd, ent.direct_fd = -1, None
        try:
            self._open(ent)
        except OSError as err:
            raise ContainerError(f"{ent.path}: layer {ent.layer}: cannot open ({err.strerror or err})") from None
        ent.verified[:] = False
        ent.stale = False

    @property
    def dense_path(self) -> str:
        return os.path.join(self.path, self.manifest["dense"]["file"])

    @property
    def dense_format(self) -> str:
        return self.manifest["dense"]["format"]

    def entry(self, layer: int) -> LayerEntry:
        try:
            return self._entries[layer]
        except KeyError:
            raise ContainerError(f"{self.path}: layer {layer} has no routed experts in this container") from None

    def num_experts(self, layer: int) -> int:
        return len(self.entry(layer).offsets)

    def layout(self, layer: int) -> RecordLayout:
        return self.entry(layer).layout

    def read_buffer_bytes(self, threads: int) -> int:
        """Memory the reads themselves take beyond the slots: one record-sized staging buffer per I/O thread where a
        layout's sections are not ALIGN multiples (O_DIRECT then stages, ``record_reads``), else none (buffered and
        aligned direct reads scatter straight into the slots).  At GLM-4.5-Air's and GLM-5.2's real widths every
        section is aligned: 4 x 19 MB were counted for nothing."""
        lays = [e.layout for e in self._entries.values()]
        if not lays or all(lay.direct_into_slots for lay in lays):
            return 0
        return max(1, threads) * max(lay.record_len for lay in lays)

    def files(self) -> list:
        return [e.path for e in self._entries.values()]

    def _check(self, ent: LayerEntry, e: int, dests: dict):
        got = record_crc(ent.layout, dests)
        if got != int(ent.crcs[e]):
            raise ChecksumError(f"{ent.path}: layer {ent.layer} expert {e}: checksum mismatch "
                                f"(manifest crc32 {int(ent.crcs[e]):08x}, read {got:08x}); re-run glm-jax-convert")
        ent.verified[e] = True

    def read_expert(self, layer: int, e: int, dests: dict) -> int:
        jobs, finish = self.read_jobs(layer, e, dests)
        n = sum(j() for j in jobs)
        finish()
        return n

    def read_jobs(self, layer: int, e: int, dests: dict, chunk: int = 0):
        """(jobs, finish): the record's read as independent callables (see ``record_reads``; run them on any
        threads, each returns its bytes), then ``finish()`` once all are done (the checksum check)."""
        ent = self.entry(layer)
        if ent.stale:
            self._reopen(ent)
        off = int(ent.offsets[e])

        def guard(r):
            def job():
                try:
                    return r()
                except EOFError:
                    ent.stale = True
                    raise TruncatedError(f"{ent.path}: layer {layer} expert {e}: file truncated (record at offset "
                                         f"{off}, length {int(ent.lengths[e])})") from None
                except OSError as err:          # EIO, a file gone from under a reopened fd, ...
                    ent.stale = True
                    raise ContainerError(f"{ent.path}: layer {layer} expert {e}: read failed "
                                         f"({err.strerror or err})") from None
            return job

        def finish():
            if self.verify == "always" or (self.verify in ("first", "all") and not ent.verified[e]):
                try:
                    self._check(ent, e, dests)
                except ChecksumError:
                    ent.stale = True
                    raise

        return [guard(r) for r in record_reads(ent.fd, ent.direct_fd, ent.layout, off, dests, chunk)], finish

    def load_expert(self, layer: int, e: int) -> dict:
        """Fresh arrays of one expert's sections, row-major as ``quant.quantize`` writes them (tests, tools; the
        record itself holds the tiles layout for quantized formats)."""
        lay = self.layout(layer)
        dests = {s.name: np.empty(s.shape, s.np_dtype) for s in lay.sections}
        self.read_expert(layer, e, dests)
        return lay.rows(dests)

    def verify_all(self):
        """Read and checksum every record (``verify="all"``, ``--verify``): one set of page-aligned buffers per
        layer reused for all its records (O_DIRECT scatters into them), no per-record arrays or layout
        conversion (``load_expert``'s row-major copy cost more than the read at 19,200 records)."""
        for L in self.expert_layers:
            lay = self.layout(L)
            dests = {s.name: _aligned_empty(s.nbytes).view(s.np_dtype).reshape(s.shape) for s in lay.sections}
            for e in range(self.num_experts(L)):
                jobs, finish = self.read_jobs(L, e, dests)
                for j in jobs:
                    j()
                if not self.entry(L).verified[e]:
                    self._check(self.entry(L), e, dests)

    def close(self):
        for ent in self._entries.values():
            for fd in (ent.fd, ent.direct_fd):
                if fd is not None and fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            ent.fd, ent.direct_fd = -1, None


def is_container(path: str) -> bool:
    return os.path.exists(os.path.join(path, MANIFEST_NAME))


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST_NAME)
    if not os.path.exists(mpath):
        raise ContainerError(f"{mpath}: not found (not a glm-jax container; run glm-jax-convert)")
    try:
        man = fileio.read_json(mpath)
    except fileio.FileProblem as e:
        raise ContainerError(f"{mpath}: {e}") from None
    except OSError as e:
        raise ContainerError(f"{mpath}: cannot read ({e.strerror or e})") from None
    if not isinstance(man, dict):
        raise ContainerError(f"{mpath}: expected a JSON object")
    ver = man.get("format_version")
    if ver != FORMAT_VERSION:
        raise UnknownVersionError(f"{mpath}: unknown container format version {ver!r} "
                                  f"(this glm-jax reads version {FORMAT_VERSION}); re-run glm-jax-convert")
    return man


def _plain_name(v, what: str, mpath: str, under: str = "") -> str:
    """A file name inside the container (relative, no '..'; ``under``: its directory)."""
    ok = isinstance(v, str) and v and not os.path.isabs(v) and ".." not in v.split("/") and "\\" not in v
    if ok and under:
        ok = os.path.dirname(v) == under and "/" not in os.path.basename(v)
    elif ok:
        ok = "/" not in v
    if not ok:
        raise ContainerError(f"{mpath}: {what}: invalid file name {v!r}")
    return v


def _int(v, what: str, mpath: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ContainerError(f"{mpath}: {what}: expected an integer >= {lo}, got {v!r}")
    return v


def _crc(v, what: str, mpath: str) -> int:
    if not isinstance(v, str) or not v.startswith("crc32:"):
        raise ContainerError(f"{mpath}: {what}: expected a checksum 'crc32:<8 hex digits>', got {v!r}")
    try:
        c = int(v[6:], 16)
    except ValueError:
        raise ContainerError(f"{mpath}: {what}: expected a checksum 'crc32:<8 hex digits>', got {v!r}") from None
    if not 0 <= c < (1 << 32):
        raise ContainerError(f"{mpath}: {what}: checksum out of range: {v!r}")
    return c


def open_container(path: str, cfg: Optional[ModelConfig] = None, verify: str = "first",
                   direct_io: bool = False) -> Container:
    """Open and validate a container.  ``verify``: first | always | all | none (module docstring)."""
    if verify not in ("first", "always", "all", "none"):
        raise ValueError(f"verify must be first|always|all|none, got {verify!r}")
    man = read_manifest(path)
    mpath = os.path.join(path, MANIFEST_NAME)
    try:
        layers = _check_manifest(path, man, mpath, cfg)
    except GlmJaxError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
        raise ContainerError(f"{mpath}: malformed manifest ({type(e).__name__}: {e}); re-run glm-jax-convert") from None
    c = Container(path, man, layers, verify, direct_io)
    if verify == "all":
        try:
            c.verify_all()
        except BaseException:
            c.close()
            raise
    return c


def _check_manifest(path: str, man: dict, mpath: str, cfg: Optional[ModelConfig]) -> dict:
    """Every field the engine uses, checked (types, names, sizes, layouts vs the config); returns the LayerEntries."""
    if cfg is not None:
        want = config_fields(cfg)
        have = man.get("config_fields")
        if not isinstance(have, dict):
            raise ContainerError(f"{mpath}: 'config_fields' missing or not an object; re-run glm-jax-convert")
        for k, d in CONFIG_FIELDS_DEFAULTED.items():
            if have.get(k, d) != want.get(k, d):
                raise ConfigMismatchError(f"{mpath}: config mismatch: '{k}' is {have.get(k, d)!r} in the container but "
                                          f"{want.get(k, d)!r} in {cfg.source or 'the model config'}")
        for k, v in want.items():
            if k not in have:
                raise ConfigMismatchError(
                    f"{mpath}: config field '{k}' is not recorded in this container (written by an older "
                    f"glm-jax-convert); re-run glm-jax-convert into it (finished layers are kept)")
            if have[k] != v:
                raise ConfigMismatchError(f"{mpath}: config mismatch: '{k}' is {have[k]!r} in the container but "
                                          f"{v!r} in {cfg.source or 'the model config'}")
    linfo = man.get("layers")
    recs_all = man.get("experts")
    if not isinstance(linfo, dict) or not isinstance(recs_all, list):
        raise ContainerError(f"{mpath}: 'layers' (object) or 'experts' (list) missing; re-run glm-jax-convert")
    layers = {}
    by_layer: dict = {}
    for i, rec in enumerate(recs_all):
        if not isinstance(rec, dict):
            raise ContainerError(f"{mpath}: experts[{i}]: expected an object")
        by_layer.setdefault(_int(rec.get("layer"), f"experts[{i}].layer", mpath), []).append(rec)
    allowed = set(expert_layers(cfg)) if cfg is not None else None
    for key, info in linfo.items():
        L = int(key)
        if str(L) != key or L < 0 or (allowed is not None and L not in allowed):
            raise ContainerError(f"{mpath}: layers: unexpected layer {key!r}"
                                 + (f" (expert layers of this config: {sorted(allowed)})" if allowed else ""))
        if not isinstance(info, dict):
            raise ContainerError(f"{mpath}: layers[{key}]: expected an object")
        lay = RecordLayout.from_json(info["layout"])
        E = _int(info.get("num_experts"), f"layers[{key}].num_experts", mpath, 1)
        if cfg is not None:
            sec = lay.section("gate_up_scale")
            old = sec is not None and sec.dtype == "float32"         # older int4_g containers: f32 scales
            ref = make_layout(lay.fmt, cfg.hidden_size, cfg.moe_intermediate_size,
                              scale_dtype="float32" if old else None)
            if lay != ref:
                raise ContainerError(f"{mpath}: layer {L}: record layout does not match format {lay.fmt!r} for "
                                     f"hidden_size={cfg.hidden_size}, moe_intermediate_size="
                                     f"{cfg.moe_intermediate_size}; re-run glm-jax-convert")
            if E != cfg.n_routed_experts:
                raise ConfigMismatchError(f"{mpath}: layer {L}: {E} experts, the config has n_routed_experts="
                                          f"{cfg.n_routed_experts}")
            lay = ref
        fname = _plain_name(info.get("file"), f"layers[{key}].file", mpath, EXPERT_DIR)
        recs = sorted(by_layer.get(L, []), key=lambda r: _int(r.get("expert"), "experts[].expert", mpath))
        fpath = os.path.join(path, fname)
        if len(recs) != E or [r["expert"] for r in recs] != list(range(E)):
            raise ContainerError(f"{mpath}: layer {L}: expert records incomplete ({len(recs)} of {E})")
        for r in recs:
            w = f"layer {L} expert {r['expert']}"
            if r.get("file") != fname:
                raise ContainerError(f"{mpath}: {w}: file {r.get('file')!r} is not the layer's file {fname!r}")
            if (_int(r.get("offset"), w + " offset", mpath) != r["expert"] * lay.record_len
                    or _int(r.get("length"), w + " length", mpath) != lay.record_len):
                raise ContainerError(f"{mpath}: {w}: record at offset {r['offset']} length {r['length']}, expected "
                                     f"{r['expert'] * lay.record_len} / {lay.record_len} (the layout's record size)")
        offsets = np.array([r["offset"] for r in recs], np.int64)
        lengths = np.array([r["length"] for r in recs], np.int64)
        crcs = np.array([_crc(r.get("checksum"), f"layer {L} expert {r['expert']} checksum", mpath) for r in recs],
                        np.uint32)
        if not os.path.isfile(fpath):
            raise TruncatedError(f"{fpath}: missing (layer {L}, experts 0..{E - 1})")
        size = os.path.getsize(fpath)
        ends = offsets + lengths
        bad = np.nonzero(ends > size)[0]
        if len(bad):
            e = int(bad[0])
            raise TruncatedError(f"{fpath}: truncated to {size} bytes: layer {L} expert {e} needs bytes "
                                 f"[{int(offsets[e])}, {int(ends[e])})")
        layers[L] = LayerEntry(L, fpath, lay, offsets, lengths, crcs, np.zeros(E, bool))
    if cfg is not None:
        missing = [L for L in expert_layers(cfg) if L not in layers]
        if missing:
            raise ConfigMismatchError(f"{mpath}: config mismatch: no expert records for layer {missing[0]}")
    dense = man.get("dense")
    if not isinstance(dense, dict):
        raise ContainerError(f"{mpath}: 'dense' missing or not an object; re-run glm-jax-convert")
    dpath = os.path.join(path, _plain_name(dense.get("file"), "dense.file", mpath))
    dsize = _int(dense.get("size"), "dense.size", mpath)
    _crc(dense.get("checksum"), "dense.checksum", mpath)
    if dense.get("format") not in ("bf16", "int8", "int4_g64", "f32"):
        raise ContainerError(f"{mpath}: dense.format: expected bf16, int8, int4_g64 or f32, got "
                             f"{dense.get('format')!r}")
    if not os.path.isfile(dpath):
        raise TruncatedError(f"{dpath}: missing (dense weights); re-run glm-jax-convert")
    if os.path.getsize(dpath) != dsize:
        raise TruncatedError(f"{dpath}: size {os.path.getsize(dpath)} != {dsize} in the manifest (truncated?); "
                             "re-run glm-jax-convert")
    return layers


def check_not_partial(path: str):
    """A directory the converter started but did not finish (no manifest.json, which it writes last) is reported
    as such, not as a broken Hugging Face checkpoint."""
    if is_container(path):
        return
    marks = [DENSE_NAME, DENSE_NAME + ".done.json", DENSE_NAME + ".tmp", CONVERT_MARKER]
    partial = any(os.path.exists(os.path.join(path, m)) for m in marks)
    ed = os.path.join(path, EXPERT_DIR)
    if not partial and os.path.isdir(ed):
        partial = any(n.startswith("layer_") for n in os.listdir(ed))
    if partial:
        raise ContainerError(f"{path}: incomplete conversion (no manifest.json: glm-jax-convert writes it last) - "
                             f"re-run glm-jax-convert --dst={path} (it resumes)")


def verify_dense(path: str, man: Optional[dict] = None):
    """Checksum the dense file against the manifest (at every container load, and ``--verify``)."""
    man = man or read_manifest(path)
    mpath = os.path.join(path, MANIFEST_NAME)
    d = man.get("dense")
    if not isinstance(d, dict):
        raise ContainerError(f"{mpath}: 'dense' missing or not an object; re-run glm-jax-convert")
    dpath = os.path.join(path, _plain_name(d.get("file"), "dense.file", mpath))
    want = _crc(d.get("checksum"), "dense.checksum", mpath)
    try:
        got = file_crc(dpath)
    except OSError as e:
        raise TruncatedError(f"{dpath}: cannot read the dense weights ({e.strerror or e})") from None
    if got != want:
        raise ChecksumError(f"{dpath}: checksum mismatch (dense weights: manifest crc32 {want:08x}, file {got:08x}); "
                            "the file is corrupt - re-run glm-jax-convert")


def file_crc(path: str, chunk: int = 16 << 20) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        mv = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(mv[:n], crc)
    return crc


# ----------------------------------------------------------------------------- HF safetensors reading
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _np_dtype(name: str):
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    key: str
    file: str
    dtype: str      # numpy name
    shape: tuple
    start: int      # absolute byte offset in the file
    nbytes: int


def _check_layout(fpath: str, hdr: dict):
    """The tensors' byte ranges tile the data section (no two overlap: two experts would share weights) and the
    safetensors library accepts the file (its own validation, the reader every other tool uses)."""
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in hdr.items() if k != "__metadata__")
    for (s0, e0, k0), (s1, e1, k1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SourceError(f"{fpath}: tensors '{k0}' and '{k1}' overlap (data_offsets [{s0}, {e0}] and "
                              f"[{s1}, {e1}])")
    try:
        from safetensors import safe_open

        with safe_open(fpath, framework="numpy"):
            pass
    except ImportError:
        return
    except Exception as e:          # noqa: BLE001  (SafetensorError and what its Rust side raises)
        raise SourceError(f"{fpath}: the safetensors library refuses it ({' '.join(str(e).split())[:200]})") from None


class SafeTensorsDir:
    """Raw, header-only safetensors index over a single file or a sharded directory.

    Reads tensors (or leading-axis rows of them) with ``os.pread`` into fresh numpy arrays, so memory stays at the
    size of what is read; handles bf16 / fp8 via ml_dtypes (the safetensors numpy API does not).  ``bytes_read``
    counts what the read calls returned."""

    def __init__(self, path: str):
        self.path = path
        self.tensors: dict = {}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._fds: dict = {}
        self._local = threading.local()
        if os.path.exists(os.path.join(path, INDEX_NAME)):
            files = sorted(set(read_index(path, SourceError).values()))
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise SourceError(f"{path}: no *.safetensors files (expected a Hugging Face checkpoint directory)")
        for name in files:
            fpath = os.path.join(path, name)
            if not os.path.isfile(fpath):
                raise SourceError(f"{fpath}: listed in {INDEX_NAME} but missing")
            self._read_header(fpath)

    def _read_header(self, fpath: str):
        """Index one safetensors file's header, checked: every tensor's dtype, shape, byte range inside the file and
        byte count (shape x item size); every problem is one SourceError line naming the file and tensor."""
        size = os.path.getsize(fpath)
        with open(fpath, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SourceError(f"{fpath}: truncated safetensors header")
            hlen = int.from_bytes(head, "little")
            if hlen > size - 8 or hlen > (100 << 20):
                raise SourceError(f"{fpath}: bad safetensors header (header length {hlen} exceeds the file)")
            try:
                hdr = json.loads(f.read(hlen).decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise SourceError(f"{fpath}: bad safetensors header: {e}") from None
        if not isinstance(hdr, dict):
            raise SourceError(f"{fpath}: bad safetensors header (expected a JSON object)")
        base = 8 + hlen
        for k, v in hdr.items():
            if k == "__metadata__":
                continue
            bad = lambda m: SourceError(f"{fpath}: bad safetensors header: tensor '{k}': {m}")  # noqa: E731
            if not isinstance(v, dict):
                raise bad("expected an object")
            dt = v.get("dtype")
            if dt not in _ST_DTYPES:
                raise SourceError(f"{fpath}: tensor '{k}': unsupported dtype {dt!r}")
            shape, offs = v.get("shape"), v.get("data_offsets")
            if (not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                                   for d in shape)):
                raise bad(f"invalid shape {shape!r}")
            if (not isinstance(offs, list) or len(offs) != 2
                    or any(isinstance(o, bool) or not isinstance(o, int) for o in offs) or not 0 <= offs[0] <= offs[1]):
                raise bad(f"invalid data_offsets {offs!r}")
            s, e = offs
            if base + e > size:
                raise SourceError(f"{fpath}: tensor '{k}' extends past the end of the file (truncated)")
            if int(np.prod(shape, dtype=np.int64)) * _np_dtype(_ST_DTYPES[dt]).itemsize != e - s:
                raise bad(f"{e - s} bytes for shape {shape} of {dt}")
            self.tensors[k] = TensorInfo(k, fpath, _ST_DTYPES[dt], tuple(shape), base + s, e - s)
        _check_layout(fpath, hdr)


    def __contains__(self, key):
        return key in self.tensors

    def keys(self):
        return self.tensors.keys()

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise SourceError(f"{self.path}: missing tensor '{key}'") from None

    def _fd(self, fpath: str) -> int:
        with self._lock:
            fd = self._fds.get(fpath)
            if fd is None:
                fd = self._fds[fpath] = os.open(fpath, os.O_RDONLY)
            return fd

    def _read(self, ti: TensorInfo, start: int, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, np.uint8)
        n = _preadv_full(self._fd(ti.file), [buf], start) if nbytes else 0
        with self._lock:
            self.bytes_read += n
        self._local.n = getattr(self._local, "n", 0) + n
        return buf

    def thread_bytes(self) -> int:
        """Bytes read so far by the calling thread (exact per-call accounting under concurrency)."""
        return getattr(self._local, "n", 0)

    def read(self, key: str) -> np.ndarray:
        ti = self.info(key)
        return self._read(ti, ti.start, ti.nbytes).view(_np_dtype(ti.dtype)).reshape(ti.shape)

    def read_row(self, key: str, i: int) -> np.ndarray:
        """Row ``i`` of the leading axis (one expert of a fused [E, ...] tensor)."""
        ti = self.info(key)
        if not ti.shape or not 0 <= i < ti.shape[0]:
            raise SourceError(f"{ti.file}: tensor '{key}' of shape {list(ti.shape)} has no row {i}")
        row = ti.nbytes // ti.shape[0]
        return self._read(ti, ti.start + i * row, row).view(_np_dtype(ti.dtype)).reshape(ti.shape[1:])

    def read_float(self, key: str) -> np.ndarray:
        """float32 tensor; FP8 weights with a ``{key}_scale_inv`` (128x128 blocks) are dequantized.  NaN/Inf is
        refused (WeightError naming the tensor)."""
        w = self.read(key)
        sk = key + "_scale_inv"
        if self.is_fp8(key):
            w = w.astype(np.float32)
            if sk in self.tensors:
                w = dequant_fp8(w, self.read(sk).astype(np.float32))
        elif w.dtype != np.float32:
            w = np.asarray(w, np.float32)
        check_finite(w, key, self.info(key).file)
        return w

    def is_fp8(self, key: str) -> bool:
        return self.info(key).dtype.startswith("float8")

    def close(self):
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def expert_keys(layer: int) -> dict:
    p = f"model.layers.{layer}.mlp.experts"
    return {"prefix": p, "fused_gate_up": f"{p}.gate_up_proj", "fused_down": f"{p}.down_proj",
            "per": lambda e, proj: f"{p}.{e}.{proj}_proj.weight"}


def is_routed_expert_key(key: str) -> bool:
    parts = key.split(".")
    return len(parts) > 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] == "mlp" and parts[4] == "experts"


class HFExperts:
    """Float expert weights of one HF directory, per-expert keys or fused tensors."""

    def __init__(self, st: SafeTensorsDir, cfg: ModelConfig):
        self.st, self.cfg = st, cfg

    def has_layer(self, layer: int) -> bool:
        k = expert_keys(layer)
        return k["fused_gate_up"] in self.st or k["per"](0, "gate") in self.st

    def source_dtype(self, layer: int) -> str:
        k = expert_keys(layer)
        key = k["fused_gate_up"] if k["fused_gate_up"] in self.st else k["per"](0, "gate")
        return self.st.info(key).dtype

    def _fused_row(self, key: str, e: int) -> np.ndarray:
        """Expert ``e`` of a fused [E, ...] tensor as float32; FP8 with a fused ``{key}_scale_inv`` [E, out/128,
        in/128] (or per-tensor-row blocks) is dequantized on read, row by row (never the whole tensor)."""
        w = self.st.read_row(key, e)
        if not self.st.is_fp8(key):
            w = w.astype(np.float32)
            check_finite(w, f"{key}[{e}]", self.st.info(key).file)
            return w
        sk = key + "_scale_inv"
        if sk not in self.st:
            raise SourceError(f"{self.st.info(key).file}: FP8 tensor '{key}' has no '{sk}' (128x128 block scales)")
        try:
            w = dequant_fp8(w, self.st.read_row(sk, e))
        except GlmJaxError as err:
            raise SourceError(f"{self.st.info(key).file}: '{sk}': {err}") from None
        check_finite(w, f"{key}[{e}]", self.st.info(key).file)
        return w

    def describe(self, layer: int, e: int) -> str:
        """The file and tensor(s) expert ``e`` of ``layer`` comes from (error messages)."""
        k = expert_keys(layer)
        if k["fused_gate_up"] in self.st:
            return f"{self.st.info(k['fused_gate_up']).file}: '{k['fused_gate_up']}'[{e}] / '{k['fused_down']}'[{e}]"
        key = k["per"](e, "gate")
        return f"{self.st.info(key).file}: '{k['per'](e, '{gate,up,down}')}'"

    def get(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, H], up [I, H], down [H, I]) as float32."""
        H, I = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        k = expert_keys(layer)
        if k["fused_gate_up"] in self.st:
            gu, dn = (self._fused_row(k[n], e) for n in ("fused_gate_up", "fused_down"))
            if gu.shape == (H, 2 * I) and H != 2 * I:
                gu = gu.T
            if dn.shape == (I, H) and H != I:
                dn = dn.T
            if gu.shape != (2 * I, H) or dn.shape != (H, I):
                raise SourceError(f"{self.st.info(k['fused_gate_up']).file}: '{k['fused_gate_up']}' / down_proj: "
                                  f"expert shapes {gu.shape}/{dn.shape}, expected {(2 * I, H)}/{(H, I)}")
            return gu[:I], gu[I:], dn
        out = []
        for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            key = k["per"](e, proj)
            w = self.st.read_float(key)
            if w.shape != shape:
                raise SourceError(f"{self.st.info(key).file}: '{key}': shape {w.shape}, expected {shape}")
            out.append(w)
        return tuple(out)


class HFExpertSource:
    """Store-compatible expert source over a plain HF directory: records are built on read in f32 (f32/fp8
    sources) or bf16 (bf16/f16 sources).  ``read_expert`` returns the bytes read from the safetensors files."""

    def __init__(self, path: str, cfg: ModelConfig):
        self.path, self.cfg = path, cfg
        self.st = SafeTensorsDir(path)
        self.hf = HFExperts(self.st, cfg)
        self.expert_layers = tuple(L for L in expert_layers(cfg) if self.hf.has_layer(L))
        self._layouts = {}
        for L in self.expert_layers:
            dt = self.hf.source_dtype(L)
            fmt = "bf16" if dt in ("bfloat16", "float16") else "f32"
            self._layouts[L] = make_layout(fmt, cfg.hidden_size, cfg.moe_intermediate_size)
        missing = [L for L in cfg.moe_layers if L not in self._layouts]
        if missing:
            raise SourceError(f"{path}: layer {missing[0]}: no routed expert tensors "
                              f"('{expert_keys(missing[0])['per'](0, 'gate')}' or the fused gate_up_proj)")

    def num_experts(self, layer: int) -> int:
        return self.cfg.n_routed_experts

    def layout(self, layer: int) -> RecordLayout:
        if layer not in self._layouts:
            raise SourceError(f"{self.path}: layer {layer} has no routed experts")
        return self._layouts[layer]

    def files(self) -> list:
        return sorted({t.file for t in self.st.tensors.values()})

    def read_buffer_bytes(self, threads: int) -> int:
        """One record per I/O thread: tensors are read, converted and copied into the slots record by record."""
        return max(1, threads) * max((lay.record_len for lay in self._layouts.values()), default=0)

    def read_expert(self, layer: int, e: int, dests: dict) -> int:
        lay = self.layout(layer)
        before = self.st.thread_bytes()
        g, u, d = self.hf.get(layer, e)
        dt = lay.section("gate_up").np_dtype
        dests["gate_up"].reshape(2 * lay.inter, lay.hidden)[...] = np.concatenate([g, u], 0).astype(dt)
        dests["down"].reshape(lay.hidden, lay.inter)[...] = d.astype(dt)
        return self.st.thread_bytes() - before

    def read_jobs(self, layer: int, e: int, dests: dict, chunk: int = 0):
        return [functools.partial(self.read_expert, layer, e, dests)], lambda: None

    def close(self):
        self.st.close()


def open_expert_source(model_dir: str, cfg: ModelConfig, verify: str = "first", direct_io: bool = False):
    """A converted container if ``model_dir`` has a manifest, else the plain HF safetensors directory."""
    if is_container(model_dir):
        return open_container(model_dir, cfg, verify=verify, direct_io=direct_io)
    return HFExpertSource(model_dir, cfg)

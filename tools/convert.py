"""glm-jax-convert: Hugging Face GLM MoE checkpoint -> glm-jax expert container.

    glm-jax-convert --src=HF_DIR --dst=OUT_DIR [--expert_format=int4_g64] [--group_size=64]
                    [--mtp_format=int8_row] [--dense_format=bf16|int8] [--verify]

Reads the source tensor by tensor (raw safetensors headers + pread; one expert or one dense tensor in memory at
a time), writes one experts/layer_LLL.bin per MoE layer (fixed-size, 4096-aligned records, one per expert, see
glm_jax/container.py), dense.safetensors (HF key names) and manifest.json LAST.  Every file is written to a temp
name then renamed.  Each finished layer leaves a done record with per-record crc32s; a re-run skips a layer only
if its done record matches the requested format/source AND every record's checksum re-verifies (a corrupted or
truncated finished layer is redone).  ``--verify`` re-checks an existing container (all checksums) and exits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from typing import Optional

import numpy as np

from glm_jax import quant
from glm_jax.config import load_config
from glm_jax.container import (ALIGN, DENSE_NAME, DENSE_SCALE_SUFFIX, EXPERT_DIR, FORMAT_VERSION, MANIFEST_NAME,
                               HFExperts, RecordLayout, SafeTensorsDir, SourceError, config_fields, config_hash,
                               done_file_name, expert_layers, file_crc, is_routed_expert_key, layer_file_name,
                               make_layout, normalize_format, open_container, verify_dense)

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


def _atomic_json(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def source_fingerprint(st: SafeTensorsDir, src: str) -> str:
    h = hashlib.sha256()
    with open(os.path.join(src, "config.json"), "rb") as f:
        h.update(f.read())
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
    lay = RecordLayout.from_json(rec["layout"])
    E = rec["num_experts"]
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
    tmp = path + ".tmp"
    crcs = []
    with open(tmp, "wb") as f:
        for e in range(E):
            g, u, d = hf.get(L, e)
            buf, crc = lay.encode(g, u, d)
            f.write(buf)
            crcs.append(crc)
            prog.update(1, f"layer {L}")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _atomic_json(os.path.join(dst, done_file_name(L)), dict(want, layout=lay.to_json(), num_experts=E, crcs=crcs))


# ----------------------------------------------------------------------------- dense
def _dense_kind(key: str, shape: tuple, dtype: str, dense_format: str) -> str:
    """'f32' | 'bf16' | 'int8' | 'keep' for one dense tensor."""
    if not (dtype.startswith("float") or dtype == "bfloat16"):
        return "keep"
    last = key.split(".")[-2] if key.count(".") else key
    router = key.endswith("mlp.gate.weight") or key.endswith("e_score_correction_bias")
    if router or "norm" in last or key.endswith(".bias") or len(shape) < 2:
        return "f32"
    if dense_format == "int8" and len(shape) == 2 and key.endswith(".weight"):
        return "int8"
    return "bf16" if dense_format in ("bf16", "int8") else "f32"


def _dense_plan(st: SafeTensorsDir, dense_format: str) -> list:
    """[(out_key, st_dtype, shape, producer)] for every non-expert tensor, sorted by key."""
    plan = []
    for k in sorted(st.keys()):
        if is_routed_expert_key(k):
            continue
        if k.endswith("_scale_inv") and k[: -len("_scale_inv")] in st:
            continue        # consumed by the FP8 dequant of its weight
        ti = st.info(k)
        dt = "float32" if ti.dtype.startswith("float8") else ti.dtype
        kind = _dense_kind(k, ti.shape, dt, dense_format)
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
        elif kind == "bf16":
            plan.append((k, "BF16", ti.shape, lambda k=k: st.read_float(k).astype(quant._bf16())))
        else:
            plan.append((k, "F32", ti.shape, lambda k=k: st.read_float(k)))
    return plan


def write_safetensors_streaming(path: str, plan: list, metadata: dict, prog: Optional[_Progress] = None) -> tuple:
    """Write a safetensors file one tensor at a time (header from the plan's shapes/dtypes); returns (size, crc)."""
    header, off = {}, 0
    for key, dt, shape, _ in plan:
        n = int(np.prod(shape, dtype=np.int64)) * _ITEM[dt]
        header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    tmp = path + ".tmp"
    crc = 0
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


# ----------------------------------------------------------------------------- files to copy
_SKIP_COPY = {"model.safetensors.index.json", MANIFEST_NAME}


def _copy_side_files(src: str, dst: str):
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if (not os.path.isfile(p) or name.endswith(".safetensors") or name in _SKIP_COPY or name.startswith(".")
                or name.endswith(".tmp")):
            continue
        tmp = os.path.join(dst, name + ".tmp")
        shutil.copyfile(p, tmp)
        os.replace(tmp, os.path.join(dst, name))


# ----------------------------------------------------------------------------- driver
def convert(src: str, dst: str, expert_format: str = "int4_g64", group_size: int = 64, mtp_format: str = "int8_row",
            dense_format: str = "bf16", progress: bool = True, fail_after_layers: Optional[int] = None) -> dict:
    """Convert ``src`` (HF dir) into ``dst``; returns the manifest.  ``fail_after_layers`` (tests): raise
    RuntimeError after that many layers were converted in this run (a simulated interrupt)."""
    if dense_format not in ("bf16", "int8", "f32"):
        raise SourceError(f"--dense_format must be bf16, int8 or f32, got {dense_format!r}")
    cfg = load_config(src)
    st = SafeTensorsDir(src)
    hf = HFExperts(st, cfg)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    fmt = normalize_format(expert_format, group_size)
    mfmt = normalize_format(mtp_format, group_size)
    layers = [L for L in expert_layers(cfg) if L < cfg.num_hidden_layers or hf.has_layer(L)]
    for L in layers:
        if not hf.has_layer(L):
            raise SourceError(f"{src}: layer {L}: no routed expert tensors (expected "
                              f"'model.layers.{L}.mlp.experts.0.gate_proj.weight' or '...experts.gate_up_proj')")
    os.makedirs(os.path.join(dst, EXPERT_DIR), exist_ok=True)
    mpath = os.path.join(dst, MANIFEST_NAME)
    if os.path.exists(mpath):
        os.replace(mpath, mpath + ".old")   # the manifest is written last; an incomplete run has none
    fp = source_fingerprint(st, src)
    plan = _dense_plan(st, dense_format)
    todo, lay_of = [], {}
    for L in layers:
        lay_of[L] = make_layout(mfmt if L == cfg.mtp_layer_index else fmt, H, I, group_size)
    want_of = {L: {"layer": L, "fmt": lay_of[L].fmt, "source": fp, "format_version": FORMAT_VERSION} for L in layers}
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
    prog = _Progress(len(todo) * E + (0 if dense_ok else len(plan)), progress)
    try:
        for n, L in enumerate(todo):
            if fail_after_layers is not None and n >= fail_after_layers:
                raise RuntimeError(f"simulated interrupt after {n} layers")
            _convert_layer(hf, dst, L, lay_of[L], E, want_of[L], prog)
        if not dense_ok:
            meta = {"glm_jax.dense_format": dense_format, "glm_jax.scale_suffix": DENSE_SCALE_SUFFIX,
                    "format": "pt"}
            size, crc = write_safetensors_streaming(dense_path, plan, meta, prog)
            _atomic_json(dense_path + ".done.json", dict(dense_want, size=size, crc=crc))
            drec = _load_json(dense_path + ".done.json")
    finally:
        prog.close()
    _copy_side_files(src, dst)
    experts, linfo = [], {}
    for L in layers:
        rec = _load_json(os.path.join(dst, done_file_name(L)))
        lay = RecordLayout.from_json(rec["layout"])
        linfo[str(L)] = {"file": layer_file_name(L), "format": lay.fmt, "layout": lay.to_json(),
                         "num_experts": rec["num_experts"], "size": rec["num_experts"] * lay.record_len}
        for e, c in enumerate(rec["crcs"]):
            experts.append({"layer": L, "expert": e, "file": layer_file_name(L), "offset": e * lay.record_len,
                            "length": lay.record_len, "format": lay.fmt, "checksum": f"crc32:{c:08x}"})
    with open(os.path.join(src, "config.json"), "rb") as f:
        src_cfg_sha = hashlib.sha256(f.read()).hexdigest()
    man = {
        "format_version": FORMAT_VERSION,
        "created_by": "glm-jax-convert",
        "alignment": ALIGN,
        "source_config_sha256": src_cfg_sha,
        "source_fingerprint": fp,
        "config_hash": config_hash(cfg),
        "config_fields": config_fields(cfg),
        "expert_format": fmt, "mtp_format": mfmt, "group_size": group_size,
        "shapes": {"hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E},
        "dense": {"file": DENSE_NAME, "format": dense_format, "size": drec["size"],
                  "checksum": f"crc32:{drec['crc']:08x}", "scale_suffix": DENSE_SCALE_SUFFIX},
        "layers": linfo,
        "experts": experts,
        "resumed_layers": skipped,
    }
    _atomic_json(mpath, man)
    if os.path.exists(mpath + ".old"):
        os.remove(mpath + ".old")
    st.close()
    return man


def main(argv):
    from absl import flags
    F = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {argv[1:]}")
    if F.verify and not F.src:
        cfg = load_config(F.dst)
        c = open_container(F.dst, cfg, verify="all")
        verify_dense(F.dst, c.manifest)
        c.close()
        print(f"{F.dst}: OK (all record and dense checksums verified)")
        return 0
    if not F.src or not F.dst:
        raise SystemExit("--src and --dst are required")
    t0 = time.time()
    try:
        man = convert(F.src, F.dst, F.expert_format, F.group_size, F.mtp_format, F.dense_format,
                      progress=F.progress)
        if F.verify:
            c = open_container(F.dst, load_config(F.dst), verify="all")
            verify_dense(F.dst, man)
            c.close()
    except Exception as e:  # one line for user-facing errors
        from glm_jax.config import GlmJaxError
        if isinstance(e, GlmJaxError):
            print(f"glm-jax-convert: {e}", file=sys.stderr)
            return 2
        raise
    n = len(man["experts"])
    size = sum(v["size"] for v in man["layers"].values())
    print(f"{F.dst}: {len(man['layers'])} expert layers, {n} records ({size / 1e9:.3f} GB), dense "
          f"{man['dense']['size'] / 1e9:.3f} GB ({man['dense']['format']}); resumed {len(man['resumed_layers'])} "
          f"layers; {time.time() - t0:.1f} s")
    return 0


def _define_flags():
    from absl import flags
    if "expert_format" in flags.FLAGS:
        return
    flags.DEFINE_string("src", None, "Hugging Face checkpoint directory (single or sharded safetensors)")
    flags.DEFINE_string("dst", None, "output container directory")
    flags.DEFINE_string("expert_format", "int4_g64", "routed experts: int4_g64 | int4_row | int8_row | bf16")
    flags.DEFINE_integer("group_size", 64, "int4 group size for int4_g formats")
    flags.DEFINE_string("mtp_format", "int8_row", "MTP layer experts (int4 MTP heads lose acceptance)")
    flags.DEFINE_string("dense_format", "bf16", "dense weights: bf16 | int8 (per-output-channel) | f32")
    flags.DEFINE_bool("verify", False, "verify every checksum after converting (or, without --src, of --dst)")
    flags.DEFINE_bool("progress", True, "progress bar on stderr")


def run():
    from absl import app
    _define_flags()
    app.run(main)


if __name__ == "__main__":
    run()

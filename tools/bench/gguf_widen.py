"""A GGUF of a slice whose MoE layers have more experts than llama.cpp's converter can hold in this machine's RAM.

    PREFIX/venv/bin/python tools/bench/gguf_widen.py --twin TWIN.gguf --src FULL_HF_DIR --out OUT.gguf

Run by llama.cpp's own venv (``tools/bench/build_llamacpp.sh``: gguf-py, torch, safetensors); it imports nothing of
glm-jax.  llama.cpp's converter stacks a layer's experts into one tensor and dequantizes it to f32 before quantizing:
for GLM-5.2's 256 experts of 3 x 6144 x 2048 that is 12.9 GB a tensor, with copies, and the converter was OOM-killed
at 24 GB.  This writes the same file another way:

* TWIN.gguf is llama.cpp's converter + llama-quantize run on the *same* slice with fewer routed experts (the slice
  generator seeds every tensor by its key, so the twin's dense tensors and its experts 0..k-1 are the full slice's).
  Its metadata, its tensor names, order and types, and every tensor without an expert axis are copied unchanged:
  every choice of llama.cpp's (names, MLA's kv_b split, the per-tensor quantization types) stays llama.cpp's.
* Each tensor with the expert axis (``ffn_{gate,up,down}_exps``, ``ffn_gate_inp``, ``exp_probs_b``) is rebuilt from
  FULL_HF_DIR's tensors with all experts, one expert at a time (FP8 block-scaled sources dequantized as llama.cpp's
  converter does: weight x weight_scale_inv per 128 x 128 block; rounded to bf16 as the twin's BF16 base GGUF was),
  quantized to the twin's type of that tensor with gguf-py's reference quantizer, and ``{arch}.expert_count`` is set
  to the full count.  The twin's experts 0..k-1 must come out byte for byte as llama-quantize wrote them, or it stops.

The output is written to OUT.tmp and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np
import torch
from safetensors import safe_open

import gguf

EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


class Source:
    """The full HF slice's tensors by key (single file or sharded with an index), FP8 dequantized to f32."""

    def __init__(self, d: str):
        idx = os.path.join(d, "model.safetensors.index.json")
        names = ["model.safetensors"]
        if os.path.exists(idx):
            with open(idx) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        self.files = {}
        self.where = {}
        for name in names:
            h = safe_open(os.path.join(d, name), framework="pt")
            self.files[name] = h
            for k in h.keys():
                self.where[k] = name
        with open(os.path.join(d, "config.json")) as f:
            self.config = json.load(f)

    def get(self, key: str, base: str = "f32") -> np.ndarray:
        if key not in self.where:
            raise SystemExit(f"gguf_widen: {key} not in the source checkpoint")
        t = self.files[self.where[key]].get_tensor(key)
        if t.dtype == torch.float8_e4m3fn:
            s = self.files[self.where[key + "_scale_inv"]].get_tensor(key + "_scale_inv").float()
            o, i = t.shape
            s = s.repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :i]
            t = t.float() * s
        if base == "bf16":              # the twin went through a BF16 GGUF (the converter's --outtype bf16)
            t = t.to(torch.bfloat16)
        w = t.float().numpy()
        if base == "q8_0":              # ... or a Q8_0 one, requantized by llama-quantize --allow-requantize
            q8 = gguf.GGMLQuantizationType.Q8_0
            w = gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8).reshape(w.shape)
        return w


def quantize(w: np.ndarray, qtype) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--twin", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="bf16", choices=["bf16", "f32", "q8_0"],
                    help="what the twin's experts were written as before llama-quantize (hf_to_gguf.py --outtype)")
    a = ap.parse_args()
    t0 = time.time()
    src = Source(a.src)
    n_full = int(src.config["n_routed_experts"])
    reader = gguf.GGUFReader(a.twin)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    count_key = gguf.Keys.LLM.EXPERT_COUNT.format(arch=arch)
    n_twin = int(reader.fields[count_key].contents())
    if n_twin >= n_full:
        raise SystemExit(f"gguf_widen: --twin has {n_twin} experts, --src {n_full}: nothing to widen")
    align = reader.fields.get(gguf.Keys.General.ALIGNMENT)
    writer = gguf.GGUFWriter(a.out + ".tmp", arch=arch, endianess=reader.endianess)
    if align is not None:
        writer.data_alignment = int(align.contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vt = field.types[0]
        sub = field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        val = n_full if field.name == count_key else field.contents()
        writer.add_key_value(field.name, val, vt, sub_type=sub)

    def wide_kind(t):
        m = re.match(r"blk\.(\d+)\.(\w+?)\.(weight|bias)$", t.name)
        if not m:
            return None
        layer, base = int(m.group(1)), m.group(2)
        if base in EXPERT_TENSORS or base in ("ffn_gate_inp", "exp_probs_b"):
            if t.data.shape[0] != n_twin:
                raise SystemExit(f"gguf_widen: {t.name} has shape {tuple(t.data.shape)}, expected {n_twin} experts first")
            return layer, base
        if n_twin in tuple(t.data.shape[:1]) and "exps" in base:
            raise SystemExit(f"gguf_widen: {t.name}: an expert tensor this tool does not know")
        return None

    plan = []
    for t in reader.tensors:
        k = wide_kind(t)
        if k is None:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
            plan.append((t, None))
            continue
        shape = (n_full,) + tuple(t.data.shape[1:])
        nbytes = t.data.nbytes // n_twin * n_full
        writer.add_tensor_info(t.name, shape, t.data.dtype, nbytes, t.tensor_type)
        plan.append((t, k))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, k in plan:
        if k is None:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
            continue
        layer, base = k
        p = f"model.layers.{layer}.mlp."
        if base == "ffn_gate_inp":
            w = quantize(src.get(p + "gate.weight"), t.tensor_type)
        elif base == "exp_probs_b":
            w = quantize(src.get(p + "gate.e_score_correction_bias"), t.tensor_type)
        else:
            out = np.empty((n_full,) + tuple(t.data.shape[1:]), t.data.dtype)
            for e in range(n_full):
                out[e] = quantize(src.get(p + f"experts.{e}.{EXPERT_TENSORS[base]}.weight", a.base),
                                  t.tensor_type)
                if e < n_twin and not np.array_equal(out[e], t.data[e]):
                    raise SystemExit(f"gguf_widen: {t.name} expert {e} differs from the twin's: the twin is not "
                                     "this slice with fewer experts (or the quantizer is not llama-quantize's)")
            w = out
            print(f"gguf_widen: {t.name} ({n_full} experts) at {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        if w.nbytes != t.data.nbytes // n_twin * n_full:
            raise SystemExit(f"gguf_widen: {t.name}: {w.nbytes} bytes, expected {t.data.nbytes // n_twin * n_full}")
        writer.write_tensor_data(w)
    writer.close()
    os.replace(a.out + ".tmp", a.out)
    print(f"gguf_widen: {a.out} written in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

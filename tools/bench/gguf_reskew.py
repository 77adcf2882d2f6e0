"""A copy of a slice's GGUF with the routers' biases of a reskewed glm-jax container (tools/fixtures/reskew.py).

    PREFIX/venv/bin/python tools/bench/gguf_reskew.py --src IN.gguf --biases CONTAINER/dense.safetensors --out OUT.gguf

Run by llama.cpp's own venv (``tools/bench/build_llamacpp.sh``: gguf-py, safetensors); it imports nothing of
glm-jax.  The synthetic slices skew expert popularity through the router's ``e_score_correction_bias`` alone (llama.cpp:
``blk.N.exp_probs_b.bias``, f32), so the GGUF of another skew is the same file with those tensors overwritten by the
container's ``model.layers.N.mlp.gate.e_score_correction_bias``: both engines then route alike.  Every other byte
is the source's; written to OUT.tmp and renamed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil

import numpy as np
from safetensors import safe_open

import gguf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--biases", required=True, help="the reskewed container's dense.safetensors")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if os.path.exists(a.out):
        raise SystemExit(f"gguf_reskew: --out={a.out}: exists (not overwritten)")
    reader = gguf.GGUFReader(a.src)
    todo = []
    with safe_open(a.biases, "np") as f:
        for t in reader.tensors:
            m = re.match(r"blk\.(\d+)\.exp_probs_b\.bias$", t.name)
            if not m:
                continue
            new = f.get_tensor(f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias").astype("<f4")
            if t.tensor_type != gguf.GGMLQuantizationType.F32 or t.data.size != new.size:
                raise SystemExit(f"gguf_reskew: {t.name}: {t.tensor_type.name} x {t.data.size}, expected F32 x {new.size}")
            if not np.array_equal(np.asarray(t.data).reshape(-1), np.fromfile(a.src, "<f4", new.size, offset=t.data_offset)):
                raise SystemExit(f"gguf_reskew: {t.name}: data_offset {t.data_offset} is not where its data lies")
            todo.append((t.name, t.data_offset, new))
    if not todo:
        raise SystemExit(f"gguf_reskew: {a.src}: no blk.N.exp_probs_b.bias tensor")
    del reader
    tmp = a.out + ".tmp"
    shutil.copyfile(a.src, tmp)
    with open(tmp, "r+b") as f:
        for _, off, new in todo:
            f.seek(off)
            f.write(new.tobytes())
    os.replace(tmp, a.out)
    print(f"gguf_reskew: {a.out}: {', '.join(n for n, _, _ in todo)} rewritten")


if __name__ == "__main__":
    main()

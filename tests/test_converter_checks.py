"""The converter checks what the engine (and the safetensors library) check: dense shapes against config.json (a
transposed k_proj, an embedding larger than vocab_size: exit 0 and --verify OK, then refused by the engine); overlapping data_offsets (two experts
silently sharing weights) were accepted; a --dst whose parent is missing was 'not writable'; the int4 scales' range
error named no tensor."""

import json
import os
import shutil
import struct

import numpy as np

from glm_jax.experts.convert import cli_main

HF = os.path.join(os.path.dirname(__file__), "golden", "glm4moe_plain")
A = "model.layers.1.mlp.experts.0.gate_proj.weight"
B = "model.layers.1.mlp.experts.1.gate_proj.weight"


def _copy(tmp_path):
    d = tmp_path / "src"
    shutil.copytree(HF, d)
    return d


def _header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def _rewrite_header(path, hdr, n):
    text = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(text) <= n
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(text + b" " * (n - len(text)))          # the same length, padded as the format allows


def _convert(src, dst, capsys):
    rc = cli_main(["glm-jax-convert", f"--src={src}", f"--dst={dst}", "--noprogress"])
    return rc, capsys.readouterr().err


def test_overlapping_offsets_are_refused(tmp_path, capsys):
    src = _copy(tmp_path)
    st = src / "model.safetensors"
    n, hdr = _header(st)
    hdr[B]["data_offsets"] = list(hdr[A]["data_offsets"])      # expert 1's gate is expert 0's bytes
    _rewrite_header(st, hdr, n)
    rc, err = _convert(src, tmp_path / "out", capsys)
    assert rc == 2 and "overlap" in err and err.strip().count("\n") == 0, err


def test_dst_with_missing_parents_is_created(tmp_path, capsys):
    rc, err = _convert(HF, tmp_path / "a" / "b" / "c", capsys)
    assert rc == 0, err
    assert (tmp_path / "a" / "b" / "c" / "manifest.json").exists()


def test_int4_range_error_names_the_tensor(tmp_path, capsys):
    src = _copy(tmp_path)
    st = src / "model.safetensors"
    n, hdr = _header(st)
    s, e = hdr[B]["data_offsets"]
    w = np.full((e - s) // 4, 3e9, np.float32)                  # finite, beyond what f16 scales can express
    with open(st, "r+b") as f:
        f.seek(8 + n + s)
        f.write(w.tobytes())
    rc, err = _convert(src, tmp_path / "out", capsys)
    assert rc == 2 and "experts.1" in err and "layers.1" in err and err.strip().count("\n") == 0, err


def test_transposed_dense_projection_is_refused(tmp_path, capsys):
    src = _copy(tmp_path)
    st = src / "model.safetensors"
    n, hdr = _header(st)
    k = next(k for k, v in sorted(hdr.items()) if k.endswith("proj.weight") and ".experts." not in k
             and len(v["shape"]) == 2 and v["shape"][0] != v["shape"][1])    # a non-square dense projection
    hdr[k]["shape"] = hdr[k]["shape"][::-1]
    _rewrite_header(st, hdr, n)
    rc, err = _convert(src, tmp_path / "out", capsys)
    assert rc == 2 and k in err and "config.json implies" in err, err


def test_vocab_size_against_a_larger_embedding_is_refused(tmp_path, capsys):
    src = _copy(tmp_path)
    c = json.loads((src / "config.json").read_text())
    c["vocab_size"] -= 1
    (src / "config.json").write_text(json.dumps(c))
    rc, err = _convert(src, tmp_path / "out", capsys)
    assert rc == 2 and "embed_tokens" in err and "config.json implies" in err, err



def test_verify_checks_dense_shapes_against_config(tmp_path, capsys, monkeypatch):
    """A container written without the shape check (by an older converter): --verify refuses it as the engine does."""
    import glm_jax.experts.convert as conv
    src = _copy(tmp_path)
    st = src / "model.safetensors"
    n, hdr = _header(st)
    k = next(k for k, v in sorted(hdr.items()) if k.endswith("proj.weight") and ".experts." not in k
             and len(v["shape"]) == 2 and v["shape"][0] != v["shape"][1] and v["shape"][0] % 2 == 0)
    hdr[k]["shape"] = hdr[k]["shape"][::-1]
    _rewrite_header(st, hdr, n)
    dst = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(conv, "check_dense_shapes", lambda st, cfg: None)
        rc, err = _convert(src, dst, capsys)
    assert rc == 0, err
    rc = cli_main(["glm-jax-convert", "--verify", f"--dst={dst}"])
    err = capsys.readouterr().err
    assert rc == 2 and k in err and "config.json implies" in err, err

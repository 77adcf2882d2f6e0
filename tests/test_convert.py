"""glm-jax-convert and the container: round trips, sources, resume, and every refusal."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from glm_jax import quant
from glm_jax.config import GlmJaxError, load_config
from glm_jax.container import (ChecksumError, ConfigMismatchError, SafeTensorsDir, TruncatedError,
                               UnknownVersionError, layer_file_name, open_container, open_expert_source, verify_dense)
from glm_jax_tools.convert import convert
from glm_jax_tools.synth_model import tiny_config, write_hf_checkpoint

G = 32   # group size < hidden (64) so int4_g32 differs from int4_row


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "m"
    ref = write_hf_checkpoint(str(d), tiny_config(), seed=1)
    return str(d), ref


def _check_experts(c, ref, fmt_of):
    for L in c.expert_layers:
        lay = c.layout(L)
        assert lay.fmt == fmt_of(L)
        for e in range(c.num_experts(L)):
            r = c.load_expert(L, e)
            p = f"model.layers.{L}.mlp.experts.{e}."
            gu = np.concatenate([ref[p + "gate_proj.weight"], ref[p + "up_proj.weight"]])
            dn = ref[p + "down_proj.weight"]
            for name, w in (("gate_up", gu), ("down", dn)):
                got = quant.dequantize(r[name], r.get(name + "_scale"), lay.fmt)
                q, s = quant.quantize(w, lay.fmt)
                np.testing.assert_array_equal(got, quant.dequantize(q, s, lay.fmt))   # bit-exact vs the reference
                kind, g = quant.parse_format(lay.fmt)
                if kind.startswith("int4"):
                    gg = w.shape[1] if kind == "int4_row" else g
                    amax = np.abs(w.reshape(w.shape[0], -1, gg)).max(-1, keepdims=True)
                    err = np.abs(got - w).reshape(w.shape[0], -1, gg)
                    assert (err <= amax / 7 / 2 + 1e-6).all()
                elif kind == "int8_row":
                    assert (np.abs(got - w) <= np.abs(w).max(1, keepdims=True) / 127 / 2 + 1e-6).all()
                else:
                    np.testing.assert_allclose(got, w, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("fmt", [f"int4_g{G}", "int4_row", "int8_row", "bf16"])
def test_roundtrip_formats(hf, tmp_path, fmt):
    src, ref = hf
    man = convert(src, str(tmp_path / "c"), expert_format=fmt, group_size=G, progress=False)
    cfg = load_config(str(tmp_path / "c"))
    c = open_container(str(tmp_path / "c"), cfg, verify="all")
    mtp = cfg.mtp_layer_index
    assert c.expert_layers == (1, 2, mtp)
    _check_experts(c, ref, lambda L: "int8_row" if L == mtp else fmt)
    # records: one contiguous 4096-aligned record per expert, listed in the manifest
    for rec in man["experts"]:
        assert rec["offset"] % 4096 == 0 and rec["length"] % 4096 == 0
    assert len(man["experts"]) == 3 * 8
    # dense: every non-expert HF key, bf16 (router / norms / biases f32)
    from safetensors.numpy import load_file  # noqa: F401  (header-compatible file)
    st = SafeTensorsDir(str(tmp_path / "c"))
    dense_keys = {k for k in ref if ".mlp.experts." not in k}
    assert set(st.keys()) == dense_keys
    assert st.info("model.layers.1.mlp.gate.weight").dtype == "float32"
    assert st.info("model.layers.0.self_attn.q_proj.weight").dtype == "bfloat16"
    np.testing.assert_allclose(st.read_float("model.embed_tokens.weight"), ref["model.embed_tokens.weight"], rtol=1e-2, atol=1e-2)
    for f in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert os.path.exists(tmp_path / "c" / f)
    c.close()


@pytest.mark.parametrize("kind", ["fused", "sharded_bf16", "fp8", "fused_fp8"])
def test_sources(tmp_path, kind):
    src = str(tmp_path / "hf")
    kw = dict(fused=dict(experts="fused"), sharded_bf16=dict(dtype="bfloat16", shards=3), fp8=dict(dtype="fp8"),
              fused_fp8=dict(dtype="fp8", experts="fused"))[kind]
    ref = write_hf_checkpoint(src, tiny_config(), seed=2, **kw)
    if kind == "fused":   # the reference of fused tensors: same per-expert values
        ref.update({k: v for k, v in write_hf_checkpoint(str(tmp_path / "hf2"), tiny_config(), seed=2).items()
                    if ".experts." in k})
    if kind == "sharded_bf16":
        assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    convert(src, str(tmp_path / "c"), expert_format="int8_row", progress=False)
    cfg = load_config(str(tmp_path / "c"))
    c = open_container(str(tmp_path / "c"), cfg)
    _check_experts(c, ref, lambda L: "int8_row")
    st = SafeTensorsDir(str(tmp_path / "c"))
    assert not any(k.endswith("_scale_inv") for k in st.keys())   # fp8 dequantized on read
    np.testing.assert_allclose(st.read_float("model.layers.1.self_attn.q_proj.weight"),
                               ref["model.layers.1.self_attn.q_proj.weight"], rtol=1e-2, atol=1e-2)
    # a plain HF directory is a store-compatible source as well (float records)
    s = open_expert_source(src, cfg)
    lay = s.layout(1)
    dests = {x.name: np.empty(x.shape, x.np_dtype) for x in lay.sections}
    assert s.read_expert(1, 5, dests) > 0
    gu = np.concatenate([ref["model.layers.1.mlp.experts.5.gate_proj.weight"], ref["model.layers.1.mlp.experts.5.up_proj.weight"]])
    np.testing.assert_allclose(dests["gate_up"].astype(np.float32), gu, rtol=1e-6, atol=1e-6)
    s.close()
    if kind.endswith("fp8"):    # the resident loader dequantizes the same way (fused: [E, out/128, in/128] scales)
        from glm_jax import weights as W
        gu_all, dn_all = W.load_experts(W.TensorSource(src), cfg, 1)
        np.testing.assert_allclose(gu_all[5], gu, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dn_all[5], ref["model.layers.1.mlp.experts.5.down_proj.weight"], rtol=1e-6, atol=1e-6)


def test_dense_int8(hf, tmp_path):
    src, ref = hf
    convert(src, str(tmp_path / "c"), dense_format="int8", progress=False)
    st = SafeTensorsDir(str(tmp_path / "c"))
    k = "model.layers.0.mlp.down_proj.weight"
    assert st.info(k).dtype == "int8" and st.info(k + "_scale").shape == (64, 1)
    w = st.read(k).astype(np.float32) * st.read(k + "_scale")
    assert np.abs(w - ref[k]).max() <= np.abs(ref[k]).max() / 127
    assert st.info("model.layers.0.input_layernorm.weight").dtype == "float32"
    assert st.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype == "float32"


def test_resume_after_interrupt(hf, tmp_path):
    src, ref = hf
    dst = str(tmp_path / "c")
    with pytest.raises(RuntimeError, match="simulated interrupt"):
        convert(src, dst, progress=False, fail_after_layers=2)
    assert not os.path.exists(os.path.join(dst, "manifest.json"))      # the manifest is written last
    assert not any(n.endswith(".tmp") for n in os.listdir(os.path.join(dst, "experts")))
    man = convert(src, dst, progress=False)
    assert man["resumed_layers"] == [1, 2]
    # corrupt a finished layer (and drop the manifest): the re-run must verify and redo it
    with open(os.path.join(dst, layer_file_name(2)), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    os.remove(os.path.join(dst, "manifest.json"))
    man = convert(src, dst, progress=False)
    assert man["resumed_layers"] == [1, 3]
    cfg = load_config(dst)
    open_container(dst, cfg, verify="all").close()
    verify_dense(dst)
    # a changed format is not "finished"
    man = convert(src, dst, expert_format="int8_row", progress=False)
    assert man["resumed_layers"] == [3]


@pytest.fixture()
def good(hf, tmp_path):
    dst = str(tmp_path / "c")
    convert(hf[0], dst, progress=False)
    return dst, load_config(dst)


def test_error_unknown_version(good):
    dst, cfg = good
    p = os.path.join(dst, "manifest.json")
    m = json.load(open(p))
    m["format_version"] = 99
    json.dump(m, open(p, "w"))
    with pytest.raises(UnknownVersionError, match=r"manifest.json: unknown container format version 99"):
        open_container(dst, cfg)


def test_error_config_mismatch(good):
    dst, cfg = good
    bad = dataclasses.replace(cfg, moe_intermediate_size=32)
    with pytest.raises(ConfigMismatchError, match=r"manifest.json: config mismatch: 'moe_intermediate_size'"):
        open_container(dst, bad)


def test_error_truncated(good):
    dst, cfg = good
    p = os.path.join(dst, layer_file_name(2))
    size = os.path.getsize(p)
    rl = size // 8
    os.truncate(p, size - rl - 10)
    with pytest.raises(TruncatedError) as ei:
        open_container(dst, cfg)
    msg = str(ei.value)
    assert "layer_002.bin" in msg and "layer 2 expert 6" in msg and "\n" not in msg


def test_error_bad_checksum(good):
    dst, cfg = good
    p = os.path.join(dst, layer_file_name(1))
    rl = os.path.getsize(p) // 8
    with open(p, "r+b") as f:
        f.seek(5 * rl + 17)
        b = f.read(1)
        f.seek(5 * rl + 17)
        f.write(bytes([b[0] ^ 0x55]))
    c = open_container(dst, cfg)          # sizes are fine: opens
    c.load_expert(1, 4)                   # other records are fine
    with pytest.raises(ChecksumError) as ei:
        c.load_expert(1, 5)
    msg = str(ei.value)
    assert "layer_001.bin" in msg and "layer 1 expert 5" in msg and "checksum" in msg
    with pytest.raises(ChecksumError, match="layer 1 expert 5"):
        open_container(dst, cfg, verify="all")
    # and the store surfaces the same one-line error
    from glm_jax.store import ExpertStore
    for chunk_mb in (1.0, 4096 / (1 << 20)):    # whole-record reads, and 4 KiB ranges (checksum on an I/O thread)
        st = ExpertStore.open(dst, cfg, cache_cap=2, io_threads=2, read_chunk_mb=chunk_mb)
        with pytest.raises(GlmJaxError, match="layer 1 expert 5"):
            st.fetch(1, np.array([5, 0]))
        st.close(save_usage=False)


def test_cli(hf, tmp_path):
    dst = str(tmp_path / "c")
    exe = shutil.which("glm-jax-convert") or os.path.join(os.path.dirname(sys.executable), "glm-jax-convert")
    r = subprocess.run([exe, f"--src={hf[0]}", f"--dst={dst}", "--expert_format=int4_row", "--noprogress", "--verify"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "24 records" in r.stdout
    assert json.load(open(os.path.join(dst, "manifest.json")))["expert_format"] == "int4_row"

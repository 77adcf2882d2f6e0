"""glm-jax-convert and the container: round trips, sources, resume, and every refusal."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from glm_jax.errors import GlmJaxError
from glm_jax.experts.container import (
    ChecksumError,
    ConfigMismatchError,
    SafeTensorsDir,
    TruncatedError,
    UnknownVersionError,
    layer_file_name,
    open_container,
    open_expert_source,
    verify_dense,
)
from glm_jax.experts.convert import convert
from glm_jax.kernels import formats as quant
from glm_jax.model.config import load_config
from tools.fixtures.synth_model import tiny_config, write_hf_checkpoint

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
                    # half a step: amax / 7, int4_g's rounded up to an f16 (at most 2^-10 above)
                    assert (err <= amax / 7 * (1 + 2.0 ** -10) / 2 + 1e-6).all()
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
        from glm_jax.experts import weights as W
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
    # a finished container is never rewritten in place: another format needs --overwrite, which builds
    # the new one beside it and swaps it in
    with pytest.raises(GlmJaxError, match="finished conversion of --src.*--overwrite"):
        convert(src, dst, expert_format="int8_row", progress=False)
    man = convert(src, dst, expert_format="int8_row", progress=False, overwrite=True)
    assert man["resumed_layers"] == [] and man["expert_format"] == "int8_row"
    open_container(dst, load_config(dst), verify="all").close()


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
    from glm_jax.experts.store import ExpertStore
    for chunk_mb in (0.0, 4096 / (1 << 20)):    # whole-record reads, and 4 KiB ranges (checksum on an I/O thread;
        st = ExpertStore.open(dst, cfg, cache_cap=2, io_threads=4, read_chunk_mb=chunk_mb)     # 2 misses < 4 threads)
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


# ----------------------------------------------------------------------------- the destination
def _tree(d):
    """{relative path: bytes} of every file under d."""
    out = {}
    for root, _, files in os.walk(d):
        for n in files:
            p = os.path.join(root, n)
            out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


def test_foreign_nonempty_dst_is_refused_and_untouched(hf, tmp_path):
    other = tmp_path / "other_hf"
    write_hf_checkpoint(str(other), tiny_config(vocab_size=96), seed=7)    # another model's HF dir
    before = _tree(other)
    with pytest.raises(GlmJaxError) as ei:
        convert(hf[0], str(other), progress=False)
    msg = str(ei.value)
    assert "not empty" in msg and "--overwrite" in msg and "\n" not in msg
    assert _tree(other) == before                                  # config.json and the rest: not overwritten
    load_config(str(other))


def test_overwrite_replaces_only_when_complete(hf, tmp_path):
    """An older container of another model (with a tokenizer.json the new source lacks): refused; --overwrite
    keeps it valid through an interrupted run, then swaps the finished container in, with no stale files."""
    old_src = tmp_path / "old_src"
    write_hf_checkpoint(str(old_src), tiny_config(vocab_size=96), seed=5)
    (old_src / "tokenizer.json").write_text("{}")
    dst = str(tmp_path / "c")
    convert(str(old_src), dst, progress=False)
    assert os.path.exists(os.path.join(dst, "tokenizer.json"))
    old = _tree(dst)
    with pytest.raises(GlmJaxError, match="not a conversion of"):
        convert(hf[0], dst, progress=False)
    with pytest.raises(RuntimeError, match="simulated interrupt"):
        convert(hf[0], dst, progress=False, overwrite=True, fail_after_layers=1)
    assert _tree(dst) == old                                       # the old container stays valid meanwhile
    open_container(dst, load_config(dst), verify="all").close()
    man = convert(hf[0], dst, progress=False, overwrite=True)
    assert man["resumed_layers"] == [1]                            # the interrupted work was resumed
    assert not os.path.exists(os.path.join(dst, "tokenizer.json"))
    assert load_config(dst).vocab_size == 128
    open_container(dst, load_config(dst), verify="all").close()
    assert [n for n in os.listdir(tmp_path) if "glm-jax" in n] == []   # no work dir left behind


def test_dst_file_readonly_and_same_as_src(hf, tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(GlmJaxError, match="is a file"):
        convert(hf[0], str(f), progress=False)
    with pytest.raises(GlmJaxError, match="is the source directory"):
        convert(hf[0], hf[0], progress=False)
    ro = str(tmp_path / "ro")
    real = os.makedirs

    def erofs(p, *a, **k):      # a read-only file system (root ignores permission bits, so it is simulated)
        if str(p).startswith(ro):
            raise OSError(30, "Read-only file system", str(p))
        return real(p, *a, **k)
    monkeypatch.setattr(os, "makedirs", erofs)
    with pytest.raises(GlmJaxError) as ei:
        convert(hf[0], ro, progress=False)
    assert "not writable (Read-only file system)" in str(ei.value) and "\n" not in str(ei.value)


def test_enospc_leaves_no_partial_file_and_resumes(hf, tmp_path, monkeypatch):
    from glm_jax.experts import convert as C
    dst = str(tmp_path / "c")
    real_open = open

    class Full:
        """A file on a full disk: the second layer's record file fails mid-write with ENOSPC."""
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += 1
            if self.n > 3:
                raise OSError(28, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

    def fake_open(p, mode="r", *a, **k):
        f = real_open(p, mode, *a, **k)
        return Full(f) if str(p).endswith("layer_002.bin.tmp") else f
    monkeypatch.setattr(C, "open", fake_open, raising=False)
    with pytest.raises(GlmJaxError) as ei:
        convert(hf[0], dst, progress=False)
    msg = str(ei.value)
    assert "No space left on device" in msg and "\n" not in msg
    left = [n for n in os.listdir(os.path.join(dst, "experts")) + os.listdir(dst) if n.endswith(".tmp")]
    assert left == [] and not os.path.exists(os.path.join(dst, "manifest.json"))
    monkeypatch.undo()
    man = convert(hf[0], dst, progress=False)
    assert man["resumed_layers"] == [1]
    open_container(dst, load_config(dst), verify="all").close()


def test_free_space_is_checked_up_front(hf, tmp_path, monkeypatch):
    from glm_jax.experts import convert as C
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 20, 10 << 20, 100_000))
    dst = str(tmp_path / "c")
    with pytest.raises(GlmJaxError, match="not enough free space"):
        convert(hf[0], dst, progress=False)
    assert not os.path.exists(os.path.join(dst, layer_file_name(1)))   # refused before writing anything


def test_cli_errors_are_one_line(hf, tmp_path, capsys):
    from glm_jax.experts.convert import cli_main
    dst = str(tmp_path / "c")
    bad = [[f"--expert_format={f}"] for f in ("int3", "int4_g0", "int4_g7")] + [
        ["--mtp_format=bogus"], ["--dense_format=int2"], ["--expert_format=int4_g64", "--group_size=32"],
        ["--group_size=7", "--expert_format=int4_g"], ["--max_new_tokens=3"]]
    for extra in bad:
        assert cli_main(["glm-jax-convert", f"--src={hf[0]}", f"--dst={dst}", "--noprogress"] + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("glm-jax-convert: error: ") and err.count("\n") == 1, (extra, err)
    assert not os.path.exists(dst)                                 # refused before anything was written
    # --verify of a non-container, of a corrupt container, of nothing
    for target in (hf[0], str(tmp_path / "nothing")):
        assert cli_main(["glm-jax-convert", f"--dst={target}", "--verify"]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert cli_main(["glm-jax-convert", f"--src={hf[0]}", f"--dst={dst}", "--noprogress",
                     "--expert_format=int4_g", "--group_size=32"]) == 0
    man = json.load(open(os.path.join(dst, "manifest.json")))
    assert man["group_size"] == 32 and man["expert_format"] == "int4_g32"
    with open(os.path.join(dst, layer_file_name(2)), "r+b") as f:
        f.seek(64)
        f.write(b"\x00\x01\x02\x03")
    assert cli_main(["glm-jax-convert", f"--dst={dst}", "--verify"]) == 2
    err = capsys.readouterr().err
    assert "checksum" in err and err.count("\n") == 1
    os.remove(os.path.join(dst, "manifest.json"))
    assert cli_main(["glm-jax-convert", f"--dst={dst}", "--verify"]) == 2
    assert "incomplete conversion" in capsys.readouterr().err


def test_group_size_is_recorded_as_used(hf, tmp_path):
    man = convert(hf[0], str(tmp_path / "r"), expert_format="int4_row", progress=False)
    assert man["group_size"] is None
    man = convert(hf[0], str(tmp_path / "g"), expert_format="int4_g64", progress=False)
    assert man["group_size"] == 64


def test_malformed_index_is_one_line(tmp_path):
    from glm_jax.experts.weights import WeightError
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, tiny_config(), seed=2, shards=2)
    idx = os.path.join(src, "model.safetensors.index.json")
    good = json.load(open(idx))
    for bad in ({"weight_map": list(good["weight_map"])}, {"nope": 1}, [1, 2],
                {"weight_map": {"a": "../../etc/passwd.safetensors"}}, {"weight_map": {"a": 5}}):
        json.dump(bad, open(idx, "w"))
        with pytest.raises(GlmJaxError) as ei:
            convert(src, str(tmp_path / "c"), progress=False)
        assert "model.safetensors.index.json" in str(ei.value) and "\n" not in str(ei.value)
        import glm_jax
        with pytest.raises(WeightError, match="index"):
            glm_jax.Engine.load(src)
    open(idx, "w").write("{not json")
    with pytest.raises(GlmJaxError, match="invalid index file"):
        convert(src, str(tmp_path / "c"), progress=False)


def test_odd_rows_are_stored_int8_row_with_a_note(tmp_path, capsys):
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, tiny_config(moe_intermediate_size=33, num_hidden_layers=2, num_nextn_predict_layers=0),
                        seed=3)
    man = convert(src, str(tmp_path / "c"), expert_format="int4_g32", progress=False)
    assert {v["format"] for v in man["layers"].values()} == {"int8_row"}
    err = capsys.readouterr().err
    assert err.count("glm-jax-convert: note:") == 1 and "int8_row" in err and "33" in err
    open_container(str(tmp_path / "c"), load_config(str(tmp_path / "c")), verify="all").close()


# ----------------------------------------------------------------------------- finished containers, locks
def test_a_finished_container_is_never_replaced_without_overwrite(hf, tmp_path):
    """Before: --src=SAME --dst=FINISHED --expert_format=other exited 0 and rewrote it in place (killed midway: the
    valid container was gone, "incomplete conversion").  After: refused, the container untouched; --overwrite
    killed midway leaves the old one valid."""
    dst = str(tmp_path / "c")
    convert(hf[0], dst, progress=False)
    before = _tree(dst)
    for fmt in ("int8_row", "int4_g64"):            # another format, and the very same one
        with pytest.raises(GlmJaxError) as ei:
            convert(hf[0], dst, expert_format=fmt, progress=False)
        assert "finished" in str(ei.value) and "--overwrite" in str(ei.value) and "\n" not in str(ei.value)
        assert _tree(dst) == before
    with pytest.raises(RuntimeError, match="simulated interrupt"):
        convert(hf[0], dst, expert_format="int8_row", progress=False, overwrite=True, fail_after_layers=1)
    assert _tree(dst) == before
    open_container(dst, load_config(dst), verify="all").close()


def test_two_converts_into_one_dst_the_second_is_refused(hf, tmp_path, monkeypatch):
    """Before: two converts into one --dst shared the *.tmp names with no lock: the survivor exited 0 with a
    checksum mismatch inside, the other failed with a misleading 'write failed ... free space'.  After: the second
    is refused at once (one line), the first finishes a valid container."""
    import threading

    from glm_jax.experts import convert as C
    dst = str(tmp_path / "c")
    started, go = threading.Event(), threading.Event()
    real_layer = C._convert_layer

    def slow_layer(*a, **k):
        started.set()
        assert go.wait(60)
        return real_layer(*a, **k)
    monkeypatch.setattr(C, "_convert_layer", slow_layer)
    box = {}

    def first():
        try:
            box["man"] = convert(hf[0], dst, progress=False)
        except BaseException as e:          # noqa: BLE001  (reported below)
            box["err"] = e
    t = threading.Thread(target=first)
    t.start()
    assert started.wait(60)
    monkeypatch.setattr(C, "_convert_layer", real_layer)
    try:
        with pytest.raises(GlmJaxError) as ei:
            convert(hf[0], dst, expert_format="int8_row", progress=False)
    finally:
        go.set()
        t.join(120)
    assert "another glm-jax-convert" in str(ei.value) and "\n" not in str(ei.value)
    assert "err" not in box, box.get("err")
    open_container(dst, load_config(dst), verify="all").close()
    verify_dense(dst)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".lock")]     # the lock file is removed


def test_dst_inside_src_and_src_inside_dst_are_refused(hf, tmp_path):
    """Before: --dst inside --src was accepted (a container written into the checkpoint)."""
    src = str(tmp_path / "hf")
    shutil.copytree(hf[0], src)
    before = _tree(src)
    with pytest.raises(GlmJaxError, match="inside --src"):
        convert(src, os.path.join(src, "out"), progress=False)
    assert _tree(src) == before and not os.path.exists(os.path.join(src, "out"))
    with pytest.raises(GlmJaxError, match="inside --dst"):
        convert(src, str(tmp_path), progress=False, overwrite=True)
    assert _tree(src) == before


def test_overwrite_on_a_symlinked_dst_keeps_the_link(hf, tmp_path):
    """Before: --overwrite on a symlinked --dst swapped the link itself: the link became a directory and a stray
    link was left beside it.  After: the link's target is replaced, the link stays, nothing stray."""
    old_src = tmp_path / "old_src"
    write_hf_checkpoint(str(old_src), tiny_config(vocab_size=96), seed=5)
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "c"
    convert(str(old_src), str(target), progress=False)
    link = tmp_path / "link"
    link.symlink_to(target)
    man = convert(hf[0], str(link), progress=False, overwrite=True)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert load_config(str(target)).vocab_size == 128 and man["source_fingerprint"]
    open_container(str(target), load_config(str(target)), verify="all").close()
    assert sorted(os.listdir(tmp_path)) == ["link", "old_src", "store"]
    assert os.listdir(tmp_path / "store") == ["c"]


def test_a_checkpoint_declaring_mtp_without_its_weights_converts_and_runs(tmp_path, capsys):
    """transformers' Glm4MoeConfig declares num_nextn_predict_layers=1, but save_pretrained writes no MTP weights.
    Before: the HF dir ran, but glm-jax-convert wrote a container that failed with 'config mismatch: no expert
    records for layer 4' (--verify too).  After: converted without the MTP layer (one note line), it runs."""
    import glm_jax
    from glm_jax.experts.convert import cli_main
    src = tmp_path / "hf"
    write_hf_checkpoint(str(src), tiny_config(num_nextn_predict_layers=0), seed=3)
    c = json.loads((src / "config.json").read_text())
    c["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(c))
    ref = glm_jax.Engine.load(str(src))
    want = ref.generate([1, 2, 3], max_new_tokens=4, stop_on_eos=False).tokens
    ref.close()
    dst = tmp_path / "c"
    capsys.readouterr()
    assert cli_main(["glm-jax-convert", f"--src={src}", f"--dst={dst}", "--noprogress", "--verify",
                     "--expert_format=bf16", "--dense_format=f32"]) == 0
    err = capsys.readouterr().err
    notes = [ln for ln in err.splitlines() if "MTP" in ln]
    assert len(notes) == 1 and "note" in notes[0], err
    eng = glm_jax.Engine.load(str(dst))
    try:
        assert eng.cfg.num_nextn_predict_layers == 0
        assert eng.generate([1, 2, 3], max_new_tokens=4, stop_on_eos=False).tokens == want
    finally:
        eng.close()
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1    # --src untouched


def test_a_container_given_as_src_is_named(tmp_path):
    """Before: a container as --src -> 'layer 1: no routed expert tensors'."""
    from glm_jax.engine import default_model_path
    with pytest.raises(GlmJaxError) as ei:
        convert(default_model_path(), str(tmp_path / "c"), progress=False)
    assert "is a glm-jax container" in str(ei.value) and "\n" not in str(ei.value)
    assert not os.path.exists(tmp_path / "c")

"""The container and the expert store at GLM-5.2's record count (75 MoE layers x 256 experts = 19,200 records),
without writing the data: sparse layer files (truncate) under a manifest built by the converter's own
``expert_records``.  Structure, not timing: every record 4096-aligned, one file handle per layer file (two with
O_DIRECT), an index of a few bytes per record (no per-record Python objects kept), store arenas sized by the cache
cap (not by the expert count), ``verify_all`` without a per-record layout conversion."""

import gc
import json
import os
import tracemalloc
import zlib

import numpy as np
import pytest

from glm_jax.experts import container as C
from glm_jax.experts.convert import expert_records
from glm_jax.experts.store import ExpertStore
from glm_jax.kernels import formats as quant
from glm_jax.model.config import load_config
from tools.fixtures.synth_slice import counts_config


def _zero_crc(lay):
    crc = 0
    for s in lay.sections:
        crc = zlib.crc32(bytes(s.nbytes), crc)
    return crc


def _sparse_container(d, n_layers=None):
    """A container of counts_config('glm52') (H 64, I 64, int4_g64: 16 KB records) with sparse (all-zero) layer
    files; ``n_layers`` keeps only the first n MoE layers (the config then says so through mlp_layer_types)."""
    cfg_d = counts_config("glm52")
    if n_layers is not None:
        fd = 3
        cfg_d.update(num_hidden_layers=fd + n_layers, mlp_layer_types=["dense"] * fd + ["sparse"] * n_layers,
                     indexer_types=["full"] * (fd + n_layers))
    os.makedirs(os.path.join(d, C.EXPERT_DIR))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_d, f)
    cfg = load_config(d)
    lay = C.make_layout("int4_g64", cfg.hidden_size, cfg.moe_intermediate_size)
    E = cfg.n_routed_experts
    crcs = [_zero_crc(lay)] * E
    linfo, experts = {}, []
    for L in C.expert_layers(cfg):
        f = C.layer_file_name(L)
        with open(os.path.join(d, f), "wb") as fh:
            fh.truncate(E * lay.record_len)                    # sparse: no data written
        linfo[str(L)] = {"file": f, "format": lay.fmt, "layout": lay.to_json(), "num_experts": E,
                         "size": E * lay.record_len}
        experts += expert_records(L, lay, crcs)
    with open(os.path.join(d, C.DENSE_NAME), "wb") as fh:
        fh.write(b"\0" * 8)
    man = {"format_version": C.FORMAT_VERSION, "config_fields": C.config_fields(cfg), "layers": linfo,
           "experts": experts, "dense": {"file": C.DENSE_NAME, "format": "int4_g64", "size": 8,
                                         "checksum": f"crc32:{zlib.crc32(bytes(8)):08x}"}}
    with open(os.path.join(d, C.MANIFEST_NAME), "w") as f:
        json.dump(man, f)
    return cfg, lay


def _fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("records") / "c")
    cfg, lay = _sparse_container(d)
    return d, cfg, lay


def test_19200_records_aligned_one_handle_per_layer_small_index(full):
    d, cfg, lay = full
    assert len(C.expert_layers(cfg)) == 75 and cfg.n_routed_experts == 256 and cfg.num_experts_per_tok == 8
    assert lay.record_len % C.ALIGN == 0 and all(s.offset % C.ALIGN == 0 for s in lay.sections)
    gc.collect()
    fd0 = _fds()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    c = C.open_container(d, cfg)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    try:
        n = sum(c.num_experts(L) for L in c.expert_layers)
        assert n == 19200
        for L in c.expert_layers:
            ent = c.entry(L)
            assert isinstance(ent.offsets, np.ndarray) and ent.offsets.dtype == np.int64
            assert not (ent.offsets % C.ALIGN).any() and not (ent.lengths % C.ALIGN).any()
            assert (np.diff(ent.offsets) == lay.record_len).all()
        assert _fds() - fd0 == 75                 # one handle per layer file, none per record
        # the index: int64 offset + length, uint32 crc, bool verified per record (21 B) plus O(1) per layer; the
        # manifest's 19,200 per-record dicts (~560 B each) are not kept
        assert held < 64 * n, f"{held / n:.0f} B per record held after open"
        assert "experts" not in c.manifest
    finally:
        c.close()
    assert _fds() == fd0


def test_direct_io_read_at_the_last_record(full):
    d, cfg, lay = full
    fd0 = _fds()
    try:
        c = C.open_container(d, cfg, direct_io=True)
    except C.ContainerError as e:
        pytest.skip(str(e))                       # a file system without O_DIRECT (tmpfs)
    try:
        assert _fds() - fd0 == 2 * 75
        L = c.expert_layers[-1]
        dests = {s.name: C._aligned_empty(s.nbytes).view(s.np_dtype).reshape(s.shape) for s in lay.sections}
        assert c.read_expert(L, 255, dests) == lay.record_len     # checksum checked on this first read
        assert c.entry(L).verified[255] and int(c.entry(L).offsets[255]) == 255 * lay.record_len
    finally:
        c.close()


def test_store_arenas_sized_by_the_cap_not_the_expert_count(full):
    d, cfg, lay = full
    st = ExpertStore.open(d, cfg, cache_cap=2, state_dir="off", io_threads=1)
    try:
        assert len(st.layers) == 75
        for L, lc in st.layers.items():
            assert lc.S == cfg.num_experts_per_tok         # max(cap, one call's working set), not 256
            assert sum(a.nbytes for a in lc.arrays.values()) == lc.S * lay.payload_bytes
        L = max(st.layers)
        bank, slot_of = st.fetch(L, np.array([255, 0, 128]))
        assert (slot_of[[255, 0, 128]] >= 0).all() and st.stats()["bytes_read"] == 3 * lay.record_len
    finally:
        st.close(save_usage=False)


def test_verify_all_reads_every_record_without_converting_layouts(tmp_path, monkeypatch):
    d = str(tmp_path / "c")
    cfg, lay = _sparse_container(d, n_layers=2)

    def boom(*a, **k):
        raise AssertionError("verify_all converted a record to rows (quant.from_tiles)")
    monkeypatch.setattr(quant, "from_tiles", boom)
    c = C.open_container(d, cfg, verify="all")
    assert all(c.entry(L).verified.all() for L in c.expert_layers)
    c.close()
    # a corrupted record is still caught, by layer and expert
    L = C.expert_layers(cfg)[1]
    with open(os.path.join(d, C.layer_file_name(L)), "r+b") as f:
        f.seek(200 * lay.record_len + 5)
        f.write(b"\x01")
    with pytest.raises(C.ChecksumError, match=f"layer {L} expert 200"):
        C.open_container(d, cfg, verify="all")


def test_a_fetch_visits_only_the_layers_with_slots_to_release(full, monkeypatch):
    """fetch returns transient slots to the OS; at 75 layers it must not do per-layer work for every layer on every
    call (75 fetches per token x 75 layers)."""
    from glm_jax.experts import store as S
    d, cfg, lay = full
    st = ExpertStore.open(d, cfg, cache_cap=2, state_dir="off", io_threads=1)
    calls = []
    orig = S._Layer.release_pages
    monkeypatch.setattr(S._Layer, "release_pages", lambda self, keep: (calls.append(self.layer), orig(self, keep)))
    try:
        layers = sorted(st.layers)
        for L in layers:
            st.fetch(L, np.arange(8))        # 8 experts > cap 2: 6 slots of each layer to release later
        assert len(calls) <= len(layers)     # each layer's releases visited once, not 75 x 75
        calls.clear()
        st.fetch(layers[0], np.arange(2))
        assert len(calls) <= 1
    finally:
        st.close(save_usage=False)

"""A failed expert read leaves the store as it was.  Before: with --cache_cap=2 a truncated expert file gave one
clear error, and then, with the file restored, every later request failed ('shape mismatch: value array of shape
(0,)': the misses stayed cached in the policy with no slot) until a restart, while /health said ok; in the default
fetch mode (fused) the error was a 74-line XLA traceback.  Now every error path of a fetch (short read, checksum,
EIO, a missing file) is one GlmJaxError line in every fetch mode, the next request works once the file is back
(restored in place or replaced by a copy), and /health reports the store while it keeps failing."""

import errno
import os
import shutil

import httpx
import numpy as np
import pytest

import glm_jax
from glm_jax.errors import GlmJaxError
from glm_jax.experts import container as CT

MODEL = os.path.join(os.path.dirname(glm_jax.__file__), "default_model")
LAYER = "layer_003.bin"
PROMPT = "ROMEO: But soft, what light"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "model"
    shutil.copytree(MODEL, d)
    return d


def _gen(eng):
    return eng.generate(PROMPT, max_new_tokens=6, temperature=0).tokens


def _cold(eng):
    eng.store.drop_cache(page_cache=False)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)


def _corrupt(path):
    b = bytearray(open(path, "rb").read())
    for i in range(0, len(b), 4096):
        b[i] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(b))


def _one_line_error(eng, match):
    with pytest.raises(GlmJaxError) as e:
        _gen(eng)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 500 and match in msg, msg


@pytest.mark.parametrize("fetch", ["loop", "fused", "callback"])
@pytest.mark.parametrize("damage", ["truncate", "checksum", "missing"])
def test_failed_read_then_file_back(model, fetch, damage):
    path = model / "experts" / LAYER
    good = path.read_bytes()
    eng = glm_jax.Engine.load(str(model), cache_cap=2, fetch=fetch, prefetch=False)
    try:
        want = _gen(eng)
        _cold(eng)
        eng.store.source.entry(3).verified[:] = False         # as if never read: the checksum runs at the next read
        if damage == "truncate":
            _truncate(path)
            _one_line_error(eng, "truncated")
        elif damage == "checksum":
            _corrupt(path)
            _one_line_error(eng, "checksum")
        else:
            _truncate(path)
            _one_line_error(eng, "truncated")
            os.remove(path)                                    # the next read opens it again by name: not there
            _one_line_error(eng, "cannot open")
        for _ in range(2):
            _one_line_error(eng, LAYER)                        # failing again leaves the store as it was, again
        tmp = path.with_suffix(".new")
        tmp.write_bytes(good)
        os.replace(tmp, path)                                  # back, as a new file (a new inode)
        assert _gen(eng) == want
        _cold(eng)
        assert _gen(eng) == want
        assert eng.store.health["consecutive"] == 0 and eng.store.health["errors"] >= 3
    finally:
        eng.close()
        path.write_bytes(good)


def test_eio_is_one_line_and_recovers(model, monkeypatch):
    eng = glm_jax.Engine.load(str(model), cache_cap=2, fetch="loop", prefetch=False)
    try:
        want = _gen(eng)
        _cold(eng)
        real = CT._preadv_full
        fail = {"on": True}

        def flaky(*a, **k):
            if fail["on"]:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(*a, **k)
        monkeypatch.setattr(CT, "_preadv_full", flaky)
        _one_line_error(eng, "Input/output error")
        _one_line_error(eng, "Input/output error")
        fail["on"] = False
        assert _gen(eng) == want
    finally:
        eng.close()


def test_store_undo_keeps_counters_and_slots(model):
    """The store's own state after a failed fetch: slot map, cache membership, free slots and usage as before."""
    path = model / "experts" / LAYER
    good = path.read_bytes()
    eng = glm_jax.Engine.load(str(model), cache_cap=2, fetch="loop", prefetch=False)
    st = eng.store
    try:
        st.fetch(3, [0, 1])
        lc, idx = st._layer(3), st.index[3]
        before = (lc.slot_of.copy(), set(idx.cached), sorted(lc.free), st._usage[3].copy(), st.stats()["bytes_read"])
        _truncate(path)
        st.source.entry(3).verified[:] = False
        with pytest.raises(GlmJaxError, match="truncated"):
            st.fetch(3, [0, lc.E - 1])
        after = (lc.slot_of, idx.cached, sorted(lc.free), st._usage[3], st.stats()["bytes_read"])
        # expert 1 may have been evicted to make room (its slot held part of the failed read): nothing else moved
        assert np.array_equal(np.delete(after[0], 1), np.delete(before[0], 1)) and after[0][1] in (-1, before[0][1])
        assert after[1] <= before[1] and 0 in after[1] and lc.E - 1 not in after[1]
        assert np.array_equal(after[3], before[3]) and after[4] == before[4]
        path.write_bytes(good)
        bank, slot_of = st.fetch(3, [0, lc.E - 1])
        assert slot_of[0] >= 0 and slot_of[lc.E - 1] >= 0
    finally:
        eng.close()
        path.write_bytes(good)


def test_health_reports_a_failing_store(model):
    import serving
    from glm_jax.serve.app import Server

    path = model / "experts" / LAYER
    good = path.read_bytes()
    eng = glm_jax.Engine.load(str(model), cache_cap=2, prefetch=False)
    srv = Server(eng, max_queue=4)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    try:
        with serving.running(srv):
            assert httpx.post(srv.base + "/v1/completions", json=body, timeout=120).status_code == 200
            _cold(eng)
            _truncate(path)
            eng.store.source.entry(3).verified[:] = False
            r = httpx.post(srv.base + "/v1/completions", json=body, timeout=120)
            assert r.status_code >= 400 and "truncated" in r.json()["error"]["message"], r.text
            h = httpx.get(srv.base + "/health", timeout=30)
            assert h.status_code == 503 and h.json()["status"] == "degraded", h.text
            assert "truncated" in h.json()["store"]["last_error"]
            path.write_bytes(good)
            assert httpx.post(srv.base + "/v1/completions", json=body, timeout=120).status_code == 200
            h = httpx.get(srv.base + "/health", timeout=30)
            assert h.status_code == 200 and h.json()["status"] == "ok", h.text
    finally:
        eng.close()
        path.write_bytes(good)


@pytest.mark.parametrize("fetch", ["fused", "loop"])
def test_cli_store_error_is_one_line_in_every_fetch_mode(tmp_path, fetch):
    """glm-jax --fetch=fused printed a 74-line traceback (JaxRuntimeError: INTERNAL: CpuCallback error ...) and
    exited 1; --fetch=loop one line and exit 2.  Both: one line, exit 2."""
    import subprocess
    import sys

    d = tmp_path / "model"
    shutil.copytree(MODEL, d)
    _corrupt(d / "experts" / LAYER)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "glm_jax.cli", f"--model={d}", "--cache_cap=2", f"--fetch={fetch}",
                        "--max_new_tokens=8", "--state_dir=off"], capture_output=True, text=True, timeout=300,
                       env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and lines[-1].startswith("glm-jax: error:") and "checksum" in lines[-1], \
        r.stderr[-3000:]


def test_fused_decode_callback_error_is_the_store_error(model):
    """A read failing inside the fused decode program (the store called from XLA's host callback, not the
    prefill's loop): the request's error is the store's one-line GlmJaxError, and the next request works."""
    import inspect

    eng = glm_jax.Engine.load(str(model), cache_cap=2, fetch="fused", prefetch=False)
    src = eng.store.source
    real = src.read_jobs
    hits = {"n": 0}

    def read_jobs(layer, e, dests, chunk=0):
        if any(f.function == "_fused_host" for f in inspect.stack(0)):
            hits["n"] += 1

            def boom():
                raise CT.TruncatedError(f"{LAYER}: layer {layer} expert {e}: file truncated (simulated)")
            return [boom], lambda: None
        return real(layer, e, dests, chunk)
    try:
        want = eng.generate(PROMPT, max_new_tokens=24, temperature=0).tokens
        _cold(eng)
        src.read_jobs = read_jobs
        with pytest.raises(GlmJaxError) as e:
            eng.generate(PROMPT, max_new_tokens=24, temperature=0)
        assert hits["n"] and "simulated" in str(e.value) and "\n" not in str(e.value), str(e.value)[:2000]
        src.read_jobs = real
        assert eng.generate(PROMPT, max_new_tokens=24, temperature=0).tokens == want
    finally:
        eng.close()

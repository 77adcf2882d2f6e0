"""--verify_reads=first|always|off: records changed on disk after their first read were used silently (checksums
were checked once per record per process, and README said the engine refuses a bad checksum); `always` refuses them
at every read, `first` (the default) checks each record once, `off` never."""

import os
import shutil

import pytest

import glm_jax
from glm_jax import options as O
from glm_jax.errors import GlmJaxError

MODEL = os.path.join(os.path.dirname(glm_jax.__file__), "default_model")
LAYER = "layer_002.bin"
PROMPT = "ROMEO: But soft, what light"


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(MODEL, d)
    return d


def _gen(eng):
    return eng.generate(PROMPT, max_new_tokens=6, temperature=0).tokens


def _corrupt(path):
    b = bytearray(path.read_bytes())
    for i in range(0, len(b), 512):
        b[i] ^= 0x5A
    with open(path, "r+b") as f:            # in place: the open file's pages change under the engine
        f.write(bytes(b))


def _changed_after_first_read(model, mode):
    eng = glm_jax.Engine.load(str(model), cache_cap=2, fetch="loop", prefetch=False, verify_reads=mode)
    try:
        _gen(eng)
        _corrupt(model / "experts" / LAYER)
        eng.store.drop_cache(page_cache=True)
        return _gen(eng)
    finally:
        eng.close()


def test_always_refuses_a_record_changed_after_its_first_read(model):
    with pytest.raises(GlmJaxError) as e:
        _changed_after_first_read(model, "always")
    assert "checksum mismatch" in str(e.value) and LAYER in str(e.value) and "\n" not in str(e.value)


def test_first_checks_each_record_once(model):
    assert _changed_after_first_read(model, "first")          # the documented cost of the default: used as read


def test_off_never_checks(model):
    _corrupt(model / "experts" / LAYER)
    eng = glm_jax.Engine.load(str(model), cache_cap=2, fetch="loop", prefetch=False, verify_reads="off")
    try:
        assert _gen(eng)
    finally:
        eng.close()
    eng = glm_jax.Engine.load(str(model), cache_cap=2, fetch="loop", prefetch=False)
    try:
        with pytest.raises(GlmJaxError, match="checksum mismatch"):
            _gen(eng)
    finally:
        eng.close()


def test_flag_range():
    with pytest.raises(O.OptionError, match="verify_reads"):
        O.resolve({"verify_reads": "sometimes"})
    assert O.resolve({})["verify_reads"] == "first"

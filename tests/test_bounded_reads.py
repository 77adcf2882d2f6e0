"""Every file the project reads whole is bounded (fileio.read_bounded / read_json): config.json, generation_config,
tokenizer.json, tokenizer_config.json, manifest.json, a sharded index linked to /dev/zero were read until the process
was OOM-killed, a FIFO config.json hung, a 100,000-digit integer in config.json was a ValueError traceback (engine and
converter).  Now each is one error line naming the file, at once."""

import json
import os
import shutil
import threading

import pytest

import glm_jax
from glm_jax import fileio
from glm_jax.errors import GlmJaxError

MODEL = os.path.join(os.path.dirname(glm_jax.__file__), "default_model")
HF = os.path.join(os.path.dirname(__file__), "golden", "glm4moe_plain")


def _within(seconds, fn, *a):
    """fn(*a) in a thread; fails the test if it has not returned in ``seconds`` (a FIFO read used to hang)."""
    out = {}

    def run():
        try:
            out["v"] = fn(*a)
        except BaseException as e:      # noqa: BLE001  (handed to the test)
            out["e"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} still running after {seconds} s"
    if "e" in out:
        raise out["e"]
    return out["v"]


def test_read_bounded_refuses_what_is_not_a_bounded_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(fileio.FileProblem, match="a FIFO"):
        _within(10, fileio.read_bounded, str(fifo), 1000)
    with pytest.raises(fileio.FileProblem, match="character device"):
        fileio.read_bounded("/dev/zero", 1000)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 1001)
    with pytest.raises(fileio.FileProblem, match="1001 bytes"):
        fileio.read_bounded(str(big), 1000)
    assert fileio.read_bounded(str(big), 1001) == b"x" * 1001
    huge = tmp_path / "huge.json"
    huge.write_text('{"n": ' + "9" * 100_000 + "}")
    with pytest.raises(fileio.FileProblem, match="invalid JSON"):
        fileio.read_json(str(huge))


def _model_copy(tmp_path, src=MODEL):
    d = tmp_path / "m"
    d.mkdir()
    for n in os.listdir(src):
        p = os.path.join(src, n)
        if os.path.isdir(p) or n.endswith(".safetensors") or n.endswith(".npz"):
            os.symlink(p, d / n)
        else:
            shutil.copyfile(p, d / n)
    return d


def _one_line(e):
    msg = str(e)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                  "manifest.json"])
@pytest.mark.parametrize("kind", ["dev_zero", "fifo"])
def test_engine_refuses_an_unbounded_model_file(tmp_path, name, kind):
    d = _model_copy(tmp_path)
    os.remove(d / name)
    if kind == "dev_zero":
        os.symlink("/dev/zero", d / name)
    else:
        os.mkfifo(d / name)
    with pytest.raises(GlmJaxError) as e:
        _within(60, glm_jax.Engine.load, str(d))
    msg = _one_line(e.value)
    assert name in msg and ("character device" in msg or "FIFO" in msg), msg


def _huge_int_config(d):
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(c)[:-1] + ', "num_hidden_layers_x": ' + "7" * 100_000 + "}")


def test_engine_huge_integer_in_config_is_one_line(tmp_path):
    d = _model_copy(tmp_path)
    _huge_int_config(d)
    with pytest.raises(GlmJaxError) as e:
        glm_jax.Engine.load(str(d))
    assert "config.json" in _one_line(e.value) and "invalid JSON" in str(e.value)


@pytest.mark.parametrize("case", ["huge_int", "dev_zero_config", "fifo_config", "dev_zero_index"])
def test_converter_refuses_unbounded_or_huge_source_files(tmp_path, capsys, case):
    from glm_jax.experts.convert import cli_main

    d = _model_copy(tmp_path, HF)
    if case == "huge_int":
        _huge_int_config(d)
    elif case == "dev_zero_config":
        os.remove(d / "config.json")
        os.symlink("/dev/zero", d / "config.json")
    elif case == "fifo_config":
        os.remove(d / "config.json")
        os.mkfifo(d / "config.json")
    else:
        os.symlink("/dev/zero", d / "model.safetensors.index.json")
    rc = _within(120, cli_main, ["glm-jax-convert", f"--src={d}", f"--dst={tmp_path / 'out'}", "--noprogress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error" in lines[0], err
    assert ("config.json" in err) if "config" in case or case == "huge_int" else ("index.json" in err), err

"""Fuzz: random bytes and random JSON edits to config.json, manifest.json, the safetensors
index and safetensors headers of a container and of a sharded HF checkpoint.  Every case ends in a one-line
GlmJaxError-family error or a correct run (finite logits of the right shape); never another exception, a traceback,
a hang (each case runs under an alarm) or NaN.

Seeded, so a failure names its case and replays.  Loading is cheap; a forward compiles, so only the first cases of
each kind (container, HF dir) that load run one (the rest of the successful loads are closed unrun).  The model has
hidden_size 96 and the container is int4_g64: its forward is also the end-to-end run of shorter last int4 groups
(tests/test_quant_groups.py checks the numbers)."""

import json
import os
import random
import shutil
import signal
import struct

import numpy as np
import pytest

import glm_jax
from glm_jax.errors import GlmJaxError

CASES = int(os.environ.get("GLM_JAX_FUZZ_CASES", "120"))
SEED = int(os.environ.get("GLM_JAX_FUZZ_SEED", "15"))
FORWARDS = int(os.environ.get("GLM_JAX_FUZZ_FORWARDS", "1"))   # successful loads that also run a forward (each compiles)

VALUES = [None, True, False, 0, -1, 1, 2, 3, 7, 64, 10 ** 12, -(10 ** 12), 0.5, -0.5, 1e308, float("nan"),
          float("inf"), "", "x", "int4_g64", "int3", "crc32:00000000", "crc32:zz", "../x", "/etc/passwd",
          "experts/layer_001.bin", "dense.safetensors", [], [1, 2], ["dense"], {}, {"a": 1}]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    from glm_jax.experts.convert import convert
    from tools.fixtures.synth_model import tiny_config, write_hf_checkpoint
    root = tmp_path_factory.mktemp("fuzz")
    cfg = tiny_config(num_hidden_layers=2, num_nextn_predict_layers=0, hidden_size=96, moe_intermediate_size=80)
    hf = str(root / "hf")
    write_hf_checkpoint(hf, cfg, seed=11, shards=2)
    cont = str(root / "c")
    convert(hf, cont, expert_format="int4_g64", dense_format="f32", progress=False)
    return root, hf, cont


def _paths(obj, prefix=()):
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):          # long lists (the manifest's records): a few entries suffice
            out += _paths(v, prefix + (i,))
    return out


def _edit_json(obj, rng: random.Random):
    """One random edit: set a value, delete a key / list item, add a key, or drop to an empty container."""
    paths = [p for p in _paths(obj) if p]
    if not paths:
        return rng.choice(VALUES)
    p = rng.choice(paths)
    parent = obj
    for k in p[:-1]:
        parent = parent[k]
    op = rng.random()
    cur = parent[p[-1]]
    if op < 0.2 and isinstance(cur, (int, float)) and not isinstance(cur, bool):
        parent[p[-1]] = rng.choice([cur + 1, cur - 1, cur * 2, -cur, cur / 2])     # a plausible wrong number
    elif op < 0.6:
        parent[p[-1]] = rng.choice(VALUES)
    elif op < 0.85:
        del parent[p[-1]]
    elif isinstance(parent, dict):
        parent[rng.choice(["extra", "layers", "dense", "weight_map", "shape"])] = rng.choice(VALUES)
    else:
        parent[p[-1]] = type(parent[p[-1]])() if isinstance(parent[p[-1]], (dict, list)) else None
    return obj


def _edit_bytes(b: bytes, rng: random.Random) -> bytes:
    b = bytearray(b)
    op = rng.random()
    if op < 0.4 and b:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op < 0.7:
        b = b[:rng.randrange(len(b) + 1)]
    elif op < 0.85:
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        b = bytes(rng.randrange(256) for _ in range(rng.randint(0, 256)))
    return bytes(b)


def _mutate_json_file(path, rng):
    raw = open(path, "rb").read()
    if rng.random() < 0.75:
        obj = json.loads(raw)
        for _ in range(rng.randint(1, 3)):
            obj = _edit_json(obj, rng)
        open(path, "w").write(json.dumps(obj))
    else:
        open(path, "wb").write(_edit_bytes(raw, rng))


def _mutate_safetensors_header(path, rng):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    if rng.random() < 0.7:
        hdr = json.loads(data[8:8 + n])
        keys = [k for k in hdr if k != "__metadata__"]
        k = rng.choice(keys)
        field = rng.choice(["dtype", "shape", "data_offsets", None])
        if field is None:
            hdr = _edit_json(hdr, rng)
        elif field == "dtype":
            hdr[k]["dtype"] = rng.choice(["F32", "BF16", "F16", "I8", "U8", "F8_E4M3", "F64", "Q4", 3])
        elif field == "shape":
            hdr[k]["shape"] = rng.choice([[], [1], [0, 4], [-1, 2], [10 ** 9, 10 ** 9], list(hdr[k]["shape"])[::-1],
                                          "x"])
        else:
            s, e = hdr[k]["data_offsets"]
            hdr[k]["data_offsets"] = rng.choice([[e, s], [s, e + 4], [s + 4, e + 4], [0, 10 ** 15], [s], None])
        hb = json.dumps(hdr).encode()
        data = struct.pack("<Q", len(hb)) + hb + data[8 + n:]
    else:
        head = _edit_bytes(data[:8 + n], rng)
        data = head + data[8 + n:]
    open(path, "wb").write(data)


TARGETS = [  # (name, weight, directory key, file, mutator)
    ("container config.json", 3, "c", "config.json", _mutate_json_file),
    ("manifest.json", 5, "c", "manifest.json", _mutate_json_file),
    ("dense.safetensors header", 1, "c", "dense.safetensors", _mutate_safetensors_header),
    ("HF config.json", 3, "hf", "config.json", _mutate_json_file),
    ("HF index", 3, "hf", "model.safetensors.index.json", _mutate_json_file),
    ("HF shard header", 4, "hf", "model-00001-of-00002.safetensors", _mutate_safetensors_header),
    ("HF shard header 2", 2, "hf", "model-00002-of-00002.safetensors", _mutate_safetensors_header),
]


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def test_fuzzed_files_give_one_line_errors_or_correct_runs(pristine, tmp_path):
    root, hf, cont = pristine
    rng = random.Random(SEED)
    weights = [t[1] for t in TARGETS]
    outcomes = {"error": 0, "ran": 0, "ran_c": 0, "loaded": 0}
    forwards = {"c": 0, "hf": 0}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(CASES):
            name, _, which, fname, mutate = rng.choices(TARGETS, weights)[0]
            d = str(tmp_path / f"case{case}")
            shutil.copytree(cont if which == "c" else hf, d)
            mutate(os.path.join(d, fname), rng)
            what = f"case {case} ({name}, GLM_JAX_FUZZ_SEED={SEED})"
            eng = None
            signal.alarm(60)
            try:
                eng = glm_jax.Engine.load(d, cache_cap=2)
                if forwards[which] < FORWARDS:
                    forwards[which] += 1
                    logits = eng.logits([3, 17, 5, 99])
                    assert logits.shape == (4, eng.cfg.vocab_size), what
                    assert np.isfinite(logits).all(), what
                    outcomes["ran"] += 1
                    outcomes["ran_c"] += which == "c"
                else:
                    outcomes["loaded"] += 1
            except GlmJaxError as e:
                msg = str(e)
                assert msg and "\n" not in msg and "Traceback" not in msg, f"{what}: multi-line error: {msg!r}"
                outcomes["error"] += 1
            except _Hang:
                pytest.fail(f"{what}: no answer within 60 s")
            except Exception as e:             # anything else would be a traceback for the user
                raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
            finally:
                signal.alarm(0)
                if eng is not None:
                    eng.close()
                shutil.rmtree(d, ignore_errors=True)
    finally:
        signal.signal(signal.SIGALRM, old)
    print(outcomes)
    assert outcomes["error"] > CASES // 2 and outcomes["ran"] >= 1        # the fuzz reaches both outcomes
    assert outcomes["ran_c"] >= 1                                         # and a container (int4_g64, rows of 96) ran

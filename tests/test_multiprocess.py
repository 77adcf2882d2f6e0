"""Two glm-jax processes on localhost (jax.distributed, gloo collectives; tests/mp_worker.py) give the logits and
greedy tokens of one process, each loading and streaming only its own expert shard; process 0 decodes the text."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import glm_jax

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden", "glm4moe_full")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp")
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)                       # one CPU device per process
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mp_worker.py"), str(i), str(port),
                               str(d / f"p{i}.json")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((d / f"p{i}.json").read_text()) for i in range(2)]


def test_two_processes_give_the_logits_and_tokens_of_one(two):
    exp = dict(np.load(os.path.join(GOLDEN, "expected.npz")))
    one = glm_jax.Engine.load(GOLDEN, dtype="float32")
    ref_lg = one.logits(exp["input_ids"][0].tolist())
    ref = one.generate(exp["greedy_prompt"].tolist(), max_new_tokens=8, stop_on_eos=False)
    for backing in ("resident", "store"):
        for i, r in enumerate(two):
            got = r[backing]
            assert got["mesh"] == "expert:2,model:1" and got["processes"] == 2
            assert np.abs(np.asarray(got["logits"], np.float32) - ref_lg).max() <= 1e-5, (backing, i)
            assert got["tokens"] == ref.tokens, (backing, i)
        assert two[0][backing]["text"] == ref.text and two[1][backing]["text"] == ""   # process 0 prints


def test_each_process_holds_and_streams_only_its_shard(two):
    res = [r["resident"] for r in two]
    for r in res:               # the resident experts: half of every layer's bank on each process
        assert r["addressable_expert_bytes"] * 2 == r["global_expert_bytes"]
    own = [r["store"]["own_experts"] for r in two]
    assert own == [[0, 1, 2, 3], [4, 5, 6, 7]]      # what each process's store holds after the run
    one = glm_jax.Engine.load(GOLDEN, dtype="float32", fetch="loop", cache_cap=8)
    exp = dict(np.load(os.path.join(GOLDEN, "expected.npz")))
    one.logits(exp["input_ids"][0].tolist())
    read = one.store.stats()["bytes_read"]
    one.generate(exp["greedy_prompt"].tolist(), max_new_tokens=8, stop_on_eos=False)
    # cap = every expert: each expert is read once, by the one process whose shard holds it
    b = [r["store"]["bytes_read"] for r in two]
    assert min(b) > 0 and sum(b) == read + one.store.stats()["bytes_read"]

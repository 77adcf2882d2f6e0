"""Run by tests/test_multiprocess.py: one process of a 2-process glm-jax run on localhost (jax.distributed, CPU
collectives through gloo, one CPU device each: the mesh is expert:2, one expert shard per process).

    python tests/mp_worker.py PROCESS_ID PORT OUT.json

Resident experts (each process reads only its half of every layer's experts from the checkpoint) and a store
streaming with fetch=loop (each process's store reads only its own experts).  Every process writes what it saw."""

import json
import os
import sys

import numpy as np

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "glm4moe_full")


def main(pid, port, out):
    import glm_jax

    common = dict(dtype="float32", coordinator=f"localhost:{port}", num_processes=2, process_id=pid)
    exp = dict(np.load(os.path.join(GOLDEN, "expected.npz")))
    ids, prompt = exp["input_ids"][0].tolist(), exp["greedy_prompt"].tolist()
    res = {}
    for backing, kw in (("resident", {}), ("store", dict(fetch="loop", cache_cap=8))):
        eng = glm_jax.Engine.load(GOLDEN, **common, **kw)
        lg = eng.logits(ids)
        read = eng.store.stats()["bytes_read"] if eng.store is not None else 0      # generate resets the counters
        gen = eng.generate(prompt, max_new_tokens=8, stop_on_eos=False)
        res[backing] = dict(logits=lg.tolist(), tokens=gen.tokens, text=gen.text, mesh=gen.stats.get("mesh"),
                            processes=gen.stats.get("processes"),
                            bytes_read=read + (eng.store.stats()["bytes_read"] if eng.store is not None else 0))
        if eng.store is not None:
            res[backing]["own_experts"] = sorted(int(e) for e in np.nonzero(eng.store.resident_mask(1))[0])
        else:
            bank = eng.params["layers"][1]["experts"]
            res[backing]["addressable_expert_bytes"] = sum(s.data.nbytes for s in bank.gate_up.addressable_shards)
            res[backing]["global_expert_bytes"] = int(bank.gate_up.nbytes)
        eng.close()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

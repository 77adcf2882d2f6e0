"""Run by tests/test_mesh.py in its own process with 8 simulated CPU devices (XLA_FLAGS set by the caller, before
jax is imported): every mesh shape against one device, for both model types, resident and store-backed; writes one
JSON file of measurements that the tests assert on.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_worker.py OUT.json WORKDIR

Per (model, backing, mesh): the max |logit difference| to the one-device engine on the fixture's first sequence;
greedy tokens, checked teacher-forced for every shape (the mesh engine's argmax at each position of the one-device
engine's greedy continuation must be that continuation: what greedy decoding picks, through the same forward) and
by a real ``generate`` (KV-cache decode on the mesh) for the 4x2 shape; the experts' bytes on each device, from the
arrays' shardings."""

import json
import os
import sys

import numpy as np

SHAPES = ["expert:2,model:1", "expert:4,model:2", "expert:8,model:1", "expert:1,model:8"]
ONE = "expert:1,model:1"
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
MODELS = {"glm4_moe": "glm4moe_full", "glm_moe_dsa": "dsa_sparse"}
N_GREEDY = 6          # prompt + 6 tokens fit the 16-position bucket: the logits check's compiled forward is reused
GENERATE_ON = ("expert:4,model:2",)


def main(out_path, work):
    import jax

    import glm_jax
    from glm_jax.experts.convert import convert
    from glm_jax.runtime import mesh as MESH

    assert len(jax.devices()) == 8, jax.devices()
    results = []
    one_device = {}          # (model type, kernels) -> the resident one-device engine's logits on the first sequence
    for mtype, name in MODELS.items():
        src = os.path.join(GOLDEN, name)
        exp = dict(np.load(os.path.join(src, "expected.npz")))
        ids = exp["input_ids"][0].tolist()
        prompt = exp["greedy_prompt"].tolist()
        cont = os.path.join(work, name + "-int4")
        convert(src, cont, expert_format="int4_g64", mtp_format="int8_row", dense_format="f32", progress=False)
        E = glm_jax.load_config(src).n_routed_experts
        for backing, path, kw in (("resident", src, {}), ("store", cont, {"fetch": "loop", "cache_cap": E})):
            def load(mesh, kernels):
                return glm_jax.Engine.load(path, dtype="float32", kv_cache_dtype="float32", mesh=mesh,
                                           kernels=kernels, **kw)

            refs = {}
            for mesh in SHAPES:
                # model:1 keeps the native kernels everywhere; a tensor-parallel mesh runs the dense weights on the
                # XLA path (mesh.py), so its one-device reference runs the same kernels
                kernels = "native" if "model:1" in mesh else "xla"
                if kernels not in refs:
                    ref = load(ONE, kernels)
                    assert ref.plan is None
                    gen = list(prompt)           # greedy by full forwards (the one compiled 16-position program)
                    for _ in range(N_GREEDY):
                        gen.append(int(ref.logits(gen)[-1].argmax()))
                    refs[kernels] = (ref, ref.logits(ids), gen[len(prompt):])
                    if backing == "resident":
                        one_device[mtype, kernels] = refs[kernels][1]
                ref, ref_lg, ref_gen = refs[kernels]
                eng = load(mesh, kernels)
                lg = eng.logits(ids)
                seq = prompt + ref_gen
                tf = eng.logits(seq)[len(prompt) - 1:len(seq) - 1].argmax(-1).tolist()
                row = dict(model=mtype, backing=backing, mesh=mesh, kernels=kernels, fetch=eng.opts["fetch"],
                           comm="psum", logits_diff=float(np.abs(lg - ref_lg).max()), ref_tokens=ref_gen,
                           teacher_forced=tf)
                if mesh in GENERATE_ON:
                    row["generated"] = eng.generate(prompt, max_new_tokens=N_GREEDY, stop_on_eos=False).tokens
                if backing == "resident":
                    banks = [lp["experts"] for lp in eng.params["layers"] if "experts" in lp]
                    ref_banks = [lp["experts"] for lp in ref.params["layers"] if "experts" in lp]
                else:
                    banks = [b for b, _ in eng.store.resident_view().values()] if eng.store.all_resident() else \
                        [eng.store.peek(L)[0] for L in eng.cfg.moe_layers]
                    ref_banks = [ref.store.peek(L)[0] for L in ref.cfg.moe_layers]
                per_dev = MESH.device_bytes(banks)
                row["expert_bytes_per_device"] = sorted(per_dev.values())
                row["expert_bytes_one_device"] = sum(MESH.device_bytes(ref_banks).values())
                row["expert_axis"] = eng.plan.expert
                results.append(row)
                eng.close()
            for ref, _, _ in refs.values():
                ref.close()
    # the other communication scheme (model/moe.py: all_to_all), against the same one-device references (the
    # resident native-kernel engine above: its logits, kept)
    for mtype, mesh in (("glm4_moe", "expert:8,model:1"),):
        src = os.path.join(GOLDEN, MODELS[mtype])
        exp = dict(np.load(os.path.join(src, "expected.npz")))
        ids = exp["input_ids"][0].tolist()
        eng = glm_jax.Engine.load(src, dtype="float32", kv_cache_dtype="float32", mesh=mesh, kernels="native",
                                  expert_comm="all_to_all")
        assert eng.plan.comm == "all_to_all"
        ref_lg = one_device[mtype, "native"]
        results.append(dict(model=mtype, backing="resident", mesh=mesh, kernels="native", fetch=eng.opts["fetch"],
                            comm="all_to_all", logits_diff=float(np.abs(eng.logits(ids) - ref_lg).max())))
        eng.close()
    errors = {}
    for name, kw in (("callback", dict(mesh="expert:2", fetch="callback")),
                     ("too_many", dict(mesh="expert:4,model:4")),
                     ("pin", dict(mesh="expert:2", fetch="loop", pin="auto"))):
        try:
            glm_jax.Engine.load(os.path.join(GOLDEN, "glm4moe_full"), **kw)
            errors[name] = None
        except glm_jax.GlmJaxError as e:
            errors[name] = str(e)
    with open(out_path, "w") as f:
        json.dump({"rows": results, "errors": errors}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

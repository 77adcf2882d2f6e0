"""Expert- and tensor-parallel meshes (glm_jax/runtime/mesh.py, model/moe.py, experts/store.ShardedStore) against one device.

One subprocess with 8 simulated CPU devices (XLA_FLAGS set before jax is imported there; tests/mesh_worker.py) runs
every mesh shape in {2x1, 4x2, 8x1, 1x8} (expert x model) next to the one-device engine, for glm4_moe and
glm_moe_dsa, with resident experts and store-backed (a converted int4 container streamed with fetch=loop, each
expert shard's store reading only its own experts).  The worker also sets --xla_backend_optimization_level=0: a
test-only setting that halves its compile time (both sides of every comparison run under it).  Here: the
sharding rules and the NNX model's round trip, cheaply, on this process's one device."""

import json
import os
import subprocess
import sys

import pytest

import glm_jax

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "golden")


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("mesh")
    out = work / "out.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    r = subprocess.run([sys.executable, os.path.join(HERE, "mesh_worker.py"), str(out), str(work)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def _rows(run):
    return [r for r in run["rows"] if r["comm"] == "psum"]


def test_every_mesh_shape_gives_the_one_device_logits_and_greedy_tokens(mesh_run):
    rows = _rows(mesh_run)
    seen = {(r["model"], r["backing"], r["mesh"]) for r in rows}
    assert len(seen) == 16                        # 2 model types x {resident, store} x 4 mesh shapes
    for r in rows:
        what = f"{r['model']} {r['backing']} {r['mesh']} ({r['kernels']} kernels)"
        assert r["logits_diff"] <= 1e-5, what + f": max |dlogit| {r['logits_diff']:.3g}"
        assert r["teacher_forced"] == r["ref_tokens"], what
        if r["backing"] == "store":
            assert r["fetch"] == "loop", what     # streamed, not preloaded
        if "generated" in r:                      # KV-cache decode on the mesh (4x2)
            assert r["generated"] == r["ref_tokens"], what


def test_all_to_all_gives_the_one_device_logits(mesh_run):
    rows = [r for r in mesh_run["rows"] if r["comm"] == "all_to_all"]
    assert rows and all(r["logits_diff"] <= 1e-5 for r in rows), rows


def test_generation_ran_on_the_tensor_parallel_mesh(mesh_run):
    gen = [(r["model"], r["backing"]) for r in _rows(mesh_run) if "generated" in r]
    assert sorted(gen) == sorted((m, b) for m in ("glm4_moe", "glm_moe_dsa") for b in ("resident", "store"))


def test_expert_memory_per_device_falls_as_one_over_n(mesh_run):
    for r in _rows(mesh_run):
        n = r["expert_axis"]
        per = r["expert_bytes_per_device"]
        sizes = dict(kv.split(":") for kv in r["mesh"].split(","))
        assert len(per) == int(sizes["expert"]) * int(sizes["model"])
        # E = 8 experts divide every expert axis here: each device holds exactly 1/n of every layer's experts
        assert set(per) == {r["expert_bytes_one_device"] // n}, (r["mesh"], r["backing"], per)


def test_what_a_mesh_does_not_run_is_one_line_naming_the_option(mesh_run):
    err = mesh_run["errors"]
    assert err["callback"].startswith("fetch=callback: runs on one device")
    assert err["too_many"] == "mesh=expert:4,model:4: needs 16 devices (there are 8 devices)"
    assert err["pin"].startswith("pin=auto: pinned experts are not supported on a mesh")
    assert all("\n" not in e for e in err.values())


# ----------------------------------------------------------------------------- on this process's one device
def test_one_device_mesh_flags():
    from glm_jax import options as O

    with pytest.raises(O.OptionError, match=r"option 'mesh': invalid value expert:0: expected axis:size pairs"):
        O.resolve({"mesh": "expert:0"})
    with pytest.raises(O.OptionError, match=r"axis model given twice"):
        O.resolve({"mesh": "model:1,model:2"})
    with pytest.raises(glm_jax.GlmJaxError,
                       match=r"^mesh=expert:2: needs a device count divisible by 2 \(there is 1 device\)$"):
        glm_jax.Engine.load(os.path.join(GOLDEN, "glm4moe_plain"), mesh="expert:2")
    with pytest.raises(glm_jax.GlmJaxError, match=r"^num_processes=2: needs --coordinator=HOST:PORT"):
        glm_jax.Engine.load(os.path.join(GOLDEN, "glm4moe_plain"), num_processes=2)
    eng = glm_jax.Engine.load(os.path.join(GOLDEN, "glm4moe_plain"), mesh="expert:1")
    assert eng.plan is None                       # a one-device mesh is the single-device engine


def test_sharding_rules():
    """The rules on a 4x2 (and 1x8) mesh: experts over expert, heads / MLP columns over model where the count
    divides, the rest replicated."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from glm_jax.runtime.mesh import CACHE_AXES, MeshPlan

    def plan(e, m, heads=4, kv=2):
        return MeshPlan(AbstractMesh((e, m), ("expert", "model")), "psum", (("heads", heads), ("kv_heads", kv)))

    p = plan(4, 2)
    assert p.spec(("heads", "embed"), (128, 64)) == P("model")                # q rows: 4 heads over 2
    assert p.spec(("embed", "heads"), (64, 128)) == P(None, "model")          # o columns
    assert p.spec(("kv_heads", "embed"), (64, 64)) == P("model")
    assert p.spec(("mlp", "embed"), (128, 64)) == P("model")
    assert p.spec(("expert", None, None), (8, 64, 64)) == P("expert")
    assert p.spec(("router", "embed"), (8, 64)) == P()                        # router replicated
    assert p.spec(("vocab", "embed"), (320, 64)) == P()
    assert p.spec(CACHE_AXES["k"], (1, 64, 2, 32)) == P(None, None, "model")  # KV cache by heads
    assert p.spec(CACHE_AXES["ckv"], (1, 64, 16)) == P()                      # MLA latent: shared by all heads
    q = plan(1, 8)
    assert q.spec(("heads", "embed"), (128, 64)) == P()                       # 4 heads do not split 8 ways
    assert q.spec(CACHE_AXES["k"], (1, 64, 2, 32)) == P()
    assert q.spec(("mlp", "embed"), (128, 64)) == P("model")
    assert plan(3, 1).spec(("expert", None), (8, 4)) == P()                   # 8 slots do not split 3 ways


@pytest.mark.parametrize("name", ["glm4moe_full", "dsa_sparse"])
def test_nnx_model_holds_every_parameter_with_its_axes(name):
    """GlmModel(params).params() is the same pytree (the same arrays); every Param carries logical axes; a
    parameter the modules do not declare is an error."""
    import jax
    from flax import nnx

    from glm_jax.model.modules import GlmModel, Split

    eng = glm_jax.Engine.load(os.path.join(GOLDEN, name))
    model = GlmModel(eng.params)
    a, b = jax.tree.flatten(eng.params), jax.tree.flatten(model.params())
    assert a[1] == b[1] and all(x is y for x, y in zip(a[0], b[0]))
    variables = jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert len(variables) == len(a[0])
    for v in variables:                        # one logical axis per dimension
        assert len(v.get_metadata()["out_sharding"]) == v[...].ndim
    lp = model.layers[1]
    assert lp.experts.gate_up.get_metadata()["out_sharding"][0] == "expert"
    if name.startswith("dsa"):
        w = lp.attn.q_b_w                      # a packed QWeight (a Linear node) for the native kernels
        assert (w.q if hasattr(w, "q") else w).get_metadata()["out_sharding"] == ("heads", "lora")
    elif "qkv" in lp.attn.keys_:               # fused for the native kernels: not split (mesh.py loads it unfused)
        assert lp.attn.qkv.q.get_metadata()["out_sharding"] == ("qkv", "embed")
    else:
        assert lp.attn.q_w.get_metadata()["out_sharding"] == ("heads", "embed")
    sp = Split.of(model)
    assert jax.tree.flatten(sp.params())[1] == a[1]
    bad = dict(eng.params, extra_w=eng.params["norm"])
    with pytest.raises(ValueError, match="no logical axes for parameter 'extra_w'"):
        GlmModel(bad)

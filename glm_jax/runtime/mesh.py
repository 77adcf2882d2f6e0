"""Device meshes (runtime layer): ``--mesh`` parsing, THE SHARDING RULES, placement on the mesh, multi-process start.

A mesh has two axes: ``expert`` (routed experts: each device row holds E/n of every MoE layer's experts, and the MoE
seam runs in shard_map, glm_jax/model/moe.py) and ``model`` (tensor parallelism: attention heads and the dense /
shared-expert MLPs split over it; XLA's SPMD partitioner inserts the collectives).  Default: every device on
``expert``.  A one-device mesh is no mesh: the engine runs its single-device code unchanged.

The rules (logical axis -> mesh axis) are ``RULES``; the logical axes of every parameter are declared by the NNX
modules (glm_jax/model/modules.py, each class's ``AXES``) and of the KV cache by ``CACHE_AXES`` here.  A dimension is
sharded only when its size (for "heads" / "kv_heads": the head count) divides by the mesh axis; otherwise it is
replicated (e.g. 2 KV heads on model:8).  What the rules do not name is replicated: embeddings, norms, the router
(f32), the MLA low-rank projections and latent KV cache (shared by all heads), the DSA indexer.

Dense weights on a model axis > 1 run the XLA path (``--kernels`` applies to the experts only there): the native
dense kernels are custom calls the partitioner cannot split, and the fused q/k/v and gate/up matrices are loaded
unfused so each device's rows are whole heads / whole intermediate columns.  On ``model:1`` everything dense is
replicated and the native kernels run unchanged on every device.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..errors import GlmJaxError
from ..kernels.formats import ExpertBank, bank_from_float
from ..model.moe import COMMS, EXPERT, MODEL

# THE SHARDING RULES: logical axis (nnx_model.py AXES, CACHE_AXES below) -> mesh axis.  Everything else: replicated.
RULES = {
    "expert": EXPERT,          # routed expert slots of every MoE layer (and their slot maps)
    "heads": MODEL,            # attention query heads (q / q_b / kv_b rows, o columns)
    "kv_heads": MODEL,         # GQA key/value heads (k / v rows, the KV cache's head axis)
    "mlp": MODEL,              # dense MLP and shared-expert intermediate (gate / up rows, down columns)
}

# KV cache entries: name -> logical axes of [B, S, ...]
CACHE_AXES = {"k": ("batch", "seq", "kv_heads", "head_dim"), "v": ("batch", "seq", "kv_heads", "head_dim"),
              "ckv": ("batch", "seq", "lora"), "kpe": ("batch", "seq", "rope"), "idx_k": ("batch", "seq", "index_dim")}


class MeshError(GlmJaxError):
    pass


def mesh_shape(text: str, n_devices: int, label: str = "--mesh") -> tuple[int, int]:
    """(expert, model) sizes of a --mesh value over ``n_devices`` devices: an axis not named takes the devices
    left (default: every device on expert)."""
    sizes = {}
    for part in filter(None, text.split(",")):
        k, v = part.split(":")
        sizes[k.strip()] = int(v)
    e, m = sizes.get("expert"), sizes.get("model")
    there = f"there {'is' if n_devices == 1 else 'are'} {n_devices} device{'s' if n_devices != 1 else ''}"
    if e is None and m is None:
        e, m = n_devices, 1
    elif e is None or m is None:
        given = e or m
        if n_devices % given:
            raise MeshError(f"{label}={text}: needs a device count divisible by {given} ({there})")
        e, m = (e, n_devices // e) if m is None else (n_devices // m, m)
    if e * m > n_devices:
        raise MeshError(f"{label}={text}: needs {e * m} devices ({there})")
    if jax.process_count() > 1 and e * m != n_devices:
        raise MeshError(f"{label}={text}: with {jax.process_count()} processes the mesh must use all {n_devices} "
                        f"devices (got {e} x {m})")
    return e, m


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A mesh and how the model maps onto it."""
    mesh: Mesh
    comm: str = "psum"                  # how tokens reach their experts (parallel.py)
    counts: tuple = ()                  # (("heads", n), ("kv_heads", n)): divisibility of head axes

    @property
    def expert(self) -> int:
        return self.mesh.shape[EXPERT]

    @property
    def model(self) -> int:
        return self.mesh.shape[MODEL]

    @property
    def size(self) -> int:
        return self.expert * self.model

    def describe(self) -> str:
        return f"expert:{self.expert},model:{self.model}"

    # -------------------------------------------------------------- the rules
    def spec(self, axes, shape) -> P:
        """PartitionSpec of an array with these logical axes (RULES, a dimension sharded only where it divides)."""
        counts = dict(self.counts)
        out, used = [], set()
        for ax, dim in zip(axes, shape):
            mx = RULES.get(ax)
            size = self.mesh.shape[mx] if mx else 1
            n = counts.get(ax, dim)
            if mx is None or size == 1 or mx in used or n % size or dim % size:
                out.append(None)
            else:
                out.append(mx)
                used.add(mx)
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def sharding(self, axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    def put(self, value, axes):
        """``value`` (numpy or a jax array) placed with its logical axes; multi-process safe (each process builds
        only its addressable shards)."""
        if value is None:
            return None
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding) and \
                value.sharding.mesh == self.mesh:
            return value                                   # already on this mesh (expert banks, slot maps)
        sh = self.sharding(axes, value.shape)
        host = np.asarray(value)       # sliced on the host: no per-shape slicing program compiled on a device
        if jax.process_count() == 1:
            return jax.device_put(host, sh)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    # -------------------------------------------------------------- expert shards
    def expert_rows(self) -> list[tuple[int, list]]:
        """[(d, addressable devices of expert row d)] for the expert rows this process holds."""
        out = []
        for d in range(self.expert):
            devs = [dev for dev in self.mesh.devices[d] if dev.process_index == jax.process_index()]
            if devs:
                out.append((d, devs))
        return out

    def experts_per_shard(self, E: int) -> int:
        return -(-E // self.expert)

    def owned(self, E: int, d: int) -> list:
        per = self.experts_per_shard(E)
        return list(range(d * per, min(E, (d + 1) * per)))

    def assemble(self, per_device: dict, shape: tuple, axes) -> jax.Array:
        """A global array from {device: single-device array} (this process's devices of the mesh)."""
        sh = self.sharding(axes, shape)
        arrs = [per_device[dev] for dev in sh.addressable_devices_indices_map(shape)]
        return jax.make_array_from_single_device_arrays(shape, sh, arrs)

    def slot_map(self, rows: dict, E: int) -> jax.Array:
        """The mesh bank's slot map [n, E] from {d: int32 [E]} (this process's expert rows)."""
        per_dev = {}
        for d, devs in self.expert_rows():
            for dev in devs:
                per_dev[dev] = jax.device_put(np.asarray(rows[d], np.int32)[None], dev)
        return self.assemble(per_dev, (self.expert, E), ("expert", None))

    def bank_from_devices(self, per_device: dict, template):
        """A mesh ExpertBank from {device: single-device ExpertBank} (this process's devices; every shard the same
        slot count): no copy, each device's arrays become its shard."""
        S = template.num_slots
        fields = {}
        for f in ("gate_up", "down", "gate_up_scale", "down_scale"):
            if getattr(template, f) is None:
                fields[f] = None
                continue
            a0 = getattr(template, f)
            shape = (self.expert * S,) + tuple(a0.shape[1:])
            fields[f] = self.assemble({dev: getattr(b, f) for dev, b in per_device.items()}, shape,
                                      ("expert",) + (None,) * (len(shape) - 1))
        return ExpertBank(**fields, fmt=template.fmt, kernel=template.kernel, layout=template.layout,
                          hidden=template.hidden, inter=template.inter, mesh=self.mesh, comm=self.comm)

    def resident_bank(self, E: int, load, fmt: str, kernel: str):
        """A layer's routed experts read shard by shard (this process's shards only): ``load(ids) -> (gate_up
        [n, 2I, H], down [n, H, I])`` float numpy.  Returns (mesh bank, slot map).  A shard short of
        experts_per_shard (E not divisible) is padded with zero experts no slot map points at."""
        per = self.experts_per_shard(E)
        local, rows = {}, {}
        for d, devs in self.expert_rows():
            ids = self.owned(E, d)
            gu, dn = load(ids)
            if len(ids) < per:
                gu = np.concatenate([gu, np.zeros((per - len(ids),) + gu.shape[1:], gu.dtype)])
                dn = np.concatenate([dn, np.zeros((per - len(ids),) + dn.shape[1:], dn.dtype)])
            b = bank_from_float(gu, dn, fmt, kernel)
            for dev in devs:
                local[dev] = jax.device_put(b, dev)
            row = np.full(E, -1, np.int32)
            row[ids] = np.arange(len(ids), dtype=np.int32)
            rows[d] = row
        return self.bank_from_devices(local, next(iter(local.values()))), self.slot_map(rows, E)

    # -------------------------------------------------------------- state, cache
    def place_model(self, model):
        """Put every Param of an NNX model on the mesh by its logical axes (in place)."""
        from flax import nnx

        def put(v):
            return v.replace(self.put(v[...], v.get_metadata().get("out_sharding") or ()))

        state = jax.tree.map(put, nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
        nnx.update(model, state)
        return model

    def place_cache(self, cache: list) -> list:
        return [{k: self.put(v, CACHE_AXES.get(k, ())) for k, v in c.items()} for c in cache]


def plan_for(opts, cfg, label: str = "--mesh") -> Optional[MeshPlan]:
    """The engine's mesh (None: one device, the single-device engine).  ``opts``: the resolved options."""
    devices = jax.devices()
    e, m = mesh_shape(opts["mesh"], len(devices), label)
    if e * m == 1:
        return None
    mesh = Mesh(np.array(devices[:e * m]).reshape(e, m), (EXPERT, MODEL))
    comm = opts["expert_comm"]
    if comm == "auto":
        comm = DEFAULT_COMM
    heads = cfg.num_attention_heads
    return MeshPlan(mesh, comm, (("heads", heads), ("kv_heads", cfg.num_key_value_heads)))


DEFAULT_COMM = "psum"      # measured faster at decode and prefill (tools/bench/mesh.py --mode=comm, README)
assert DEFAULT_COMM in COMMS


# ----------------------------------------------------------------------------- accounting
def device_bytes(tree) -> dict:
    """{device: bytes of the tree's arrays held on it} (each addressable shard counted on its device)."""
    out: dict = {}
    for a in jax.tree.leaves(tree):
        if not isinstance(a, jax.Array):
            continue
        for s in a.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


# ----------------------------------------------------------------------------- multi-process
def init_distributed(coordinator: str, num_processes: int, process_id: int, labels: dict):
    """``jax.distributed.initialize`` (before any backend is used): CPU collectives through gloo.  A no-op for one
    process; a second call with the same settings is a no-op too."""
    if num_processes <= 1 and not coordinator:
        return
    lc, ln, lp = (labels.get(k, f"--{k}") for k in ("coordinator", "num_processes", "process_id"))
    if num_processes < 2:
        raise MeshError(f"{lc}={coordinator}: needs {ln} >= 2 (got {num_processes})")
    if not coordinator:
        raise MeshError(f"{ln}={num_processes}: needs {lc}=HOST:PORT (process 0's address)")
    if not re.fullmatch(r"[^:\s]+:\d+", coordinator):
        raise MeshError(f"{lc}={coordinator}: expected HOST:PORT")
    if not 0 <= process_id < num_processes:
        raise MeshError(f"{lp}={process_id}: expected an integer in [0, {num_processes - 1}]")
    from jax._src import distributed as D

    if D.global_state.client is not None:
        if (D.global_state.num_processes, D.global_state.process_id) != (num_processes, process_id):
            raise MeshError(f"{lp}={process_id}: this process already joined a cluster as process "
                            f"{D.global_state.process_id} of {D.global_state.num_processes}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    except Exception as e:       # noqa: BLE001  (connection refused, timeout: one line naming the flag)
        raise MeshError(f"{lc}={coordinator}: cannot join the cluster as process {process_id} of "
                        f"{num_processes} ({' '.join(str(e).split())[:300]})") from None


def broadcast_ids(make) -> list:
    """Token ids made by process 0 (``make()``), received by every process (two broadcasts: length, then ids)."""
    from jax.experimental import multihost_utils as mh

    ids = np.asarray(make() if jax.process_index() == 0 else [], np.int32)
    n = int(mh.broadcast_one_to_all(np.int32(len(ids))))
    buf = np.zeros(n, np.int32)
    buf[:len(ids)] = ids[:n]
    return [int(t) for t in np.asarray(mh.broadcast_one_to_all(buf))]


def is_primary() -> bool:
    """Process 0 (the one that tokenizes and prints); True without jax.distributed."""
    return jax.process_index() == 0

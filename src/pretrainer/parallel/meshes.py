"""Every device mesh and process group of a run, made here and nowhere else, from its `ParallelDims`.

One world mesh, `model`: every other mesh is a slice, flattening or unflattening of it (the expert mesh splits its dp in
two). An engine over the world's process group gets a `Meshes` for its dimensions and takes what it uses; each mesh is
built on first use (every rank asks in the same order, as engines build alike on every rank) and kept, so no group is
made twice or made and dropped; `release` drops them all before the process group is destroyed. Rank order is Megatron's
(tp innermost, then cp, pp, dp): a replica's ranks are consecutive; every engine groups equal dimensions alike.

    model        (dp, pp, cp, tp)                      tensor, pipeline and context parallelism
    data         dp x cp flattened (or dp)             the ranks holding the same parameters
    data_sharding  (replicate, shard) over them        hybrid sharded data parallelism (fsdp_shard_size)
    experts      (expert_replicas, ep, pp, cp, tp)     expert parallelism: ep consecutive dp ranks split experts
    context      the model mesh's cp group             context parallelism's all-gathers
    pipeline_ends  the first and last pp rank of a pipeline  an embedding both ends hold (multi-token prediction)
    host         a gloo group over every rank          host-side flags beside an accelerator's backend
    checkpoint   a gloo group over every rank          the background checkpoint writer's own collectives
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import ParallelDims

MODEL_DIMS = ("dp", "pp", "cp", "tp")
EXPERT_DIMS = ("expert_replicas", "ep", "pp", "cp", "tp")


class Meshes:
    def __init__(self, dims: ParallelDims, device_type: str):
        self.dims, self.device_type = dims, device_type
        self._built: dict[str, object] = {}

    def _once(self, name: str, build):
        if name not in self._built:
            self._built[name] = build()
        return self._built[name]

    def model(self) -> DeviceMesh:
        d = self.dims
        return self._once("model", lambda: init_device_mesh(self.device_type, (d.dp, d.pp, d.cp, d.tp),
                                                            mesh_dim_names=MODEL_DIMS))

    def data(self) -> DeviceMesh:
        """The ranks holding the same parameters (gradients and token counts are summed over them): dp x cp."""
        return self._once("data", lambda: self.model()["dp", "cp"]._flatten("dp_cp") if self.dims.cp > 1
                          else self.model()["dp"])

    def data_sharding(self) -> DeviceMesh:
        """The data mesh as FSDP shards over it: 1-D, or (replicate, shard) for hybrid sharding of the ranks holding
        the same parameters (groups of `shard` consecutive dp x cp ranks, replicated across)."""
        d = self.dims
        if d.shard == d.gradient_ranks:
            return self.data()
        return self._once("data_sharding", lambda: self.model()["dp", "cp"]._flatten("dp_cp")._unflatten(
            0, (d.gradient_ranks // d.shard, d.shard), ("replicate", "shard")))

    def experts(self) -> DeviceMesh:
        """dp = (dp / ep) x ep: an ep group is ep consecutive dp replicas at the same (pp, cp, tp) place, so
        every rank keeps its place of the model mesh."""
        d = self.dims
        return self._once("experts", lambda: self.model()._unflatten(0, (d.dp // d.ep, d.ep), EXPERT_DIMS[:2]))

    def context(self):
        """This rank's context-parallel group: the cp consecutive ranks splitting its sequences."""
        return self.model().get_group("cp")

    def context_rank(self) -> int:
        return self.model().get_local_rank("cp")

    def pipeline_ends(self):
        """The group of this rank's pipeline's first and last stage ranks (the same dp, cp and tp place), or None
        on a rank in between. Every rank makes every pair's group, in the same order."""
        def build():
            model = self.model()
            pp = model.mesh_dim_names.index("pp")
            pipelines = model.mesh.movedim(pp, -1).reshape(-1, self.dims.pp).tolist()
            groups = [(ranks, dist.new_group([ranks[0], ranks[-1]])) for ranks in pipelines]
            return next((group for ranks, group in groups if dist.get_rank() in (ranks[0], ranks[-1])), None)

        return self._once("pipeline_ends", build)

    def host(self):
        """A group for host (CPU) tensors: the world's own under gloo, a gloo group beside another backend."""
        return self._once("host", lambda: dist.group.WORLD if dist.get_backend() == "gloo"
                          else dist.new_group(backend="gloo"))

    def checkpoint(self):
        """The background checkpoint writer's gloo group: its collectives never interleave with the loop's."""
        return self._once("checkpoint", lambda: dist.new_group(backend="gloo"))

    def release(self) -> None:
        """Drop every mesh and group, so that destroying the process group frees them."""
        self._built.clear()

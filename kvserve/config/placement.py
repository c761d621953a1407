"""Where a replica's ranks run on a Ray cluster: one placement group per replica (seed 004's
parallelism across machines), bundle r holding rank r -- bundle 0 the replica's server and rank 0
(its engine), bundles 1..N-1 its tensor-parallel or pipeline-stage workers.

The launcher (fleet/launcher.py `RayReplicas`) creates the group and names it in the replica's
environment; the replica's executor (distributed/executor.py) places worker r in bundle r. PACK
keeps a replica's ranks on as few nodes as fit (tensor parallelism's all-reduces); SPREAD and
STRICT_SPREAD put them on different nodes (pipeline stages over a slow link), as Ray defines them.
"""
from __future__ import annotations

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

# set in a replica's environment by the launcher, read by its executor
GROUP_ENV = "KVSERVE_RAY_PLACEMENT_GROUP"        # the group's name
NAMESPACE_ENV = "KVSERVE_RAY_NAMESPACE"          # the Ray namespace it is named in
RANK_CPUS_ENV = "KVSERVE_RAY_RANK_CPUS"          # the CPUs of each bundle, which its rank takes

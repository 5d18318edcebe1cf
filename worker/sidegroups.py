"""The exchanges a rank joins beside its stage's gradient all-reduce, at the coordinator's
rendezvous: tied parameters' gradients among a group's stages, and BatchNorm statistics
across the groups."""

from __future__ import annotations

import torch

from pipefb.errors import ConfigError
from pipefb.runtime.allreduce import GroupAllReduce, stats_rendezvous_key, tie_rendezvous_key
from pipefb.runtime.stage import StageRuntime
from protos import worker_pb2


def join_tie_group(request: worker_pb2.AssignRequest, runtime: StageRuntime
                   ) -> GroupAllReduce | None:
    """An owner of a tied parameter's use joins its group's exchange of tied gradients
    with the other stages that own a use ([Note: tied parameters] in
    pipefb.runtime.tied); None where it owns none, or one stage owns them all. Every
    member joins it after its stage's group and the norm exchange."""
    member = runtime.tie_membership()
    if member is None:
        return None
    if not request.rendezvous:
        raise ConfigError("tied parameters on several stages need a rendezvous address")
    index, size = member
    key = tie_rendezvous_key(request.job.job_id, request.attempt, runtime.place.group)
    own_host = request.peers[request.rank].rpartition(":")[0]
    # gloo on the host whatever the device: NCCL refuses two ranks on one GPU, and the
    # workers of a one-GPU machine share it ([Note: tied parameters])
    reducer = GroupAllReduce(request.rendezvous, key, index, size, torch.device("cpu"),
                             bind_host=own_host)
    runtime.set_tie_reducer(reducer)
    return reducer


def join_stats_group(request: worker_pb2.AssignRequest, runtime: StageRuntime
                     ) -> GroupAllReduce | None:
    """A rank that runs the forward of a BatchNorm layer whose statistics the groups
    replay joins the exchange of its forward stage, one rank per group ([Note: group
    statistics] in pipefb.runtime.groupstats); None where it runs none. Every member
    joins it last, after the tied gradients' exchange."""
    stage = runtime.place.fwd_stage
    if not runtime.stats.holds_any or stage is None:
        return None
    if not request.rendezvous:
        raise ConfigError("BatchNorm statistics across groups need a rendezvous address")
    key = stats_rendezvous_key(request.job.job_id, request.attempt, stage)
    own_host = request.peers[request.rank].rpartition(":")[0]
    reducer = GroupAllReduce(request.rendezvous, key, runtime.place.group,
                             runtime.plan.groups, torch.device("cpu"), bind_host=own_host)
    runtime.stats.reducer = reducer
    return reducer

"""Per-call figures from a reducer's public counters (:class:`mpi_gradreducer.ReducerStats`, ``buckets``)."""

from __future__ import annotations

from typing import Any

from .. import DistributedGradReducer

__all__ = ["launches", "reducer_stats"]


def reducer_stats(r: DistributedGradReducer) -> dict[str, Any]:
    """Time in packing, MPI and unpacking, bytes and messages, each per call."""
    s = r.stats
    calls = max(1, s.calls)
    return {"pack_ms": s.pack_seconds / calls * 1e3, "allreduce_ms": s.allreduce_seconds / calls * 1e3,
            "unpack_ms": s.unpack_seconds / calls * 1e3, "wire_bytes": s.bytes // calls,
            "messages_per_call": s.messages / calls}


def launches(r: DistributedGradReducer) -> dict[str, Any]:
    """Kernel launches of the reducer's device packs and unpacks, per call and per bucket per call.

    From ``r.stats.launches`` (all launches so far), ``r.stats.calls`` and
    ``len(r.buckets)``: a bucket whose members are packed costs 2 launches
    per call (one pack, one unpack); one reduced where it lies costs none.
    """
    calls = max(1, r.stats.calls)
    buckets = len(r.buckets)
    return {
        "calls": r.stats.calls,
        "buckets": buckets,
        "launches": r.stats.launches,
        "launches_per_call": r.stats.launches / calls,
        "launches_per_bucket_per_call": r.stats.launches / calls / max(1, buckets),
    }

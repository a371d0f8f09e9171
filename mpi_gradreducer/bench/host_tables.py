"""The host benchmark's tables: what rank 0 prints for each workload."""

from __future__ import annotations

from typing import Any

from . import powersgd
from .network import format_lines as network_lines
from .output import bytes_label, noise_or, size_label

__all__ = ["format_workload"]


def _method_line(method: str, m: dict[str, Any], res: dict[str, Any]) -> str:
    ratio = f"{m['ratio_to_limit']:.2f}" if "ratio_to_limit" in m else "-"
    notes = []
    if method == "limit":
        notes.append(f"chunk {m['chunk']}")
    if method in res["messages"]:
        notes.append(f"{res['messages'][method]} messages")
    return (f"  {method:<20}{m['median_ms']:>11.2f}{m['min_ms']:>10.2f}{ratio:>9}{m['algbw_GBps']:>12.3f}"
            f"{m['busbw_GBps']:>12.3f}  {', '.join(notes)}")


def _derived_lines(name: str, res: dict[str, Any]) -> list[str]:
    lines = []
    if "torch_over_reducer" in res:
        lines.append(f"  reducer-torch / reducer = {res['torch_over_reducer']:.2f} "
                     f"(torch CPU tensors against numpy arrays, same memory)")
    if "shard_over_reducer" in res:
        lines.append(f"  reducer-shard / reducer = {res['shard_over_reducer']:.2f} "
                     f"(reduce_scatter + allgather against the Allreduce of the same plan)")
    if "deterministic_over_reducer" in res:
        lines.append(f"  reducer-deterministic / reducer = {res['deterministic_over_reducer']:.2f} "
                     f"(every element summed in rank order)")
    if name == "small" and "reducer_over_one_allreduce" in res:
        lines.append(f"  reducer / one Allreduce of all {res['bytes']} bytes = {res['reducer_over_one_allreduce']:.2f}")
    if "reducer_over_floor" in res:
        lines.append(f"  reducer / packed-floor = {res['reducer_over_floor']:.2f} "
                     "(against the least a reducer that packs must do)")
    if "fresh_over_reducer" in res:
        lines.append(f"  reducer-fresh / reducer = {res['fresh_over_reducer']:.2f} "
                     "(the first call after the arrays change, against the same arrays again)")
    if name == "small" and "always_over_never" in res:
        lines.append(f"  validate=\"always\" / validate=\"never\" = {res['always_over_never']:.2f}")
    if "validation_cost_percent" in res:
        lines.append(f"  validation cost: {noise_or(res['validation_cost_percent'], '.1f', '%')} of reducer "
                     f"(median of the paired differences with reducer-novalidate); from its local part, the "
                     f"overlap check, {res['validation_local_ms']:.2f} ms = {res['validation_estimate_percent']:.2f}% "
                     "(the verdict rides in the first message)")
    return lines


def format_workload(name: str, res: dict[str, Any]) -> str:
    """The table of one workload's results (what rank 0 prints)."""
    lines = [
        f"{name}: {res['tensors']} tensors, {bytes_label(res['bytes'])} ({'/'.join(res['dtypes'])}), "
        f"{res['ranks']} ranks — {res['note']}",
        f"  {'method':<20}{'median ms':>11}{'min ms':>10}{'x limit':>9}{'algbw GB/s':>12}{'busbw GB/s':>12}  notes",
    ]
    lines.extend(_method_line(method, m, res) for method, m in res["methods"].items())
    lines.extend(f"  {method:<20}skipped: {why}" for method, why in res.get("skipped", {}).items())
    if "limit_by_chunk" in res:
        chunks = ", ".join(f"{size_label(v['chunk_bytes'])} {v['median_ms']:.2f}"
                           for v in res["limit_by_chunk"].values())
        lines.append(f"  limit by chunk (ms): {chunks}")
    lines.extend(_derived_lines(name, res))
    if "powersgd_rank" in res:
        lines.extend(powersgd.format_lines(res))
    if "network" in res:
        lines.extend(network_lines(res["network"]))
    return "\n".join(lines)

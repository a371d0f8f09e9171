"""Backward compute and reduction in one training step: sequential, and overlapped with ``begin``/``ready``/``wait``.

``--overlap LAYERS WIDTH BATCH`` runs it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import DistributedGradReducer
from .timing import Case, time_cases

__all__ = ["bench_overlap", "format_overlap"]


def bench_overlap(comm: MPI.Intracomm, layers: int, width: int, batch: int, reps: int,
                   warmup: int) -> dict[str, Any]:
    """A training step = backward compute + reduction, sequential and overlapped, interleaved.

    The "model" is ``layers`` float32 weight matrices of ``width`` x ``width``;
    the backward of layer ``i`` computes ``X.T @ (X @ W[i])`` into its gradient
    (two matmuls of a ``batch`` x ``width`` activation), last layer first.
    ``sequential`` runs backward, then ``reducer(grads)``; ``overlapped-MODE``
    runs ``reducer.begin(grads)``, declares each layer's gradient ready as soon
    as it is written, and ends with ``step.wait()``, with the reducer's
    ``progress`` set to MODE (``auto`` chooses one of the others).
    """
    rng = np.random.default_rng(comm.Get_rank())
    weights = [rng.standard_normal((width, width)).astype(np.float32) / width for _ in range(layers)]
    x = rng.standard_normal((batch, width)).astype(np.float32)
    hidden = np.empty((batch, width), np.float32)
    modes = ("thread", "deferred") if MPI.Query_thread() >= MPI.THREAD_MULTIPLE else ("deferred",)
    reducers = {mode: DistributedGradReducer(weights, group=comm, progress=mode) for mode in modes}
    grads = {mode: r.allocate_grads() for mode, r in reducers.items()}
    auto = DistributedGradReducer(weights, group=comm).progress
    plain = reducers["deferred"]

    def backward(g: Sequence[np.ndarray], ready: Callable[[int], None] | None = None) -> None:
        for i in reversed(range(layers)):
            np.matmul(x, weights[i], out=hidden)
            np.matmul(x.T, hidden, out=g[i])
            if ready is not None:
                ready(i)

    def overlapped(mode: str) -> Callable[[], None]:
        def run() -> None:
            step = reducers[mode].begin(grads[mode])
            backward(grads[mode], step.ready)
            step.wait()
        return run

    def sequential() -> None:
        backward(grads["deferred"])
        plain(grads["deferred"])

    nothing = lambda: None  # noqa: E731 (the gradients are rewritten by each run)
    cases = [Case("compute", nothing, lambda: backward(grads["deferred"])),
             Case("reduce", nothing, lambda: plain(grads["deferred"])),
             Case("sequential", nothing, sequential)]
    cases += [Case(f"overlapped-{mode}", nothing, overlapped(mode)) for mode in modes]
    try:
        times = time_cases(comm, cases, reps, warmup)
    finally:
        for r in reducers.values():
            r.free()
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "layers": layers, "width": width, "batch": batch, "bytes": sum(g.nbytes for g in grads["deferred"]),
        "auto": auto, "median_s": med, "times_s": times,
        "over_sequential": {m: med[f"overlapped-{m}"] / med["sequential"] for m in modes},
        "ideal_over_sequential": max(med["compute"], med["reduce"]) / med["sequential"],
    }


def format_overlap(res: dict[str, Any]) -> str:
    """The table of :func:`bench_overlap`'s results."""
    med = res["median_s"]
    lines = [f"overlap: {res['layers']} layers of {res['width']}x{res['width']} float32 "
             f"({res['bytes'] / 1e6:.1f} MB of gradients), batch {res['batch']}; progress='auto' here "
             f"means {res['auto']!r}"]
    for name in med:
        ratio = f"  {med[name] / med['sequential']:.2f} x sequential" if name.startswith("overlapped") else ""
        lines.append(f"  {name:<20} {med[name] * 1e3:9.2f} ms{ratio}")
    lines.append(f"  ideal max(compute, reduce) / sequential = {res['ideal_over_sequential']:.2f}")
    return "\n".join(lines)



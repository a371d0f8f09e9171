"""The PowerSGD methods of the host benchmark, torch DDP's ``powerSGD_hook`` as the peer, the break-even link.

``reducer-powersgd``
    :class:`DistributedGradReducer` with ``compression=PowerSGD(rank=R,
    start_iter=0)`` (``--powersgd-rank R``, default 4): every timed call is
    compressed; its time includes the low-rank products, the
    orthonormalisation and the error feedback.
``torch-powersgd``
    Where torch with gloo imports on every rank: torch DDP's own
    ``powerSGD_hook`` (``torch.distributed.algorithms.ddp_comm_hooks``) with
    the same rank, ``min_compression_rate=2``, error feedback and warm start,
    called as DDP calls it, once per DDP bucket (reverse parameter order,
    1 MiB then 25 MiB), on gradients that are views of the buckets (DDP's
    ``gradient_as_bucket_view``: no copy in or out), one bucket after the
    other. Its first two calls (torch's start iteration; uncompressed)
    are made before timing. It is given random gradients and its results
    are checked to be finite only: the constant gradients that the other
    methods are checked with (a rank-1 sum, which PowerSGD gives back
    exactly) make P's later columns dependent, and torch's single
    Gram-Schmidt pass, in float16 for float16 gradients, then returned twice
    the mean and NaN (``mixed``, 4 ranks; float32: within 2e-5).

Both run in the same interleaved repetitions as ``reducer``. From the
measured parts a link is *modelled*: a call over a link of ``B`` bytes per
second is taken to cost its measured compute (the reducer's own counters,
``stats.pack_seconds + stats.unpack_seconds`` per call: for PowerSGD every
product, the orthonormalisation and the error; for the uncompressed reducer
its copies, its scaling being done inside the MPI time) plus ``2 (N - 1) / N
* wire bytes / B`` (a bandwidth-optimal Allreduce on ``N`` ranks,
``--powersgd-model-ranks``, default the ranks of the run; latency is not
modelled). The break-even bandwidth is the ``B`` at which the uncompressed
and the compressed call cost the same: below it, PowerSGD is faster.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import DistributedGradReducer, PowerSGD
from .timing import Case, all_close, expected_sum, fill_value, filler

__all__ = ["POWERSGD_METHODS", "TorchPowerSGD", "add_cases", "format_lines", "model", "plot_links"]

#: The methods this module adds to the host benchmark.
POWERSGD_METHODS = ("reducer-powersgd", "torch-powersgd")
#: Link bandwidths of the modelled curves, bytes per second (0.1 to 100 Gbit/s).
LINKS = tuple(float(b) for b in np.logspace(np.log10(0.1e9 / 8), np.log10(100e9 / 8), 61))


def add_cases(comm: MPI.Intracomm, grads: list[np.ndarray], methods: Sequence[str], rank: int, gloo: Any,
              cases: list[Case], reducers: dict[str, DistributedGradReducer], skipped: dict[str, str],
              peers: dict[str, Any]) -> None:
    """The requested PowerSGD cases of one workload (collective: reducers and torch state are built here)."""
    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    # Every rank fills constant values: the sum is a rank-1 matrix, which PowerSGD gives back exactly
    # (to rounding), so the results can be checked against the mean as the other methods' are.
    if "reducer-powersgd" in methods:
        r = reducers["reducer-powersgd"] = DistributedGradReducer(
            grads, group=comm, compression=PowerSGD(rank=rank, start_iter=0))
        cases.append(Case("reducer-powersgd", filler(grads, value), lambda: r(grads), lambda: all_close(grads, mean)))
    if "torch-powersgd" in methods:
        if gloo is None:
            skipped["torch-powersgd"] = "torch with gloo is not importable on every rank"
            return
        peer = peers["torch-powersgd"] = TorchPowerSGD(gloo, [(g.shape, g.dtype) for g in grads], rank)
        views = peer.grads
        # Random values: on constant (rank-1) float16 gradients torch's hook does not give the mean back
        # (one Gram-Schmidt pass on dependent columns, in float16), so its results are only checked finite.
        rng = np.random.default_rng(comm.Get_rank())
        sources = [rng.standard_normal(v.shape).astype(v.dtype) for v in views]

        def fill() -> None:
            for v, src in zip(views, sources, strict=True):
                np.copyto(v, src)

        for _ in range(2):  # torch compresses from its third call on (start_powerSGD_iter=2)
            fill()
            peer.run()
        cases.append(Case("torch-powersgd", fill, peer.run, lambda: all(bool(np.isfinite(v).all()) for v in views)))


class _Bucket:
    """What ``powerSGD_hook`` asks of DDP's ``GradBucket`` (torch gives it no Python constructor)."""

    def __init__(self, index: int, buffer: Any, gradients: list[Any], last: bool) -> None:
        self._index, self._buffer, self._gradients, self._last = index, buffer, gradients, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> Any:
        return self._buffer

    def gradients(self) -> list[Any]:
        return self._gradients

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, buffer: Any) -> None:
        self._buffer = buffer


class TorchPowerSGD:
    """torch DDP's ``powerSGD_hook`` over gloo on gradients like ``specs``, bucketed as DDP buckets them.

    Args:
        gloo: the benchmark's gloo group (:class:`~.torch_methods.Gloo`).
        specs: each gradient's shape and dtype.
        rank: PowerSGD's rank.
    """

    def __init__(self, gloo: Any, specs: Sequence[tuple[tuple[int, ...], np.dtype]], rank: int) -> None:
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hooks

        self._torch = torch
        self._hook = hooks.powerSGD_hook
        self.state = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                         start_powerSGD_iter=2, min_compression_rate=2, use_error_feedback=True,
                                         warm_start=True, random_seed=0,
                                         compression_stats_logging_frequency=1 << 40)
        shapes = [shape for shape, _ in specs]
        probes = [torch.from_numpy(np.zeros(0, dtype=dtype)).new_empty(shape) for shape, dtype in specs]
        grads: list[Any] = [None] * len(shapes)
        self._buckets = []
        order = gloo._buckets(probes)  # DDP's assignment: reverse order, 1 MiB then 25 MiB
        for k, members in enumerate(order):
            flat = torch.zeros(sum(probes[i].numel() for i in members), dtype=probes[members[0]].dtype)
            views, offset = [], 0
            for i in members:
                n = probes[i].numel()
                views.append(flat[offset : offset + n].view(shapes[i]))
                grads[i] = views[-1].numpy()
                offset += n
            self._buckets.append(_Bucket(k, flat, views, k == len(order) - 1))
        #: The gradients, as numpy views of the buckets' tensors (``gradient_as_bucket_view``).
        self.grads: list[np.ndarray] = grads
        self.calls = 0

    def run(self) -> None:
        """One step's reduction: each bucket's hook, waited for before the next.

        (Launching them all first lets the chained collectives of different buckets reach gloo in
        different orders on different ranks.)
        """
        for b in self._buckets:
            # a stand-in with the GradBucket methods the hook calls (torch gives GradBucket no constructor)
            out = self._hook(self.state, b).wait()  # type: ignore[arg-type]
            if out.data_ptr() != b.buffer().data_ptr():
                b.buffer().copy_(out)
        self.calls += 1

    def wire_bytes(self) -> int:
        """Bytes one compressed call hands to gloo (uncompressed tensors, P and Q), from torch's element counts.

        torch counts elements over all buckets; with several dtypes, they are taken at the largest item size.
        """
        _, _, after = self.state.compression_stats()
        compressed_calls = max(1, self.calls - 2)
        itemsize = max(b.buffer().element_size() for b in self._buckets)
        return int(after / compressed_calls * itemsize)


def model(res: dict[str, Any], ranks: int) -> dict[str, Any]:
    """The modelled link: per method, its measured compute and wire bytes; the break-even bandwidth.

    Args:
        res: one workload's results (``methods``, ``reducer_stats``).
        ranks: the number of ranks of the modelled Allreduce (its ``2 (N - 1) / N``).

    Returns:
        ``{"ranks": N, "parts": {method: {"outside_mpi_ms", "wire_bytes"}}, "break_even_Bps": float | None}``
        (None: no break-even; ``inf``: PowerSGD is faster at any bandwidth).
    """
    parts = {}
    for name in ("reducer", "reducer-powersgd"):
        if name in res["methods"] and name in res["reducer_stats"]:
            stats = res["reducer_stats"][name]
            parts[name] = {"outside_mpi_ms": stats["pack_ms"] + stats["unpack_ms"], "wire_bytes": stats["wire_bytes"]}
    out: dict[str, Any] = {"ranks": ranks, "parts": parts, "break_even_Bps": None}
    if len(parts) == 2:
        u, p = parts["reducer"], parts["reducer-powersgd"]
        saved = (u["wire_bytes"] - p["wire_bytes"]) * 2 * (ranks - 1) / ranks
        extra = (p["outside_mpi_ms"] - u["outside_mpi_ms"]) / 1e3
        if saved > 0:
            out["break_even_Bps"] = saved / extra if extra > 0 else float("inf")
    return out


def link_time_ms(part: dict[str, float], bandwidth: float, ranks: int) -> float:
    """The modelled time of one call over a link of ``bandwidth`` bytes per second."""
    return part["outside_mpi_ms"] + part["wire_bytes"] * 2 * (ranks - 1) / ranks / bandwidth * 1e3


def format_lines(res: dict[str, Any]) -> list[str]:
    """The PowerSGD lines of a workload's table."""
    lines = []
    methods, stats = res["methods"], res["reducer_stats"]
    if "reducer" in stats and "reducer-powersgd" in stats:
        u, p = stats["reducer"]["wire_bytes"], stats["reducer-powersgd"]["wire_bytes"]
        lines.append(f"  bytes per call (stats.bytes): reducer {u}, reducer-powersgd {p} "
                     f"(1/{u / max(p, 1):.0f}), rank {res['powersgd_rank']}")
    if "torch-powersgd" in res.get("powersgd_peer_bytes", {}):
        peer = res["powersgd_peer_bytes"]["torch-powersgd"]
        lines.append(f"  bytes per call, torch-powersgd (its own counts): {peer}")
    if "reducer-powersgd" in methods and "torch-powersgd" in methods:
        ratio = methods["reducer-powersgd"]["median_ms"] / methods["torch-powersgd"]["median_ms"]
        lines.append(f"  reducer-powersgd / torch-powersgd = {ratio:.2f} (same shapes, rank and ranks)")
    if "reducer-powersgd" in methods and "reducer" in methods:
        ratio = methods["reducer-powersgd"]["median_ms"] / methods["reducer"]["median_ms"]
        lines.append(f"  reducer-powersgd / reducer = {ratio:.2f} on this machine's shared memory")
    if "reducer-powersgd" in stats:
        s = stats["reducer-powersgd"]
        lines.append(f"  reducer-powersgd per call: {s['pack_ms']:.1f} ms computing before the Q sum, "
                     f"{s['allreduce_ms']:.1f} ms in MPI, {s['unpack_ms']:.1f} ms after (means)")
    link = res.get("powersgd_link")
    if link and link["break_even_Bps"] is not None:
        b = link["break_even_Bps"]
        text = "at any bandwidth" if b == float("inf") else f"below {b * 8 / 1e9:.2f} Gbit/s ({b / 1e9:.3f} GB/s)"
        lines.append(f"  modelled link, {link['ranks']} ranks: PowerSGD is faster {text} (measured compute + "
                     "2(N-1)/N bytes / bandwidth)")
    return lines


def plot_links(path: str, results: dict[str, Any]) -> None:
    """Step time against link bandwidth, modelled from the measured parts, one panel per workload."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    workloads = {name: res for name, res in results["workloads"].items()
                 if len(res.get("powersgd_link", {}).get("parts", {})) == 2}
    fig = Figure(figsize=(4.2 * max(1, len(workloads)), 4), dpi=110)
    FigureCanvasAgg(fig)
    gbit = [b * 8 / 1e9 for b in LINKS]
    for k, (name, res) in enumerate(workloads.items()):
        ax = fig.add_subplot(1, len(workloads), k + 1)
        link = res["powersgd_link"]
        ranks = link["ranks"]
        for method, style in (("reducer", "-"), ("reducer-powersgd", "--")):
            part = link["parts"][method]
            label = "uncompressed" if method == "reducer" else f"PowerSGD rank {res['powersgd_rank']}"
            ax.plot(gbit, [link_time_ms(part, b, ranks) for b in LINKS], style, label=label)
        b = link["break_even_Bps"]
        if b is not None and b != float("inf"):
            ax.axvline(b * 8 / 1e9, color="grey", linestyle=":", linewidth=1)
            ax.text(b * 8 / 1e9, 0.97, f" break-even {b * 8 / 1e9:.1f} Gbit/s", fontsize=7, va="top",
                    transform=ax.get_xaxis_transform(), color="dimgrey")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link bandwidth, Gbit/s (modelled)")
        ax.set_ylabel("reduction per step, ms")
        ax.set_title(f"{name}, {ranks} ranks (modelled from a {results['environment']['ranks']}-rank run)",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)

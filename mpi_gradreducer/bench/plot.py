"""The host benchmark's figures (need matplotlib): bus bandwidth against message size (``--plot``), and time
per call against link rate across hosts (``scripts/bench_hosts.py``)."""

from __future__ import annotations

import os
from typing import Any

from .output import size_label

__all__ = ["plot", "plot_rates"]


def plot(path: str, results: dict[str, Any]) -> None:
    """Bus bandwidth against message size: single Allreduces, and the limit's chunk sizes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    env = results["environment"]
    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    curve = results.get("allreduce_curve", [])
    if curve:
        ax.plot([r["bytes"] for r in curve], [r["busbw_GBps"] for r in curve], "o-", color="black",
                label="one Allreduce of that size")
    markers = "sD^v"
    for k, (name, res) in enumerate(results["workloads"].items()):
        if "limit_by_chunk" not in res:
            continue
        rows = sorted(res["limit_by_chunk"].values(), key=lambda v: v["chunk_bytes"] or res["bytes"])
        ax.plot([min(v["chunk_bytes"] or res["bytes"], res["bytes"]) for v in rows], [v["busbw_GBps"] for v in rows],
                markers[k % len(markers)] + "--", alpha=0.8, label=f"{name}: its whole gradient in chunks of that size")
    consts = env["constants"]
    for label, value, style in (("CHUNK_BYTES", consts["CHUNK_BYTES"], ":"),
                                ("DIRECT_BYTES", consts["DIRECT_BYTES"], "-."),
                                ("DEFAULT_BUCKET_BYTES", consts["DEFAULT_BUCKET_BYTES"], "--")):
        ax.axvline(value, color="grey", linestyle=style, linewidth=1)
        ax.text(value, 0.02, label + " ", rotation=90, va="bottom", ha="right", fontsize=7,
                transform=ax.get_xaxis_transform(), color="dimgrey")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: size_label(int(x)).replace(" ", "")))
    ax.set_xlabel("message (or chunk) size, bytes")
    ax.set_ylabel("bus bandwidth, GB/s (nccl-tests convention)")
    nolocal = env["environment_variables"].get("MPIR_CVAR_NOLOCAL")
    ax.set_title(f"MPI_Allreduce, {env['ranks']} ranks on {env['cpu_count']} cores"
                 f"{', MPIR_CVAR_NOLOCAL=' + nolocal if nolocal else ''}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path)


def plot_rates(path: str, summary: dict[str, Any]) -> None:
    """Time per call against link rate: one line per method, and the wire bound.

    Args:
        path: the PNG to write (its directory is made).
        summary: what ``scripts/bench_hosts.py`` collects: ``workload``,
            ``hosts``, ``ppn``, ``gradient_bytes`` and ``rates``, a list of
            ``{"link_rate_bps", "wire_bound_ms", "methods": {name: {"median_ms", ...}}}``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    rows = sorted(summary["rates"], key=lambda r: r["link_rate_bps"])
    gbit = [r["link_rate_bps"] / 1e9 for r in rows]
    methods: list[str] = []
    for r in rows:
        methods += [m for m in r["methods"] if m not in methods]
    markers = "osD^v<>p"
    for k, name in enumerate(methods):
        points = [(g, r["methods"][name]["median_ms"]) for g, r in zip(gbit, rows, strict=True) if name in r["methods"]]
        ax.plot([p[0] for p in points], [p[1] for p in points], markers[k % len(markers)] + "-", alpha=0.85,
                label=name)
    ax.plot(gbit, [r["wire_bound_ms"] for r in rows], "--", color="black", linewidth=1.5,
            label="wire bound: 2(H-1)/H x gradient bytes / rate")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(gbit)
    ax.set_xticklabels([f"{g:g}" for g in gbit])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("each host's link rate, Gbit/s (tc tbf)")
    ax.set_ylabel("time per call, ms (median)")
    ax.set_title(f"{summary['workload']} ({summary['gradient_bytes'] / 1e6:.1f} MB of gradients), "
                 f"{summary['hosts']} hosts x {summary['ppn']} ranks, MPI over TCP", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)

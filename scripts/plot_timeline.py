"""Draw a trace written by ``mpi_gradreducer._core.timeline.Timeline`` as a PNG.

One row per rank, one coloured bar per recorded phase; a phase nested in
another (e.g. one bucket's Allreduce inside "reduce") is drawn as a thinner
bar below its parent::

    python scripts/plot_timeline.py trace.json timeline.png
    python scripts/plot_timeline.py trace.json zoom.png --window 100 130   # milliseconds

Needs matplotlib (the ``examples`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

#: Phase colours, in order of first appearance (matplotlib's tab10, reordered).
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")


#: Events closer than this (microseconds) touch rather than overlap: times are rounded in the file.
_TOUCH_US = 0.01


def load(path: str) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The complete ("X") events of a trace file, and the process names by pid.

    Accepts both trace-event layouts: a bare list, or ``{"traceEvents": [...]}``.
    """
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X"], names


def depths(events: Sequence[dict[str, Any]]) -> list[int]:
    """How deeply each event is nested in earlier-starting events of its process."""
    order = sorted(range(len(events)), key=lambda i: (events[i]["pid"], events[i]["ts"], -events[i]["dur"]))
    out = [0] * len(events)
    open_ends: list[float] = []
    pid = None
    for i in order:
        e = events[i]
        if e["pid"] != pid:
            pid, open_ends = e["pid"], []
        while open_ends and open_ends[-1] <= e["ts"] + _TOUCH_US:
            open_ends.pop()
        out[i] = len(open_ends)
        open_ends.append(e["ts"] + e["dur"])
    return out


def draw(events: list[dict[str, Any]], names: dict[int, str], path: str,
         window: tuple[float, float] | None = None, title: str | None = None) -> None:
    """Render the events (times in microseconds) to ``path``.

    Args:
        events: complete events with ``pid``, ``name``, ``ts`` and ``dur``.
        names: row labels by pid.
        path: the PNG to write.
        window: (start, end) in milliseconds; default: the whole trace.
        title: the figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    level = depths(events)
    phases: dict[str, str] = {}  # colours by first appearance in the whole trace
    for e in sorted(events, key=lambda e: e["ts"]):
        phases.setdefault(e["name"], _COLORS[len(phases) % len(_COLORS)])
    if window is not None:
        lo, hi = window[0] * 1e3, window[1] * 1e3
        keep = [i for i, e in enumerate(events) if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        events, level = [events[i] for i in keep], [level[i] for i in keep]
    if not events:
        raise ValueError("no events to draw (in this window)")
    shown = {e["name"] for e in events}
    phases = {n: c for n, c in phases.items() if n in shown}
    pids = sorted({e["pid"] for e in events} | set(names))
    row = {pid: k for k, pid in enumerate(pids)}
    fig, ax = plt.subplots(figsize=(11, 0.6 + 0.55 * len(pids) + 0.6), constrained_layout=True)
    for (name, depth, pid), bars in _group(events, level).items():
        height = 0.7 * 0.6 ** depth
        top = row[pid] - 0.35 + (0.7 - height if depth else 0.0)  # nested bars hang at the bottom
        ax.broken_barh(bars, (top, height), facecolors=phases[name], edgecolor="none")
    ax.set_yticks(range(len(pids)), [names.get(pid, f"rank {pid}") for pid in pids])
    ax.set_ylim(len(pids) - 0.5, -0.5)
    if window is not None:
        ax.set_xlim(*window)
    ax.set_xlabel("time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=c, label=n) for n, c in phases.items()],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _group(events: Sequence[dict[str, Any]],
           level: Sequence[int]) -> dict[tuple[str, int, int], list[tuple[float, float]]]:
    """(start, duration) bars in milliseconds, by (phase, depth, pid)."""
    groups: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for e, depth in zip(events, level, strict=True):
        groups.setdefault((e["name"], depth, e["pid"]), []).append((e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-4)))
    return groups


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="trace-event JSON file")
    parser.add_argument("png", help="output image")
    parser.add_argument("--window", nargs=2, type=float, metavar=("START", "END"),
                        help="only this interval, in milliseconds from the start of the trace")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    events, names = load(args.trace)
    draw(events, names, args.png, tuple(args.window) if args.window else None, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())

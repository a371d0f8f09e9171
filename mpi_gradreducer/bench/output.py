"""What the benchmarks print and write: labels, figures that may be noise, the results file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

__all__ = ["KIB", "MIB", "bytes_label", "noise_or", "one_line", "rank0_printer", "size_label", "write_json"]

KIB = 1 << 10
MIB = 1 << 20


def one_line(text: str, limit: int = 240) -> str:
    """``text`` with its whitespace collapsed, cut to ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def size_label(nbytes: int) -> str:
    """``1048576`` as ``"1 MiB"``, ``16384`` as ``"16 KiB"``; 0 stands for a whole buffer: ``"whole"``."""
    if nbytes == 0:
        return "whole"
    if nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    if nbytes % KIB == 0:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


def bytes_label(nbytes: int) -> str:
    """Decimal bytes for a table header: ``"16.8 MB"``, or ``"38.4 KB"`` under 0.1 MB."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:.1f} KB"


def noise_or(value: float, spec: str, unit: str = "") -> str:
    """A measured cost, or ``"< noise"`` when it came out zero or negative.

    A cost measured as the difference of two noisy timings can come out
    negative; that says it is smaller than the noise, not that it is a gain.

    Args:
        value: the measured cost.
        spec: its format, e.g. ``".1f"``.
        unit: appended to a number, e.g. ``"%"``.
    """
    return f"{value:{spec}}{unit}" if value > 0 else "< noise"


def rank0_printer(rank: int) -> Callable[[str], None]:
    """A ``say(text)`` that prints (and flushes) on rank 0 only."""

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    return say


def write_json(path: str, results: dict[str, Any]) -> None:
    """Write ``results`` to ``path`` as indented JSON, creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)

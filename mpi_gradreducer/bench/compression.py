"""Compressed vs uncompressed Allreduce of one large float32 gradient.

Run under mpiexec, e.g.::

    mpiexec -n 4 python -m mpi_gradreducer.bench compression                      # shared memory
    mpiexec -n 4 -genv MPIR_CVAR_NOLOCAL 1 python -m mpi_gradreducer.bench compression
    mpiexec -n 4 -genv MPIR_CVAR_NOLOCAL 1 -genv UCX_TLS tcp python -m mpi_gradreducer.bench compression

Every rank holds ``--elements`` random normal float32 values (ResNet-50 has
about 25.6 M parameters). Each repetition runs every mode once, in a rotating
order (:func:`~mpi_gradreducer.bench.timing.time_cases`); a mode's time is the
slowest rank's, and the table shows medians and the speed-up over the
uncompressed mean (``none``: Allreduce in place in chunks, each chunk scaled
by 1/size right after). Compressed modes do what the reducer's compressed
path does: cast into a 16-bit wire buffer, sum it chunk by chunk
(:func:`mpi_gradreducer._core.summers.compressed_allreduce`), and cast back
with the mean applied. ``cast`` rows time the
pack and unpack alone, without communication. Errors are against the mean
computed in float64 from the same float32 inputs, and the ranks' results are
checked to be bitwise identical.

Across hosts, a table of each host's NIC bytes per call follows, and with
``--link-rate RATE`` the wire bound of the uncompressed gradient (see
:mod:`mpi_gradreducer.bench.network`); for the 16-bit modes ``x own`` is
against the ring optimum of their own 2 bytes per value.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .._core import transport
from .._core.halves import compressed_allreduce
from .._core.summers import allreduce
from .._core.wire import Compression, get_compression, pack, unpack
from .cli import RankParser, add_network_options, parse, run_as_script
from .network import NicMeter, figures, format_lines as network_lines
from .output import write_json
from .timing import Case, time_cases

__all__ = ["MODES", "main"]

MODES = ("none", "fp16", "bf16", "fp16-allreduce", "bf16-allreduce", "fp16-cast", "bf16-cast")


def _parser(rank: int = 0) -> RankParser:
    p = RankParser(prog="python -m mpi_gradreducer.bench compression", description=__doc__.splitlines()[0],
                   rank=rank)
    p.add_argument("--elements", type=int, default=25_000_000, help="float32 values per rank")
    p.add_argument("--reps", type=int, default=5, help="repetitions of every mode")
    p.add_argument("--chunk-bytes", type=int, default=transport.CHUNK_BYTES, help="bytes per collective")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results to PATH")
    add_network_options(p)
    return p


def _check(args: argparse.Namespace) -> str | None:
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        return f"unknown modes {unknown}; expected some of {MODES}"
    if args.elements < 1 or args.reps < 1 or args.chunk_bytes < 2:
        return (f"--elements and --reps must be >= 1 and --chunk-bytes >= 2, "
                f"got {args.elements}, {args.reps} and {args.chunk_bytes}")
    return None


def _runner(mode: str, comm: MPI.Comm, grad: np.ndarray, comps: dict[str, Compression],
            chunk_bytes: int) -> Callable[[], object]:
    size = comm.Get_size()
    if mode == "none":
        return lambda: allreduce(comm, grad, 1.0 / size, chunk_bytes)
    name, _, method = mode.partition("-")
    comp = comps[name]
    pre, post = comp.scales(size, size, mean=True)
    if method == "cast":
        wire = np.empty(max(1, chunk_bytes // 2), dtype=comp.wire_dtype)
        step = wire.shape[0]

        def cast_only() -> None:
            for start in range(0, grad.shape[0], step):
                part = grad[start : start + step]
                w = wire[: part.shape[0]]
                pack(part, w, pre)
                unpack(w, part, post)

        return cast_only
    method = method or "alltoall"
    wire = np.empty(grad.shape[0], dtype=comp.wire_dtype)

    def compressed() -> None:
        pack(grad, wire, pre)
        compressed_allreduce(comm, wire, comp, chunk_bytes, method=method)
        unpack(wire, grad, post)

    return compressed


class _Errors:
    """After a mode's first run: its error against the float64 mean, and a checksum of its result."""

    def __init__(self, grad: np.ndarray, ref: np.ndarray) -> None:
        self.grad, self.ref = grad, ref
        self.ref_norm = float(np.linalg.norm(ref))
        self.ref_max = float(np.abs(ref).max())
        self.errors: dict[str, tuple[float, float, float]] = {}
        self.crcs: dict[str, int] = {}

    def check(self, mode: str) -> Callable[[], bool]:
        """A case's ``check`` for ``mode``: records the errors and the checksum, and passes."""
        def record() -> bool:
            diff = self.grad - self.ref  # the same on every rank: measured locally
            max_abs = float(np.abs(diff).max())
            self.errors[mode] = (max_abs, float(np.linalg.norm(diff)) / self.ref_norm, max_abs / self.ref_max)
            self.crcs[mode] = zlib.crc32(self.grad.data)
            return True

        return record

    def agree(self, comm: MPI.Comm) -> None:
        """Raise on every rank when some mode's result differs between ranks (collective)."""
        modes = sorted(self.crcs)
        mine = np.array([self.crcs[m] for m in modes], dtype=np.int64)
        low, high = mine.copy(), mine.copy()
        comm.Allreduce(MPI.IN_PLACE, low, op=MPI.MIN)
        comm.Allreduce(MPI.IN_PLACE, high, op=MPI.MAX)
        differ = [m for m, lo, hi in zip(modes, low, high, strict=True) if lo != hi]
        if differ:
            raise RuntimeError(f"{', '.join(differ)}: the ranks' results differ")


def _measure(comm: MPI.Intracomm, args: argparse.Namespace, modes: list[str], meter: NicMeter | None = None
             ) -> tuple[dict[str, list[float]], _Errors]:
    size, rank = comm.Get_size(), comm.Get_rank()
    x = np.random.default_rng([args.seed, rank]).standard_normal(args.elements, dtype=np.float32)
    grad = np.empty_like(x)
    ref = x.astype(np.float64)
    comm.Allreduce(MPI.IN_PLACE, ref)
    ref /= size
    errors = _Errors(grad, ref)
    comps = {name: get_compression(name) for name in ("fp16", "bf16")}
    try:
        cases = [Case(mode, lambda: np.copyto(grad, x), _runner(mode, comm, grad, comps, args.chunk_bytes),
                      None if mode.endswith("-cast") else errors.check(mode)) for mode in modes]
        times = time_cases(comm, cases, args.reps, 0, meter)
    finally:
        for c in comps.values():
            c.free()
    errors.agree(comm)
    return times, errors


def _table(comm: MPI.Comm, args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> str:
    lines = [f"{comm.Get_size()} ranks, {args.elements} float32 per rank ({args.elements * 4 / 2**20:.1f} MiB), "
             f"chunk {args.chunk_bytes} bytes, {args.reps} reps; {MPI.Get_library_version().splitlines()[0]}",
             f"{'mode':<16}{'median ms':>10}{'speed-up':>10}{'max abs err':>13}{'rel L2 err':>12}{'max err/max':>13}"]
    for mode, row in rows.items():
        err = row.get("errors")
        cols = (f"{err['max_abs']:>13.3g}{err['rel_l2']:>12.3g}{err['max_over_max']:>13.3g}" if err
                else f"{'':>13}{'':>12}{'':>13}")
        lines.append(f"{mode:<16}{row['median_ms']:>10.1f}{row['speedup']:>10.2f}{cols}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, comm: MPI.Intracomm | None = None) -> dict[str, Any]:
    """Run the comparison; rank 0 prints the table (and writes ``--json``).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: the communicator (default ``MPI.COMM_WORLD``).

    Returns:
        Per mode: ``median_ms``, ``times_ms``, ``speedup`` over ``none`` (NaN
        without it) and, except for the cast rows, ``errors``; the same on every rank.

    Raises:
        SystemExit: on every rank alike, for ``--help`` and bad options.
        RuntimeError: on every rank, when the ranks' results differ.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    args = parse(_parser(comm.Get_rank()), argv, comm, _check)
    modes = [m for m in args.modes.split(",") if m]
    comm = comm.Dup()
    try:
        meter = NicMeter(comm, args.nics)
        times, errors = _measure(comm, args, modes, meter)
        sent = meter.per_call(modes)
        base = statistics.median(times["none"]) if "none" in times else float("nan")
        rows: dict[str, dict[str, Any]] = {}
        for mode in modes:
            med = statistics.median(times[mode])
            rows[mode] = {"median_ms": med * 1e3, "times_ms": [t * 1e3 for t in times[mode]], "speedup": base / med}
            if mode in errors.errors:
                rows[mode]["errors"] = dict(zip(("max_abs", "rel_l2", "max_over_max"), errors.errors[mode],
                                                strict=True))
        own = {mode: 2 * args.elements for mode in modes if mode != "none" and not mode.endswith("-cast")}
        net = figures(meter.hosts, 4 * args.elements, args.link_rate,
                      {mode: row["median_ms"] for mode, row in rows.items()}, sent, own)
        if comm.Get_rank() == 0:
            print(_table(comm, args, rows), flush=True)
            print("\n".join(network_lines(net)), flush=True)
            if args.json:
                write_json(args.json, {"settings": vars(args), "ranks": comm.Get_size(), "modes": rows,
                                       "network": net})
        return rows
    finally:
        comm.Free()


if __name__ == "__main__":
    run_as_script(main, "compression")

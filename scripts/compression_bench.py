"""Compressed vs uncompressed Allreduce of one large float32 gradient.

Run under mpiexec, e.g.::

    mpiexec -n 4 python scripts/compression_bench.py                      # shared memory
    mpiexec -n 4 -genv MPIR_CVAR_NOLOCAL 1 python scripts/compression_bench.py
    mpiexec -n 4 -genv MPIR_CVAR_NOLOCAL 1 -genv UCX_TLS tcp python scripts/compression_bench.py

Every rank holds ``--elements`` random normal float32 values (ResNet-50 has
about 25.6 M parameters). Each repetition runs every mode once, in a rotating
order; a mode's time is the slowest rank's, and the table shows medians and
the speed-up over the uncompressed mean (``none``: Allreduce in place in
chunks, each chunk scaled by 1/size right after). Compressed modes cast into a
one-chunk 16-bit wire buffer, sum, and cast back with the mean applied
(:func:`mpi_gradreducer.compression.reduce_array`). ``cast`` rows time the
pack and unpack alone, without communication. Errors are against the mean
computed in float64 from the same float32 inputs.
"""

from __future__ import annotations

import argparse
import time
import zlib
from typing import Callable

import numpy as np
from mpi4py import MPI

from mpi_gradreducer import transport
from mpi_gradreducer.compression import get_compression, pack, reduce_array, unpack

MODES = ("none", "fp16", "bf16", "fp16-allreduce", "bf16-allreduce", "fp16-cast", "bf16-cast")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=25_000_000, help="float32 values per rank")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every mode")
    parser.add_argument("--chunk-bytes", type=int, default=transport.CHUNK_BYTES, help="bytes per collective")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; expected some of {MODES}")

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    n = args.elements
    x = np.random.default_rng([args.seed, rank]).standard_normal(n, dtype=np.float32)
    grad = np.empty_like(x)
    ref = x.astype(np.float64)
    comm.Allreduce(MPI.IN_PLACE, ref)
    ref /= size
    ref_norm = float(np.linalg.norm(ref))
    ref_max = float(np.abs(ref).max()) if n else 0.0

    comps = {name: get_compression(name) for name in ("fp16", "bf16")}
    runs: dict[str, Callable[[], None]] = {}
    for mode in modes:
        runs[mode] = _runner(mode, comm, grad, comps, args.chunk_bytes)

    times: dict[str, list[float]] = {m: [] for m in modes}
    errors: dict[str, tuple[float, float, float]] = {}
    for rep in range(args.reps):
        k = rep % len(modes)
        for mode in modes[k:] + modes[:k]:
            np.copyto(grad, x)
            comm.Barrier()
            t = time.perf_counter()
            runs[mode]()
            t = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            times[mode].append(t)
            if mode not in errors and not mode.endswith("-cast"):
                check = np.array([zlib.crc32(grad)] * 2, dtype=np.int64)
                check[1] = -check[1]
                comm.Allreduce(MPI.IN_PLACE, check, op=MPI.MIN)
                if check[0] != -check[1]:
                    raise RuntimeError(f"{mode}: the ranks' results differ")
                diff = grad - ref  # the same on every rank: measured locally
                max_abs = float(np.abs(diff).max()) if n else 0.0
                errors[mode] = (max_abs, float(np.linalg.norm(diff)) / ref_norm, max_abs / ref_max)
                del diff
    for c in comps.values():
        c.free()

    if rank == 0:
        base = float(np.median(times["none"])) if "none" in times else float("nan")
        print(f"{size} ranks, {n} float32 per rank ({n * 4 / 2**20:.1f} MiB), "
              f"chunk {args.chunk_bytes} bytes, {args.reps} reps; {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'mode':<16}{'median ms':>10}{'speed-up':>10}{'max abs err':>13}{'rel L2 err':>12}{'max err/max':>13}")
        for mode in modes:
            med = float(np.median(times[mode])) * 1e3
            err = errors.get(mode)
            cols = f"{err[0]:>13.3g}{err[1]:>12.3g}{err[2]:>13.3g}" if err else f"{'':>13}{'':>12}{'':>13}"
            print(f"{mode:<16}{med:>10.1f}{base * 1e3 / med:>10.2f}{cols}")


def _runner(mode: str, comm: MPI.Comm, grad: np.ndarray, comps: dict, chunk_bytes: int) -> Callable[[], None]:
    size = comm.Get_size()
    if mode == "none":
        return lambda: transport.allreduce(comm, grad, 1.0 / size, chunk_bytes)
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
    return lambda: reduce_array(comm, grad, comp, pre, post, chunk_bytes, method=method)


if __name__ == "__main__":
    main()

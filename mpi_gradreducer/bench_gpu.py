"""GPU benchmark: the staged reducer against the pinned-copy bound, raw host MPI and a naive loop.

Run it under MPI on a machine with cupy and a CUDA device; only rank 0 prints::

    mpiexec -n 4 python -m mpi_gradreducer.bench_gpu --workload resnet50 --reps 5 --json out/bench_gpu.json

Each rank first takes GPU ``local_rank % device_count`` (:func:`select_device`):
with more ranks than GPUs, several ranks share one. The gradients are cupy
float32 arrays of the workload's shapes (those of :mod:`mpi_gradreducer.bench`).
Every method is timed in one run, interleaved, with :func:`bench.time_cases`:
before each run, fresh values are written with cupy and the device is
synchronised, outside the timed region; every timed region ends with a device
synchronisation, so that queued GPU work is counted. A run's time is the
maximum over the ranks; the summary is the median of the repetitions.

Methods:

``copy-bound``
    One contiguous device buffer of the workload's bytes copied into a pinned
    host buffer (``cupyx.empty_pinned``) and back, on one stream: what the
    staging copies cost at best. Its D2H and H2D bandwidths are reported.
``host-limit``
    ``Allreduce(MPI.IN_PLACE, buf)`` over a preallocated numpy buffer of the
    same bytes, in chunks of 1 MiB, 4 MiB or whole (the fastest is kept): what
    MPI alone costs.
``naive``
    Per tensor: ``g.get()``, a host Allreduce, ``g.set()``, then ``g *= 1 / size``.
``reducer-staged``
    ``DistributedGradReducer(params, cuda_aware=False)`` on separately
    allocated cupy arrays: pack kernels, the pipelined pinned staging
    pipeline, unpack kernels.
``reducer-staged-views``
    The same on the arrays of ``reducer.allocate_grads()`` (no packing).
``reducer-cuda-aware``
    ``cuda_aware=True``, only when the MPI library says it is CUDA-aware on
    every rank (``transport.cuda_support()``).

Every method is first run once on its own; one that raises or gives a wrong
result on any rank is reported as skipped, with the first rank's reason, and
the others are still timed.

Summary figures: the *staging efficiency* is ``max(copy-bound, host-limit) /
reducer-staged`` (when copies and MPI overlap perfectly, the pipeline takes as
long as the slower of the two); ``copy-bound / reducer-staged`` compares the
staging path's throughput with the measured pinned-copy bandwidth (target:
0.70 or more); kernel launches per bucket per call come from the reducer's
fusion buffers.

Without cupy or a usable GPU on some rank, rank 0 prints one line saying so
and every rank returns (the decision is collective).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from . import __version__, reducer as reducer_module, transport
from .bench import Case, Workload, _summary, bert_base, many_small, resnet50, start, time_cases
from .groups import select_device
from .reducer import DistributedGradReducer

__all__ = ["METHODS", "TARGET", "WORKLOADS", "gpu_available", "main"]

MIB = 1 << 20

WORKLOADS = ("resnet50", "bert-base", "many-small")
METHODS = ("copy-bound", "host-limit", "naive", "reducer-staged", "reducer-staged-views", "reducer-cuda-aware")
#: Chunk sizes tried for the host limit; 0 stands for the whole buffer at once.
HOST_CHUNKS = (1 * MIB, 4 * MIB, 0)
#: The issue's target for ``copy-bound / reducer-staged``.
TARGET = 0.70
#: Watchdog timeout of the benchmark's reducers: a stalled collective ends the job.
WATCHDOG_SECONDS = 120.0


# -- availability -------------------------------------------------------------------------


def _one_line(text: str, limit: int = 240) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def gpu_available(comm: MPI.Intracomm) -> Tuple[bool, str]:
    """Whether cupy imports and sees a CUDA device on every rank of ``comm`` (collective).

    Returns:
        ``(ok, why)``: the same on every rank; ``why`` names the first rank
        without a GPU and its reason, empty when ``ok``.
    """
    reason = ""
    try:
        import cupy

        if int(cupy.cuda.runtime.getDeviceCount()) < 1:
            reason = "cupy sees no CUDA device"
    except ImportError:
        reason = "cupy is not installed"
    except Exception as exc:  # a driver or runtime error: no usable device
        reason = _one_line(f"{type(exc).__name__}: {exc}")
    reasons = comm.allgather(reason)
    bad = [(r, why) for r, why in enumerate(reasons) if why]
    if not bad:
        return True, ""
    return False, f"rank {bad[0][0]}: {bad[0][1]}"


def _agree(comm: MPI.Intracomm, fn: Callable[[], Any]) -> Optional[str]:
    """Run ``fn()`` on every rank; None when it succeeded everywhere, else the first failing rank's error."""
    error = ""
    try:
        fn()
    except Exception as exc:  # reported, and the method is left out on every rank
        error = _one_line(f"{type(exc).__name__}: {exc}")
    errors = comm.allgather(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


# -- helpers ------------------------------------------------------------------------------


def _sync() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def _close(arrays: Sequence[Any], value: float) -> bool:
    """A cheap check: a strided sample and the last element of every (numpy or cupy) array."""
    import cupy

    for a in arrays:
        flat = a.reshape(-1)
        if flat.size == 0:
            continue
        sample = np.concatenate([cupy.asnumpy(flat[::97]), cupy.asnumpy(flat[-1:])]).astype(np.float64)
        if not np.allclose(sample, value, rtol=1e-5, atol=0.0):
            return False
    return True


def _device_filler(arrays: Sequence[Any], value: float) -> Callable[[], None]:
    def fill() -> None:
        for a in arrays:
            a.fill(value)
        _sync()

    return fill


def _timed(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` followed by a device synchronisation (so that its GPU work is timed)."""

    def timed() -> None:
        run()
        _sync()

    return timed


def _make_workload(name: str, args: argparse.Namespace) -> Workload:
    if name == "resnet50":
        return resnet50()
    if name == "bert-base":
        return bert_base(args.scale)
    return many_small(args.small_count, args.small_size)


def _size_label(nbytes: int) -> str:
    return "whole" if nbytes == 0 else f"{nbytes // MIB} MiB"


# -- the cases ----------------------------------------------------------------------------


class _CopyBound:
    """D2H into a pinned buffer and H2D back, of one contiguous device buffer, with event timing."""

    def __init__(self, nbytes: int, value: float) -> None:
        import cupy
        import cupyx

        self.count = max(1, -(-nbytes // 4))
        self.nbytes = self.count * 4
        self.value = value
        self.device = cupy.empty(self.count, dtype=cupy.float32)
        self.host = cupyx.empty_pinned((self.count,), dtype=np.float32)
        self.events = [cupy.cuda.Event() for _ in range(3)]
        self.split_ms: List[Tuple[float, float]] = []

    def prepare(self) -> None:
        self.device.fill(self.value)
        self.host.fill(0.0)
        _sync()

    def run(self) -> None:
        import cupy

        stream = cupy.cuda.get_current_stream()
        start, middle, end = self.events
        start.record(stream)
        self.device.data.copy_to_host_async(self.host.ctypes.data, self.nbytes, stream)
        middle.record(stream)
        self.device.data.copy_from_host_async(self.host.ctypes.data, self.nbytes, stream)
        end.record(stream)
        _sync()
        self.split_ms.append((cupy.cuda.get_elapsed_time(start, middle), cupy.cuda.get_elapsed_time(middle, end)))

    def check(self) -> bool:
        return _close([self.device, self.host], self.value)


def _host_limit_cases(comm: MPI.Intracomm, nbytes: int, value: float, total: float) -> List[Case]:
    buf = np.zeros(max(1, -(-nbytes // 4)), dtype=np.float32)
    cases = []
    for chunk in [c for c in HOST_CHUNKS if 0 < c < nbytes] + [0]:
        step = buf.shape[0] if chunk == 0 else max(1, chunk // 4)

        def run(step: int = step) -> None:
            for start in range(0, buf.shape[0], step):
                comm.Allreduce(MPI.IN_PLACE, buf[start : start + step])

        cases.append(Case(f"host-limit@{_size_label(chunk)}", lambda: buf.fill(value), run,
                          lambda: _close([buf], total)))
    return cases


def _naive(comm: MPI.Intracomm, grads: Sequence[Any]) -> None:
    scale = 1.0 / comm.Get_size()
    for g in grads:
        host = g.get()
        comm.Allreduce(MPI.IN_PLACE, host)
        g.set(host)
        g *= scale


def _launches(r: DistributedGradReducer) -> Dict[str, Any]:
    """Kernel launches of the reducer's device packs and unpacks, per bucket and per call."""
    fusion = r._fusion
    calls = max(1, r.stats.calls)
    launches = sum(f.launches for f in fusion)
    packed = sum(1 for f in fusion if f.launches)
    return {
        "calls": r.stats.calls,
        "buckets": len(fusion),
        "packed_buckets": packed,
        "launches": launches,
        "launches_per_bucket_per_call": launches / calls / max(1, len(fusion)),
        "launches_per_packed_bucket_per_call": launches / calls / packed if packed else 0.0,
    }


def _reducer_stats(r: DistributedGradReducer) -> Dict[str, float]:
    s = r.stats
    calls = max(1, s.calls)
    return {"pack_ms": s.pack_seconds / calls * 1e3, "allreduce_ms": s.allreduce_seconds / calls * 1e3,
            "unpack_ms": s.unpack_seconds / calls * 1e3, "wire_bytes": s.bytes // calls}


def _cuda_aware(comm: MPI.Intracomm) -> Tuple[bool, str]:
    """Whether MPI takes device buffers on every rank (collective), and why not."""
    try:
        answer, source = transport.cuda_support()
    except ValueError as exc:  # a malformed override
        answer, source = None, str(exc)
    ok = comm.allreduce(int(answer is True), op=MPI.MIN)
    if ok:
        return True, f"CUDA-aware ({source})"
    rows = comm.allgather((answer, source))
    rank = next(r for r, (a, _) in enumerate(rows) if a is not True)
    answer, source = rows[rank]
    said = {None: "unknown", False: "no"}[answer]
    return False, f"MPI is not CUDA-aware on every rank (rank {rank}: {said}, from {source})"


# -- one workload -------------------------------------------------------------------------


def _bench_workload(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> Dict[str, Any]:
    import cupy

    size = comm.Get_size()
    value = 1.0 + comm.Get_rank()  # exact in float32, no overflow
    total = size + size * (size - 1) / 2
    mean = total / size
    grads = [cupy.zeros(s, dtype=d) for s, d in zip(wl.shapes, wl.dtypes)]
    cases: List[Case] = []
    skipped: Dict[str, str] = {}
    reducers: Dict[str, DistributedGradReducer] = {}
    copy: Optional[_CopyBound] = None
    aware, aware_note = _cuda_aware(comm)

    def add_reducer(name: str, cuda_aware: bool, views: bool) -> None:
        holder: Dict[str, Any] = {}

        def build() -> None:
            holder["r"] = DistributedGradReducer(grads, group=comm, cuda_aware=cuda_aware,
                                                 timeout=WATCHDOG_SECONDS)
            holder["g"] = holder["r"].allocate_grads() if views else grads

        why = _agree(comm, build)
        if "r" in holder:
            reducers[name] = holder["r"]
        if why is not None:
            skipped[name] = f"construction failed: {why}"
            return
        r, g = holder["r"], holder["g"]
        cases.append(Case(name, _device_filler(g, value), _timed(lambda: r(g)), lambda: _close(g, mean)))

    try:
        built: Dict[str, _CopyBound] = {}
        why = _agree(comm, lambda: built.setdefault("c", _CopyBound(wl.nbytes, value)))
        if why is None:
            copy = built["c"]
            cases.append(Case("copy-bound", copy.prepare, copy.run, copy.check))
        else:
            skipped["copy-bound"] = why
        cases.extend(_host_limit_cases(comm, wl.nbytes, value, total))
        cases.append(Case("naive", _device_filler(grads, value), _timed(lambda: _naive(comm, grads)),
                          lambda: _close(grads, mean)))
        add_reducer("reducer-staged", False, False)
        add_reducer("reducer-staged-views", False, True)
        if aware:
            add_reducer("reducer-cuda-aware", True, False)
        else:
            skipped["reducer-cuda-aware"] = aware_note
        kept = []
        for case in cases:  # each once on its own: a broken method is reported, not fatal
            def once(case: Case = case) -> None:
                case.prepare()
                case.run()
                if case.check is not None and not case.check():
                    raise RuntimeError("wrong result")

            why = _agree(comm, once)
            if why is None:
                kept.append(case)
            else:
                skipped[case.name] = why
        if copy is not None:
            copy.split_ms.clear()
        times = time_cases(comm, kept, reps, warmup) if kept else {}
        launches = {name: _launches(r) for name, r in reducers.items() if name in times}
        stats = {name: _reducer_stats(r) for name, r in reducers.items() if name in times}
        messages = {name: len(r.buckets) for name, r in reducers.items()}
    finally:
        for r in reducers.values():
            r.free()

    results = {name: _summary(t, wl.nbytes, size) for name, t in times.items()}
    out: Dict[str, Any] = {
        **wl.facts(size),
        "cuda_aware": aware,
        "cuda_aware_note": aware_note,
        "messages": messages,
        "reducer_stats": stats,
        "kernel_launches": launches,
        "skipped": {m: skipped[m] for m in METHODS if m in skipped},
    }
    methods: Dict[str, Dict[str, Any]] = {}
    limits = {name: res for name, res in results.items() if name.startswith("host-limit@")}
    if limits:
        out["host_limit_by_chunk"] = limits
        best = min(limits, key=lambda n: limits[n]["median_ms"])
        if "copy-bound" in results:
            methods["copy-bound"] = results["copy-bound"]
        methods["host-limit"] = dict(limits[best], chunk=best.split("@", 1)[1])
    elif "copy-bound" in results:
        methods["copy-bound"] = results["copy-bound"]
    for name in METHODS:
        if name not in methods and name in results:
            methods[name] = results[name]
    for ref, key in (("copy-bound", "x_copy_bound"), ("host-limit", "x_host_limit")):
        if ref in methods:
            for res in methods.values():
                res[key] = res["median_ms"] / methods[ref]["median_ms"]
    if copy is not None and copy.split_ms and "copy-bound" in methods:
        split = np.array(copy.split_ms[-len(times["copy-bound"]):], dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, split, op=MPI.MAX)  # the slowest rank, as for the wall times
        d2h, h2d = (float(np.median(split[:, j])) for j in (0, 1))
        m = methods["copy-bound"]
        m["d2h_ms"], m["h2d_ms"] = d2h, h2d
        m["d2h_GBps"] = copy.nbytes / d2h / 1e6 if d2h > 0 else float("inf")
        m["h2d_GBps"] = copy.nbytes / h2d / 1e6 if h2d > 0 else float("inf")
        m["copy_GBps"] = 2 * copy.nbytes / m["median_ms"] / 1e6
    out["methods"] = methods
    out["efficiency"] = _efficiency(methods)
    return out


def _efficiency(methods: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Staging efficiency and the copy-bound ratio of each staged reducer."""
    eff: Dict[str, Dict[str, Any]] = {}
    copy, host = methods.get("copy-bound"), methods.get("host-limit")
    for name in ("reducer-staged", "reducer-staged-views"):
        staged = methods.get(name)
        if staged is None:
            continue
        row: Dict[str, Any] = {}
        if copy is not None:
            row["copy_bound_over_staged"] = copy["median_ms"] / staged["median_ms"]
            row["target"] = TARGET
            row["target_met"] = bool(row["copy_bound_over_staged"] >= TARGET)
        if copy is not None and host is not None:
            row["staging_efficiency"] = max(copy["median_ms"], host["median_ms"]) / staged["median_ms"]
        eff[name] = row
    return eff


# -- output -------------------------------------------------------------------------------


def _environment(comm: MPI.Intracomm, argv: Sequence[str], device: int) -> Dict[str, Any]:
    import cupy
    import mpi4py

    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    placement = comm.allgather((MPI.Get_processor_name(), device, name))
    try:
        aware = transport.cuda_support()
    except ValueError as exc:
        aware = (None, str(exc))
    return {
        "mpi_library_version": MPI.Get_library_version().strip().splitlines()[0],
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
        "python": platform.python_version(),
        "mpi_gradreducer": __version__,
        "ranks": comm.Get_size(),
        "hostname": socket.gethostname(),
        "placement": [{"rank": r, "host": h, "device": d, "name": n} for r, (h, d, n) in enumerate(placement)],
        "gpus": len({(h, d) for h, d, _ in placement}),
        "gpu_names": sorted({n for _, _, n in placement}),
        "cuda_aware_rank0": {"answer": aware[0], "source": aware[1]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": " ".join([os.path.basename(sys.executable), "-m", "mpi_gradreducer.bench_gpu", *argv]),
        "environment_variables": {k: v for k, v in os.environ.items()
                                  if k.startswith(("MPIR_CVAR_", "MPICH_", "MPI_GRADREDUCER_", "CUPY_",
                                                   "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"))},
        "constants": {"DEFAULT_BUCKET_BYTES": reducer_module.DEFAULT_BUCKET_BYTES,
                      "DIRECT_BYTES": reducer_module.DIRECT_BYTES,
                      "CHUNK_BYTES": transport.CHUNK_BYTES},
    }


def _format_workload(name: str, res: Dict[str, Any], env: Dict[str, Any]) -> str:
    gpus = env["gpus"]
    lines = [
        f"{name}: {res['tensors']} tensors, {res['bytes'] / 1e6:.1f} MB ({'/'.join(res['dtypes'])}), "
        f"{res['ranks']} ranks on {gpus} GPU{'s' if gpus != 1 else ''} ({', '.join(env['gpu_names'])}); "
        f"{res['cuda_aware_note']}",
        f"  {'method':<22}{'median ms':>10}{'min ms':>9}{'x copy':>8}{'x host':>8}{'GB/s':>8}  notes",
    ]
    launches = res["kernel_launches"]
    for method, m in res["methods"].items():
        notes = []
        if method == "copy-bound" and "d2h_GBps" in m:
            notes.append(f"per rank: D2H {m['d2h_GBps']:.1f} GB/s, H2D {m['h2d_GBps']:.1f} GB/s, "
                         f"both ways {m['copy_GBps']:.1f} GB/s")
        if method == "host-limit":
            notes.append(f"chunk {m['chunk']}")
        if method in res["messages"]:
            notes.append(f"{res['messages'][method]} messages")
        if method in launches and launches[method]["packed_buckets"]:
            notes.append(f"{launches[method]['launches_per_packed_bucket_per_call']:.2f} launches per packed bucket")
        ratios = [f"{m[k]:>8.2f}" if k in m else f"{'-':>8}" for k in ("x_copy_bound", "x_host_limit")]
        lines.append(f"  {method:<22}{m['median_ms']:>10.2f}{m['min_ms']:>9.2f}{''.join(ratios)}"
                     f"{m['algbw_GBps']:>8.2f}  {', '.join(notes)}")
    for method, why in res["skipped"].items():
        lines.append(f"  {method:<22}skipped: {why}")
    for method, e in res["efficiency"].items():
        parts = []
        if "staging_efficiency" in e:
            parts.append(f"staging efficiency max(copy-bound, host-limit) / {method} = {e['staging_efficiency']:.2f}")
        if "copy_bound_over_staged" in e:
            parts.append(f"copy-bound / {method} = {e['copy_bound_over_staged']:.2f} "
                         f"(target >= {e['target']:.2f}: {'met' if e['target_met'] else 'not met'})")
        if parts:
            lines.append("  " + "; ".join(parts))
    for method, k in launches.items():
        lines.append(f"  kernel launches per bucket per call, {method}: {k['launches_per_bucket_per_call']:.2f} "
                     f"({k['packed_buckets']} of {k['buckets']} buckets packed, {k['calls']} calls)")
    return "\n".join(lines)


# -- entry point --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpi_gradreducer.bench_gpu",
        description="Time the staged GPU reducer against the pinned-copy bound, raw host MPI and a naive "
                    "per-tensor loop, on cupy float32 gradients. Run under mpiexec; only rank 0 prints.",
    )
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=["resnet50"],
                   help="workloads to run (default: resnet50)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="bert-base size in (0, 1]: fraction of its 12 layers and of its vocabulary (default 1)")
    p.add_argument("--small-count", type=int, default=1000, help="many-small: number of tensors (default 1000)")
    p.add_argument("--small-size", type=int, default=1024, help="many-small: elements per tensor (default 1024)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per method (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--json", metavar="PATH", help="write all results and the environment to PATH")
    return p


def main(argv: Optional[Sequence[str]] = None, comm: Optional[MPI.Intracomm] = None) -> Dict[str, Any]:
    """Run the benchmark; rank 0 prints the tables and writes ``--json``.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: the communicator to run over (default ``MPI.COMM_WORLD``).

    Returns:
        All results (what ``--json`` writes), the same on every rank; with
        only the key ``skipped`` (and the reason) when some rank has no GPU.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args, comm, say = start(_parser(), argv, comm)
    rank = comm.Get_rank()

    def write(results: Dict[str, Any]) -> None:
        if rank == 0 and args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    try:
        ok, why = gpu_available(comm)
        if not ok:
            say(f"bench_gpu: skipped, needs cupy and a CUDA device on every rank ({why})")
            results: Dict[str, Any] = {"skipped": why, "argv": argv}
            write(results)
            return results
        device = select_device(comm)
        env = _environment(comm, argv, device)
        results = {"environment": env,
                   "settings": {k: v for k, v in vars(args).items() if k != "json"},
                   "workloads": {}}
        for name in args.workload:
            res = _bench_workload(comm, _make_workload(name, args), args.reps, args.warmup)
            results["workloads"][name] = res
            say(_format_workload(name, res, env) + "\n")
        write(results)
        if args.json:
            say(f"wrote {args.json}")
        comm.Barrier()
        return results
    finally:
        comm.Free()


def _run_as_script() -> None:
    """``main()``; an unexpected error ends the whole job (the other ranks may wait in a collective)."""
    try:
        main()
    except SystemExit:
        raise
    except BaseException as exc:
        world = MPI.COMM_WORLD
        if world.Get_rank() == 0:
            traceback.print_exc()
        else:  # one line each: where it happened and what
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            what = _one_line("".join(traceback.format_exception_only(type(exc), exc)))
            sys.stderr.write(f"bench_gpu: rank {world.Get_rank()}: {what} "
                             f"({os.path.basename(frame.filename)}:{frame.lineno})\n")
            time.sleep(1.0)  # let rank 0's full report out first
        sys.stderr.flush()
        world.Abort(1)


if __name__ == "__main__":
    _run_as_script()

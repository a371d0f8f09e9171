"""GPU benchmark: the staged reducer against the pinned-copy bound, raw host MPI and a naive loop.

Run it under MPI on a machine with cupy and a CUDA device; only rank 0 prints::

    mpiexec -n 4 python -m mpi_gradreducer.bench gpu --workload resnet50 --reps 5 --json out/bench_gpu.json

Each rank first takes GPU ``local_rank % device_count`` (:func:`select_device`):
with more ranks than GPUs, several ranks share one. The gradients are cupy
float32 arrays of the workload's shapes (those of :mod:`mpi_gradreducer.bench.workloads`).
Every method is timed in one run, interleaved, with :func:`~mpi_gradreducer.bench.timing.time_cases`:
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
    every rank (``options.cuda_aware_default()``).

Every method is first run once on its own; one that raises or gives a wrong
result on any rank is reported as skipped, with the first rank's reason, and
the others are still timed.

Summary figures: the *staging efficiency* is ``max(copy-bound, host-limit) /
reducer-staged`` (when copies and MPI overlap perfectly, the pipeline takes as
long as the slower of the two); ``copy-bound / reducer-staged`` compares the
staging path's throughput with the measured pinned-copy bandwidth (target:
0.70 or more); kernel launches per call and per bucket per call come from the
reducer's public counters (``reducer.stats.launches``, ``reducer.stats.calls``,
``len(reducer.buckets)``).

Without cupy or a usable GPU on some rank, rank 0 prints one line saying so
and every rank returns (the decision is collective).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import DistributedGradReducer
from .._core import options
from .._core.groups import select_device
from .cli import RankParser, add_shared_options, run_as_script, start
from .counters import launches, reducer_stats
from .environment import environment
from .limit import best_limit, limit_cases
from .output import MIB, bytes_label, one_line, write_json
from .timing import Case, agree, all_close, expected_sum, fill_value, filler, keep_working, summary, time_cases
from .workloads import Workload, make_workload

__all__ = ["METHODS", "TARGET", "WORKLOADS", "bench_workload", "gpu_available", "main"]

WORKLOADS = ("resnet50", "bert-base", "many-small")
METHODS = ("copy-bound", "host-limit", "naive", "reducer-staged", "reducer-staged-views", "reducer-cuda-aware")
#: Chunk sizes tried for the host limit; the whole buffer at once is always tried too.
HOST_CHUNKS = (1 * MIB, 4 * MIB)
#: The issue's target for ``copy-bound / reducer-staged``.
TARGET = 0.70
#: Watchdog timeout of the benchmark's reducers: a stalled collective ends the job.
WATCHDOG_SECONDS = 120.0


# -- availability -------------------------------------------------------------------------


def gpu_available(comm: MPI.Intracomm) -> tuple[bool, str]:
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
        reason = one_line(f"{type(exc).__name__}: {exc}")
    reasons = comm.allgather(reason)
    bad = [(r, why) for r, why in enumerate(reasons) if why]
    if not bad:
        return True, ""
    return False, f"rank {bad[0][0]}: {bad[0][1]}"



# -- helpers ------------------------------------------------------------------------------


def _sync() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def _to_host(a: Any) -> np.ndarray:
    import cupy

    return cupy.asnumpy(a)


def _close(arrays: Sequence[Any], value: float) -> bool:
    """A cheap check of (numpy or cupy) arrays: see :func:`~mpi_gradreducer.bench.timing.all_close`."""
    return all_close(arrays, value, rtol=1e-5, to_host=_to_host)


def _timed(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` followed by a device synchronisation (so that its GPU work is timed)."""

    def timed() -> None:
        run()
        _sync()

    return timed


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
        self.split_ms: list[tuple[float, float]] = []

    def prepare(self) -> None:
        """Fresh values on the device, zeros on the host (not timed)."""
        self.device.fill(self.value)
        self.host.fill(0.0)
        _sync()

    def run(self) -> None:
        """D2H then H2D on the current stream; records both legs' event times."""
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
        """Both buffers hold the value written."""
        return _close([self.device, self.host], self.value)




def _naive(comm: MPI.Intracomm, grads: Sequence[Any]) -> None:
    scale = 1.0 / comm.Get_size()
    for g in grads:
        host = g.get()
        comm.Allreduce(MPI.IN_PLACE, host)
        g.set(host)
        g *= scale


def _cuda_aware(comm: MPI.Intracomm) -> tuple[bool, str]:
    """Whether MPI takes device buffers on every rank (collective), and why not."""
    try:
        answer, source = options.cuda_aware_default()
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


@dataclass
class _Methods:
    """The cases of one workload, the reducers behind them, and the methods left out (why)."""

    cases: list[Case] = field(default_factory=list)
    reducers: dict[str, DistributedGradReducer] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    copy: _CopyBound | None = None

    def free(self) -> None:
        """Free every reducer built."""
        for r in self.reducers.values():
            r.free()


def _add_reducer(comm: MPI.Intracomm, grads: list[Any], name: str, cuda_aware: bool, views: bool,
                 m: _Methods) -> None:
    """A reducer method; one whose construction fails on some rank is skipped on every rank."""
    holder: dict[str, Any] = {}

    def build() -> None:
        holder["r"] = DistributedGradReducer(grads, group=comm, cuda_aware=cuda_aware, timeout=WATCHDOG_SECONDS)
        holder["g"] = holder["r"].allocate_grads() if views else grads

    why = agree(comm, build)
    if "r" in holder:
        m.reducers[name] = holder["r"]
    if why is not None:
        m.skipped[name] = f"construction failed: {why}"
        return
    r, g = holder["r"], holder["g"]
    mean = expected_sum(comm) / comm.Get_size()
    m.cases.append(Case(name, filler(g, fill_value(comm), _sync), _timed(lambda: r(g)), lambda: _close(g, mean)))


def _gpu_methods(comm: MPI.Intracomm, wl: Workload, aware: bool, aware_note: str) -> _Methods:
    """Every case of one workload, each already run once: those that failed are in ``skipped``."""
    import cupy

    value, mean = fill_value(comm), expected_sum(comm) / comm.Get_size()
    grads = [cupy.zeros(s, dtype=d) for s, d in zip(wl.shapes, wl.dtypes, strict=True)]
    m = _Methods()
    try:
        built: dict[str, _CopyBound] = {}
        why = agree(comm, lambda: built.setdefault("c", _CopyBound(wl.nbytes, value)))
        if why is None:
            m.copy = built["c"]
            m.cases.append(Case("copy-bound", m.copy.prepare, m.copy.run, m.copy.check))
        else:
            m.skipped["copy-bound"] = why
        m.cases.extend(limit_cases(comm, wl.nbytes, HOST_CHUNKS, prefix="host-limit")[0])
        m.cases.append(Case("naive", filler(grads, value, _sync), _timed(lambda: _naive(comm, grads)),
                            lambda: _close(grads, mean)))
        _add_reducer(comm, grads, "reducer-staged", False, False, m)
        _add_reducer(comm, grads, "reducer-staged-views", False, True, m)
        if aware:
            _add_reducer(comm, grads, "reducer-cuda-aware", True, False, m)
        else:
            m.skipped["reducer-cuda-aware"] = aware_note
        m.cases, failed = keep_working(comm, m.cases)  # a broken method is reported, not fatal
        m.skipped.update(failed)
    except BaseException:
        m.free()
        raise
    if m.copy is not None:
        m.copy.split_ms.clear()
    return m


def bench_workload(comm: MPI.Intracomm, wl: Workload, reps: int, warmup: int) -> dict[str, Any]:
    """Time every method on one workload's cupy gradients, interleaved (collective).

    Returns:
        The workload's facts, ``cuda_aware`` (and its note), ``messages``,
        ``reducer_stats``, ``kernel_launches``, ``skipped``, ``methods``
        (summaries with ``x_copy_bound`` and ``x_host_limit``),
        ``host_limit_by_chunk`` and ``efficiency``.
    """
    aware, aware_note = _cuda_aware(comm)
    m = _gpu_methods(comm, wl, aware, aware_note)
    try:
        times = time_cases(comm, m.cases, reps, warmup) if m.cases else {}
        timed = {name: r for name, r in m.reducers.items() if name in times}
        out: dict[str, Any] = {
            **wl.facts(comm.Get_size()),
            "cuda_aware": aware,
            "cuda_aware_note": aware_note,
            "messages": {name: len(r.buckets) for name, r in m.reducers.items()},
            "reducer_stats": {name: reducer_stats(r) for name, r in timed.items()},
            "kernel_launches": {name: launches(r) for name, r in timed.items()},
            "skipped": {name: m.skipped[name] for name in METHODS if name in m.skipped},
        }
    finally:
        m.free()
    results = {name: summary(t, wl.nbytes, comm.Get_size()) for name, t in times.items()}
    out.update(_method_summaries(results))
    if m.copy is not None and m.copy.split_ms and "copy-bound" in out["methods"]:
        _copy_split(comm, m.copy, len(times["copy-bound"]), out["methods"]["copy-bound"])
    out["efficiency"] = _efficiency(out["methods"])
    return out


def _method_summaries(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``methods`` (the host limit at its fastest chunk), with their ratios, and ``host_limit_by_chunk``."""
    out: dict[str, Any] = {}
    methods: dict[str, dict[str, Any]] = {}
    if "copy-bound" in results:
        methods["copy-bound"] = results["copy-bound"]
    limits = {name: res for name, res in results.items() if name.startswith("host-limit@")}
    if limits:
        out["host_limit_by_chunk"] = limits
        best = best_limit(limits, limits)
        methods["host-limit"] = dict(limits[best], chunk=best.split("@", 1)[1])
    for name in METHODS:
        if name not in methods and name in results:
            methods[name] = results[name]
    for ref, key in (("copy-bound", "x_copy_bound"), ("host-limit", "x_host_limit")):
        if ref in methods:
            for res in methods.values():
                res[key] = res["median_ms"] / methods[ref]["median_ms"]
    out["methods"] = methods
    return out


def _copy_split(comm: MPI.Intracomm, copy: _CopyBound, reps: int, m: dict[str, Any]) -> None:
    """Add the copy bound's D2H and H2D times and bandwidths (CUDA events) to its summary ``m``."""
    split = np.array(copy.split_ms[-reps:], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, split, op=MPI.MAX)  # the slowest rank, as for the wall times
    d2h, h2d = (float(np.median(split[:, j])) for j in (0, 1))
    m["d2h_ms"], m["h2d_ms"] = d2h, h2d
    m["d2h_GBps"] = copy.nbytes / d2h / 1e6 if d2h > 0 else float("inf")
    m["h2d_GBps"] = copy.nbytes / h2d / 1e6 if h2d > 0 else float("inf")
    m["copy_GBps"] = 2 * copy.nbytes / m["median_ms"] / 1e6


def _efficiency(methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Staging efficiency and the copy-bound ratio of each staged reducer."""
    eff: dict[str, dict[str, Any]] = {}
    copy, host = methods.get("copy-bound"), methods.get("host-limit")
    for name in ("reducer-staged", "reducer-staged-views"):
        staged = methods.get(name)
        if staged is None:
            continue
        row: dict[str, Any] = {}
        if copy is not None:
            row["copy_bound_over_staged"] = copy["median_ms"] / staged["median_ms"]
            row["target"] = TARGET
            row["target_met"] = bool(row["copy_bound_over_staged"] >= TARGET)
        if copy is not None and host is not None:
            row["staging_efficiency"] = max(copy["median_ms"], host["median_ms"]) / staged["median_ms"]
        eff[name] = row
    return eff




# -- output -------------------------------------------------------------------------------


def _device_environment(comm: MPI.Intracomm, argv: Sequence[str], device: int) -> dict[str, Any]:
    """:func:`~mpi_gradreducer.bench.environment.environment`, with the GPUs and the CUDA versions."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    placement = comm.allgather((MPI.Get_processor_name(), device, name))
    env = environment(comm, "mpi_gradreducer.bench gpu", argv, prefixes=("CUPY_", "CUDA_VISIBLE_DEVICES"))
    env.update({
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
        "placement": [{"rank": r, "host": h, "device": d, "name": n} for r, (h, d, n) in enumerate(placement)],
        "gpus": len({(h, d) for h, d, _ in placement}),
        "gpu_names": sorted({n for _, _, n in placement}),
    })
    return env


def _method_line(method: str, m: dict[str, Any], res: dict[str, Any]) -> str:
    notes = []
    if method == "copy-bound" and "d2h_GBps" in m:
        notes.append(f"per rank: D2H {m['d2h_GBps']:.1f} GB/s, H2D {m['h2d_GBps']:.1f} GB/s, "
                     f"both ways {m['copy_GBps']:.1f} GB/s")
    if method == "host-limit":
        notes.append(f"chunk {m['chunk']}")
    if method in res["messages"]:
        notes.append(f"{res['messages'][method]} messages")
    k = res["kernel_launches"].get(method)
    if k is not None and k["launches"]:
        notes.append(f"{k['launches_per_call']:.1f} kernel launches per call")
    ratios = [f"{m[key]:>8.2f}" if key in m else f"{'-':>8}" for key in ("x_copy_bound", "x_host_limit")]
    return (f"  {method:<22}{m['median_ms']:>10.2f}{m['min_ms']:>9.2f}{''.join(ratios)}"
            f"{m['algbw_GBps']:>8.2f}  {', '.join(notes)}")


def _summary_lines(res: dict[str, Any]) -> list[str]:
    lines = []
    for method, e in res["efficiency"].items():
        parts = []
        if "staging_efficiency" in e:
            parts.append(f"staging efficiency max(copy-bound, host-limit) / {method} = {e['staging_efficiency']:.2f}")
        if "copy_bound_over_staged" in e:
            parts.append(f"copy-bound / {method} = {e['copy_bound_over_staged']:.2f} "
                         f"(target >= {e['target']:.2f}: {'met' if e['target_met'] else 'not met'})")
        if parts:
            lines.append("  " + "; ".join(parts))
    for method, k in res["kernel_launches"].items():
        lines.append(f"  kernel launches per bucket per call, {method}: {k['launches_per_bucket_per_call']:.2f} "
                     f"({k['launches_per_call']:.1f} per call over {k['buckets']} buckets, {k['calls']} calls)")
    return lines


def format_workload(name: str, res: dict[str, Any], env: dict[str, Any]) -> str:
    """The table of one workload's results (what rank 0 prints)."""
    gpus = env["gpus"]
    lines = [
        f"{name}: {res['tensors']} tensors, {bytes_label(res['bytes'])} ({'/'.join(res['dtypes'])}), "
        f"{res['ranks']} ranks on {gpus} GPU{'s' if gpus != 1 else ''} ({', '.join(env['gpu_names'])}); "
        f"{res['cuda_aware_note']}",
        f"  {'method':<22}{'median ms':>10}{'min ms':>9}{'x copy':>8}{'x host':>8}{'GB/s':>8}  notes",
    ]
    lines.extend(_method_line(method, m, res) for method, m in res["methods"].items())
    lines.extend(f"  {method:<22}skipped: {why}" for method, why in res["skipped"].items())
    lines.extend(_summary_lines(res))
    return "\n".join(lines)


# -- entry point --------------------------------------------------------------------------


def _parser(rank: int = 0) -> argparse.ArgumentParser:
    p = RankParser(
        prog="python -m mpi_gradreducer.bench gpu",
        description="Time the staged GPU reducer against the pinned-copy bound, raw host MPI and a naive "
                    "per-tensor loop, on cupy float32 gradients. Run under mpiexec; only rank 0 prints.",
        rank=rank,
    )
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=["resnet50"],
                   help="workloads to run (default: resnet50)")
    add_shared_options(p, reps=5)
    p.add_argument("--json", metavar="PATH", help="write all results and the environment to PATH")
    return p


def main(argv: Sequence[str] | None = None, comm: MPI.Intracomm | None = None) -> dict[str, Any]:
    """Run the benchmark; rank 0 prints the tables and writes ``--json``.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: the communicator to run over (default ``MPI.COMM_WORLD``).

    Returns:
        All results (what ``--json`` writes), the same on every rank; with
        only the keys ``skipped`` (the reason) and ``argv`` when some rank has no GPU.

    Raises:
        SystemExit: on every rank alike, for ``--help`` and bad options.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args, comm, say = start(_parser, argv, comm)

    def write(results: dict[str, Any]) -> None:
        if comm.Get_rank() == 0 and args.json:
            write_json(args.json, results)

    try:
        ok, why = gpu_available(comm)
        if not ok:
            say(f"bench_gpu: skipped, needs cupy and a CUDA device on every rank ({why})")
            results: dict[str, Any] = {"skipped": why, "argv": argv}
            write(results)
            return results
        env = _device_environment(comm, argv, select_device(comm))
        results = {"environment": env,
                   "settings": {k: v for k, v in vars(args).items() if k != "json"},
                   "workloads": {}}
        for name in args.workload:
            wl = make_workload(name, args.scale, args.small_count, args.small_size)
            res = results["workloads"][name] = bench_workload(comm, wl, args.reps, args.warmup)
            say(format_workload(name, res, env) + "\n")
        write(results)
        if args.json:
            say(f"wrote {args.json}")
        comm.Barrier()
        return results
    finally:
        comm.Free()


if __name__ == "__main__":
    run_as_script(main, "bench gpu")

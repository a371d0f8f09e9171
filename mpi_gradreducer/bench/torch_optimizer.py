"""A torch training step: ``mpi_gradreducer.torch.DistributedOptimizer`` against ``DistributedDataParallel``.

Run under MPI; only rank 0 prints::

    mpiexec -n 4 python -m mpi_gradreducer.bench torch-optimizer --layers 13 --width 1024 --batch 32

The model is a deep wide MLP: ``--layers`` float32 ``Linear(width, width)``
layers, each followed by a ReLU (13 x 1024 gives 54.6 MB of gradients).
Every method trains its own copy of it from the same start, on the same
batch per rank, with SGD and momentum; a step is ``zero_grad()``, forward,
MSE loss, backward and ``step()``. The methods are timed in one run,
interleaved (:func:`~mpi_gradreducer.bench.timing.time_cases`); a step's
time is the slowest rank's:

``compute``
    The same step with no communication at all (the plain torch optimizer):
    the least any method can take.
``ddp-gloo``
    ``DistributedDataParallel`` over a gloo process group (its defaults:
    25 MiB buckets, reduced by gloo's threads while backward runs).
``optimizer``
    ``DistributedOptimizer`` with ``progress="deferred"``: hooks hand the
    gradients over during backward, the buckets are reduced in ``step()``.
``optimizer-overlap``
    ``DistributedOptimizer`` with ``progress="thread"``: the buckets are
    reduced on a communication thread while backward goes on (needs
    ``MPI_THREAD_MULTIPLE``).

Each method's parameters are checked, after its first step, to be the same
on every rank. torch runs one thread per rank.

Across hosts, a table of each host's NIC bytes per step follows, and with
``--link-rate RATE`` the wire bound of the model's gradients (see
:mod:`mpi_gradreducer.bench.network`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .cli import RankParser, add_network_options, add_shared_options, run_as_script, start
from .environment import environment, loadavg
from .network import NicMeter, figures, format_lines as network_lines
from .output import write_json
from .timing import Case, time_cases
from .torch_methods import Gloo, gloo_usable

__all__ = ["METHODS", "main"]

METHODS = ("compute", "ddp-gloo", "optimizer", "optimizer-overlap")


def _same_everywhere(comm: MPI.Intracomm, model: Any) -> Callable[[], bool]:
    """A check (collective: ``time_cases`` calls it on every rank at once) that ``model`` is the same on every rank."""

    def check() -> bool:
        local = np.array([float(sum(float(p.detach().double().sum()) for p in model.parameters()))])
        low, high = local.copy(), local.copy()
        comm.Allreduce(MPI.IN_PLACE, low, op=MPI.MIN)
        comm.Allreduce(MPI.IN_PLACE, high, op=MPI.MAX)
        return bool(low[0] == high[0])

    return check


def bench_step(comm: MPI.Intracomm, layers: int, width: int, batch: int, methods: Sequence[str], reps: int,
               warmup: int, meter: NicMeter | None = None, link_rate: float | None = None) -> dict[str, Any]:
    """Time one training step per method, interleaved (collective).

    With ``meter``, the results also hold ``network`` (:func:`.network.figures`:
    each host's NIC bytes per step and, with ``link_rate`` in bits per
    second, the wire bound of the model's gradients).

    Returns:
        The model's facts, each method's ``median_ms``/``min_ms``/``times_ms``
        and ratios: ``optimizer_over_ddp``, ``overlap_over_optimizer``.
    """
    import torch

    from ..torch import DistributedOptimizer

    torch.set_num_threads(1)

    def make() -> Any:
        torch.manual_seed(0)
        mods: list[Any] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        return torch.nn.Sequential(*mods)

    g = torch.Generator().manual_seed(1 + comm.Get_rank())
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    nbytes = sum(p.numel() * p.element_size() for p in make().parameters())

    def step_of(model: Any, opt: Any) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return step

    cases: list[Case] = []
    closers: list[Callable[[], None]] = []
    gloo = None
    skipped: dict[str, str] = {}
    nothing = lambda: None  # noqa: E731
    try:
        if "compute" in methods:
            model = make()
            cases.append(Case("compute", nothing, step_of(model, torch.optim.SGD(model.parameters(), lr=1e-3,
                                                                                   momentum=0.9))))
        if "ddp-gloo" in methods:
            if gloo_usable(comm):
                gloo = Gloo(comm)
                model = make()
                ddp = torch.nn.parallel.DistributedDataParallel(model)
                cases.append(Case("ddp-gloo", nothing, step_of(ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3,
                                                                                      momentum=0.9)),
                                  _same_everywhere(comm, model)))

                def drop_ddp() -> None:  # gloo's worker must be idle before DDP goes (torch 2.13 deadlocks)
                    gloo.dist.barrier()
                    time.sleep(0.2)
                closers.append(drop_ddp)
            else:
                skipped["ddp-gloo"] = "torch with gloo is not importable on every rank"
        for name, progress in (("optimizer", "deferred"), ("optimizer-overlap", "thread")):
            if name not in methods:
                continue
            if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                skipped[name] = "MPI did not grant MPI_THREAD_MULTIPLE"
                continue
            model = make()
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), group=comm,
                                       progress=progress)
            closers.append(opt.free)
            cases.append(Case(name, nothing, step_of(model, opt), _same_everywhere(comm, model)))
        times = time_cases(comm, cases, reps, warmup, meter)
        sent = meter.per_call([c.name for c in cases]) if meter is not None else {}
    finally:
        for close in reversed(closers):
            close()
        if gloo is not None:
            gloo.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    out: dict[str, Any] = {
        "layers": layers, "width": width, "batch": batch, "bytes": nbytes, "ranks": comm.Get_size(),
        "methods": {name: {"median_ms": med[name] * 1e3, "min_ms": min(t) * 1e3, "times_ms": [v * 1e3 for v in t]}
                    for name, t in times.items()},
        "skipped": skipped,
    }
    if meter is not None:
        out["network"] = figures(meter.hosts, nbytes, link_rate, {name: m * 1e3 for name, m in med.items()}, sent)
    for key, (a, b) in {"optimizer_over_ddp": ("optimizer", "ddp-gloo"),
                        "overlap_over_ddp": ("optimizer-overlap", "ddp-gloo"),
                        "overlap_over_optimizer": ("optimizer-overlap", "optimizer")}.items():
        if a in med and b in med:
            out[key] = med[a] / med[b]
    return out


def format_step(res: dict[str, Any]) -> str:
    """The table of :func:`bench_step`'s results."""
    lines = [f"torch-optimizer: {res['layers']} x Linear({res['width']}, {res['width']}) float32 "
             f"({res['bytes'] / 1e6:.1f} MB of gradients), batch {res['batch']} per rank, {res['ranks']} ranks",
             f"  {'method':<20}{'median ms':>11}{'min ms':>10}"]
    for name, m in res["methods"].items():
        lines.append(f"  {name:<20}{m['median_ms']:>11.1f}{m['min_ms']:>10.1f}")
    lines.extend(f"  {name:<20}skipped: {why}" for name, why in res["skipped"].items())
    labels = {"optimizer_over_ddp": "optimizer / ddp-gloo", "overlap_over_ddp": "optimizer-overlap / ddp-gloo",
              "overlap_over_optimizer": "optimizer-overlap / optimizer"}
    lines.extend(f"  {label} = {res[key]:.2f}" for key, label in labels.items() if key in res)
    if "network" in res:
        lines.extend(network_lines(res["network"]))
    return "\n".join(lines)


def _parser(rank: int = 0) -> argparse.ArgumentParser:
    p = RankParser(prog="python -m mpi_gradreducer.bench torch-optimizer",
                   description="Time a torch training step with DistributedOptimizer against DistributedDataParallel "
                               "over gloo. Run under mpiexec; only rank 0 prints.", rank=rank)
    p.add_argument("--layers", type=int, default=13, help="Linear layers (default 13)")
    p.add_argument("--width", type=int, default=1024, help="their width (default 1024: 54.6 MB of gradients at 13)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="default: all")
    add_shared_options(p, reps=7)
    add_network_options(p)
    p.add_argument("--json", metavar="PATH", help="write the results and the environment to PATH")
    return p


def _check(args: argparse.Namespace) -> str | None:
    if min(args.layers, args.width, args.batch) < 1:
        return f"--layers, --width and --batch must be >= 1, got {args.layers}, {args.width}, {args.batch}"
    return None


def main(argv: Sequence[str] | None = None, comm: MPI.Intracomm | None = None) -> dict[str, Any]:
    """Run the comparison; rank 0 prints the table (and writes ``--json``).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: the communicator (default ``MPI.COMM_WORLD``).

    Returns:
        The results of :func:`bench_step` and the environment; the same on every rank.

    Raises:
        SystemExit: on every rank alike, for ``--help`` and bad options.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args, comm, say = start(_parser, argv, comm, _check)
    try:
        results: dict[str, Any] = {"environment": environment(comm, "mpi_gradreducer.bench torch-optimizer", argv)}
        results["step"] = bench_step(comm, args.layers, args.width, args.batch, args.methods, args.reps,
                                     args.warmup, NicMeter(comm, args.nics), args.link_rate)
        results["environment"]["loadavg_at_end"] = loadavg()
        say(format_step(results["step"]))
        if args.json and comm.Get_rank() == 0:
            write_json(args.json, results)
        return results
    finally:
        comm.Free()


if __name__ == "__main__":
    run_as_script(main, "bench torch-optimizer")

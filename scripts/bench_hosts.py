#!/usr/bin/env python3
"""The host benchmark across a cluster of hosts at several link rates, and a plot of time per call against rate.

As root (it makes a cluster of network namespaces with ``scripts/cluster.py``)::

    python scripts/bench_hosts.py                                # 2 hosts x 2 ranks, resnet50, 0.5/1/2/5 Gbit/s
    python scripts/bench_hosts.py --hosts 4 --ppn 1 --workload bert-base --reps 5 \\
        --rates 1gbit,10gbit --out out/bert --plot out/bert/rates.png

It runs under the MPI of the Python that runs it (``cluster.py`` starts the
``mpiexec`` beside it: MPICH's, Open MPI's or Intel MPI's; the summary names
it). It brings one cluster up (``--name``, default ``bhosts``), and for each rate
reshapes every host's NIC (``cluster.py rate``), then runs
``python -m mpi_gradreducer.bench --workload W --link-rate RATE --json ...``
across the hosts (MPI over TCP through the NICs), for the methods ``limit``
(the raw-MPI limit at its fastest chunk size), ``reducer``,
``reducer-fp16``, ``reducer-powersgd`` (``--powersgd-rank``, default 4) and
``torch-gloo`` (DDP-like; where torch imports). The cluster is taken down at
the end, also on a failure or an interruption.

It writes, under ``--out`` (default ``out/bench_hosts``): each rate's
results file (``rate-RATE.json``, as the benchmark's ``--json`` writes it),
``summary.json`` (per rate, per method: median time per call, its multiple
of the wire bound, the busiest host's NIC bytes per call and their multiple
of the ring optimum; the load average before and after each run) and the plot (``--plot``, default
``OUT/bench_hosts.png``): time per call against link rate, one line per
method, and the wire bound ``2 (H - 1) / H * gradient bytes / rate``. It
prints every run's tables as they come and a summary at the end. ``--no-run``
summarises and plots the results files already under ``--out``. See
:mod:`mpi_gradreducer.bench.network` for what the byte counters count.

Exit status: 0 when every rate ran; 1 when some run failed (the others are
still summarised); 2 for bad arguments; 3 where no cluster can be made here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mpi4py

mpi4py.rc.initialize = False  # this process only launches jobs: no MPI here
mpi4py.rc.finalize = False

from mpi_gradreducer import jobs  # noqa: E402
from mpi_gradreducer.bench.network import format_ms, format_rate, parse_link_rate  # noqa: E402
from mpi_gradreducer.bench.output import bytes_label, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster.py"
RATES = ("0.5gbit", "1gbit", "2gbit", "5gbit")
METHODS = ("limit", "reducer", "reducer-fp16", "reducer-powersgd", "torch-gloo")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_hosts.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="hosts of the cluster (default 2)")
    p.add_argument("--ppn", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--workload", default="resnet50", help="the benchmark's workload (default resnet50)")
    p.add_argument("--rates", default=",".join(RATES),
                   help=f"link rates, comma-separated (default {','.join(RATES)})")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default {','.join(METHODS)})")
    p.add_argument("--powersgd-rank", type=int, default=4, help="the rank of reducer-powersgd (default 4)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per method (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one rate's run may take (default 600)")
    p.add_argument("--name", default="bhosts", help="the cluster's name (default bhosts)")
    p.add_argument("--out", default="out/bench_hosts", help="directory of the results (default out/bench_hosts)")
    p.add_argument("--plot", help="the PNG to write (default OUT/bench_hosts.png)")
    p.add_argument("--no-run", action="store_true",
                   help="make no cluster: summarise and plot the results files of an earlier run under --out")
    args = p.parse_args(argv)
    try:
        args.rate_list = [(text, parse_link_rate(text)) for text in args.rates.split(",") if text]
    except ValueError as exc:
        p.error(str(exc).replace("--link-rate", "--rates"))
    if not args.rate_list:
        p.error("--rates: expected at least one rate")
    args.method_list = [m for m in args.methods.split(",") if m]
    if args.hosts < 2 or args.ppn < 1 or args.reps < 1 or args.warmup < 0:
        p.error(f"expected --hosts >= 2, --ppn >= 1, --reps >= 1 and --warmup >= 0, got {args.hosts}, {args.ppn}, "
                f"{args.reps} and {args.warmup}")
    args.plot = args.plot or os.path.join(args.out, "bench_hosts.png")
    return args


def cluster(name: str, *args: str, timeout: float = 120) -> int:
    """``cluster.py --name NAME ARGS``, its output passed through; its exit status.

    Interrupted (or past ``timeout``), it is sent SIGTERM first, so that it kills the job it runs (a
    ``run``) before it goes; killed only if it has not gone 30 s later (:func:`mpi_gradreducer.jobs.run`).
    """
    done = jobs.run([sys.executable, str(CLUSTER), "--name", name, *args], timeout=timeout, capture=False, grace=30)
    if done.timed_out:
        print(f"bench_hosts: `cluster.py {' '.join(args[:1])}` ran past {timeout:g} s", file=sys.stderr, flush=True)
        return 124
    return done.returncode


def bench_command(args: argparse.Namespace, rate: str, path: str) -> list[str]:
    return [sys.executable, "-m", "mpi_gradreducer.bench", "--workload", args.workload,
            "--methods", *args.method_list, "--powersgd-rank", str(args.powersgd_rank), "--link-rate", rate,
            "--reps", str(args.reps), "--warmup", str(args.warmup), "--json", path]


def run_rates(args: argparse.Namespace) -> dict[str, str]:
    """Each rate's run on a cluster brought up here and taken down after; the results file of each that ran."""
    first = args.rate_list[0][0]
    status = cluster(args.name, "up", "--hosts", str(args.hosts), "--rate", first)
    if status != 0:
        raise SystemExit(status)
    done: dict[str, str] = {}
    try:
        for text, _ in args.rate_list:
            if cluster(args.name, "rate", text) != 0:
                print(f"bench_hosts: could not set the rate {text}; skipped", file=sys.stderr, flush=True)
                continue
            path = os.path.join(args.out, f"rate-{text}.json")
            if os.path.exists(path):
                os.remove(path)
            print(f"== {args.hosts} hosts x {args.ppn} ranks at {text}", flush=True)
            status = cluster(args.name, "run", "--ppn", str(args.ppn), "--timeout", f"{args.timeout:g}", "--",
                             *bench_command(args, text, path), timeout=args.timeout + 60)
            if status == 0 and os.path.exists(path):
                done[text] = path
            else:
                print(f"bench_hosts: the run at {text} failed (exit status {status})", file=sys.stderr, flush=True)
    finally:
        cluster(args.name, "down")
    return done


def summarise(args: argparse.Namespace, done: dict[str, str]) -> dict[str, Any]:
    """One row per rate that ran, from its results file."""
    out: dict[str, Any] = {"workload": args.workload, "hosts": args.hosts, "ppn": args.ppn, "reps": args.reps,
                           "rates": []}
    for text, path in done.items():
        with open(path) as f:
            results = json.load(f)
        res = results["workloads"][args.workload]
        net = res["network"]
        out["gradient_bytes"] = net["gradient_bytes"]
        out["ring_bytes"] = net["ring_bytes"]
        env = results["environment"]
        out["mpi"] = env.get("mpi_vendor")
        out["rates"].append({"rate": text, "link_rate_bps": net["link_rate_bps"],
                             "wire_bound_ms": net["wire_bound_ms"], "hosts_measured": net["hosts"],
                             "limit_chunk": res.get("limit_chunk"), "skipped": res.get("skipped", {}),
                             "loadavg": [env.get("loadavg_at_start"), env.get("loadavg_at_end")],
                             "methods": net["methods"], "file": path})
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(summary: dict[str, Any]) -> str:
    """Per method and rate: median ms (x wire bound), and MB sent per call by the busiest host (x ring optimum)."""
    rows = summary["rates"]
    methods: list[str] = []
    for r in rows:
        methods += [m for m in r["methods"] if m not in methods]
    width = 22
    head = f"{'':<18}" + "".join(f"{format_rate(r['link_rate_bps']):>{width}}" for r in rows)
    lines = [f"{summary['workload']}: {bytes_label(summary['gradient_bytes'])} of gradients, {summary['hosts']} "
             f"hosts x {summary['ppn']} ranks, {summary.get('mpi') or 'MPI'}, {summary['reps']} reps; ring optimum "
             f"{bytes_label(int(summary['ring_bytes']))} sent per host and call",
             "time per call, ms (x wire bound)", head,
             f"{'wire bound':<18}" + "".join(f"{format_ms(r['wire_bound_ms']):>{width}}" for r in rows)]
    for name in methods:
        cells = []
        for r in rows:
            m = r["methods"].get(name)
            cells.append(f"{m['median_ms']:.1f} ({_fmt(m['x_wire'], '.2f')})" if m else "-")
        lines.append(f"{name:<18}" + "".join(f"{c:>{width}}" for c in cells))
    lines += ["sent per call by the busiest host's NICs (x ring optimum; x own optimum)", head]
    for name in methods:
        cells = []
        for r in rows:
            m = r["methods"].get(name)
            if not m or m["busiest_bytes"] is None:
                cells.append("-")
                continue
            own = f"; {m['x_own']:.2f}" if m.get("x_own") is not None else ""
            cells.append(f"{bytes_label(int(m['busiest_bytes']))} ({_fmt(m['x_ring'], '.2f')}{own})")
        lines.append(f"{name:<18}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.no_run:
        paths = {text: os.path.join(args.out, f"rate-{text}.json") for text, _ in args.rate_list}
        done = {text: path for text, path in paths.items() if os.path.exists(path)}
    else:
        done = run_rates(args)
    if not done:
        print("bench_hosts: no results" + (f" under {args.out}" if args.no_run else ": no run succeeded"),
              file=sys.stderr)
        return 1
    summary = summarise(args, done)
    path = os.path.join(args.out, "summary.json")
    write_json(path, summary)
    print(table(summary), flush=True)
    from mpi_gradreducer.bench.plot import plot_rates

    plot_rates(args.plot, summary)
    print(f"wrote {path} and {args.plot}", flush=True)
    return 0 if len(done) == len(args.rate_list) else 1


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGHUP, _interrupted)
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        print("bench_hosts: interrupted (the cluster is down)", file=sys.stderr)
        sys.exit(130)

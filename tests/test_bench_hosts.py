"""The bench across hosts on a real cluster: NIC bytes per call against the ring optimum, ``cluster.py rate``.

Each test makes its own cluster with ``scripts/cluster.py`` (network
namespaces, MPI over TCP through each host's NIC). Like ``test_hosts.py``,
these need root and network namespaces (skipped where ``cluster.py check``
says they are not available) and run from a single process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clusters import ROOT, cli, job_env, leftovers, new_name, new_tag
from conftest import cluster_unavailable

BENCH_HOSTS = ROOT / "scripts" / "bench_hosts.py"


UNAVAILABLE = cluster_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))]


def qdisc(name: str, tag: str, host: int) -> str:
    done = cli(name, "exec", str(host), "--", "tc", "qdisc", "show", "dev", "eth0", "root", tag=tag)
    assert done.returncode == 0, done
    return done.stdout


def test_the_bench_counts_the_reducers_ring_bytes_and_prints_the_wire_bound(tmp_path: Path):
    """The bench's NIC figures: the reducer sends the ring's bytes (the documentation's claim; of MPI's own
    Allreduce, the limit, only that its bytes are counted), and no method beats the wire bound of the shaped
    links (a bound computed too high would be beaten)."""
    name, tag = new_name("b"), new_tag()
    path = tmp_path / "bench.json"
    try:
        done = cli(name, "run", "--hosts", "2", "--ppn", "2", "--rate", "5gbit", "--timeout", "100", "--",
                   sys.executable, "-m", "mpi_gradreducer.bench", "--workload", "many-small",
                   "--small-count", "8", "--small-size", "131072", "--methods", "limit", "reducer",
                   "--link-rate", "5gbit", "--reps", "2", "--warmup", "1", "--json", str(path), tag=tag, timeout=130)
    finally:
        cli(name, "down", tag=tag)
    assert done.returncode == 0 and "still ran" not in done.stderr, done.stdout + done.stderr
    assert not leftovers(name, tag), leftovers(name, tag)
    # 4.2 MB between 2 hosts at 5 Gbit/s: every host sends 4.2 MB, 6.71 ms on the wire
    assert ("across hosts (2 hosts x 2 ranks): every host sends at least 2(H-1)/H x 4.2 MB = 4.2 MB per call "
            "(the ring optimum); at 5 Gbit/s the wire bound is 6.71 ms") in done.stdout, done.stdout
    net = json.loads(path.read_text())["workloads"]["many-small"]["network"]
    assert net["hosts"] == 2 and net["ranks_per_host"] == [2, 2] and net["ring_bytes"] == 8 * 131072 * 4
    reducer, limit = net["methods"]["reducer"], net["methods"]["limit"]
    assert len(reducer["host_bytes"]) == 2 and all(0.95 <= b / net["ring_bytes"] <= 1.05
                                                   for b in reducer["host_bytes"]), reducer
    assert len(limit["host_bytes"]) == 2 and all(b > 0 for b in limit["host_bytes"]), limit
    assert reducer["x_wire"] > 0.9 and limit["x_wire"] > 0.9, net  # nothing goes faster than the link
    for method in ("limit", "reducer"):  # the table prints what the file holds
        line = re.search(rf"^  {method}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) MB\s+([\d.]+)\s+-$", done.stdout, re.M)
        assert line and float(line[4]) == pytest.approx(net["methods"][method]["x_ring"], abs=0.006), done.stdout


def test_cluster_rate_reshapes_every_host_and_none_unshapes():
    name, tag = new_name("b"), new_tag()
    try:
        made = cli(name, "up", "--hosts", "2", "--rate", "1gbit", tag=tag)
        assert made.returncode == 0, made
        assert all(re.match(r"qdisc tbf \S+: root .*rate 1Gbit ", qdisc(name, tag, h)) for h in (1, 2))
        done = cli(name, "rate", "2.5gbit", tag=tag)
        assert done.returncode == 0 and f"cluster {name}: rate 2.5gbit on hosts 1, 2" in done.stdout, done
        assert all(re.match(r"qdisc tbf \S+: root .*rate 2500Mbit ", qdisc(name, tag, h)) for h in (1, 2))
        assert cli(name, "rate", "none", tag=tag).returncode == 0
        assert not any("tbf" in qdisc(name, tag, h) for h in (1, 2))
        assert cli(name, "rate", "none", tag=tag).returncode == 0  # unshaped already: nothing to remove
        assert cli(name, "rate", "500mbit", tag=tag).returncode == 0
        assert all(re.match(r"qdisc tbf \S+: root .*rate 500Mbit ", qdisc(name, tag, h)) for h in (1, 2))
        bad = cli(name, "rate", "fast", tag=tag)
        assert bad.returncode == 2 and "--rate: expected a rate such as 1gbit" in bad.stderr, bad
        assert all("rate 500Mbit" in qdisc(name, tag, h) for h in (1, 2))
    finally:
        cli(name, "down", tag=tag)
    assert not leftovers(name, tag), leftovers(name, tag)
    down = cli(name, "rate", "1gbit", tag=tag)
    assert down.returncode == 1 and f"cluster '{name}' is not up" in down.stderr, down


def test_bench_hosts_runs_each_rate_plots_and_takes_its_cluster_down(tmp_path: Path):
    name, tag = new_name("b"), new_tag()
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(BENCH_HOSTS), "--name", name, "--workload", "small",
                           "--rates", "1gbit,5gbit", "--methods", "limit,reducer", "--reps", "1", "--warmup", "0",
                           "--out", str(out), "--timeout", "100"],
                          capture_output=True, text=True, timeout=280, cwd=ROOT, env=job_env(tag))
    assert not leftovers(name, tag), leftovers(name, tag)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [r["rate"] for r in summary["rates"]] == ["1gbit", "5gbit"]
    assert [r["wire_bound_ms"] for r in summary["rates"]] == pytest.approx([38440 * 8 / 1e9 * 1e3,
                                                                              38440 * 8 / 5e9 * 1e3])
    assert all(set(r["methods"]) == {"limit", "reducer"} for r in summary["rates"])
    assert (out / "bench_hosts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "time per call, ms (x wire bound)" in done.stdout and "sent per call by the busiest host" in done.stdout
    again = subprocess.run([sys.executable, str(BENCH_HOSTS), "--no-run", "--workload", "small", "--rates",
                            "1gbit,5gbit,2gbit", "--out", str(out), "--plot", str(tmp_path / "again.png")],
                           capture_output=True, text=True, timeout=60, cwd=ROOT, env=job_env(tag))
    assert again.returncode == 1, again  # no results at 2gbit
    assert re.search(r"^wire bound\s+0\.308\s+0\.0615$", again.stdout, re.M), again.stdout
    assert (tmp_path / "again.png").exists() and not leftovers(name, tag)


def test_bench_hosts_refuses_a_bad_rate_and_makes_no_cluster():
    name, tag = new_name("b"), new_tag()
    done = subprocess.run([sys.executable, str(BENCH_HOSTS), "--name", name, "--rates", "1gbit,lots"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=job_env(tag))
    assert done.returncode == 2 and "--rates: expected a positive rate such as 1gbit" in done.stderr, done
    assert not leftovers(name, tag), leftovers(name, tag)

"""The bench across hosts on a real cluster: NIC bytes per call against the ring optimum, ``cluster.py rate``.

Each test makes its own cluster with ``scripts/cluster.py`` (network
namespaces, MPI over TCP through each host's NIC). Like ``test_hosts.py``,
these need root and network namespaces (skipped where ``cluster.py check``
says they are not available) and run from a single process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from itertools import count
from pathlib import Path

import pytest

from conftest import cluster_unavailable

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster.py"
BENCH_HOSTS = ROOT / "scripts" / "bench_hosts.py"


UNAVAILABLE = cluster_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.hosts, pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))]

_names = count()


def _name() -> str:
    return f"b{os.getpid() % 10000}n{next(_names)}"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "MPI_GRADREDUCER_", "MPI4PY_"))
           and k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def cluster_cli(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLUSTER), "--name", name, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_env())


def leftovers(name: str) -> list[str]:
    """Namespaces and interfaces of cluster ``name`` still on this machine."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    return ([line.split()[0] for line in spaces.splitlines() if line.startswith(f"{name}-")]
            + re.findall(rf"\d+: ({re.escape(name)}-\w+)", links))


def qdisc(name: str, host: int) -> str:
    done = cluster_cli(name, "exec", str(host), "--", "tc", "qdisc", "show", "dev", "eth0", "root")
    assert done.returncode == 0, done
    return done.stdout


def test_limit_sends_about_the_ring_optimum_and_the_wire_bound_is_printed(tmp_path: Path):
    name = _name()
    path = tmp_path / "bench.json"
    try:
        done = cluster_cli(name, "run", "--hosts", "2", "--ppn", "2", "--rate", "5gbit", "--timeout", "100", "--",
                           sys.executable, "-m", "mpi_gradreducer.bench", "--workload", "many-small",
                           "--small-count", "8", "--small-size", "131072", "--methods", "limit", "reducer",
                           "--link-rate", "5gbit", "--reps", "2", "--warmup", "1", "--json", str(path),
                           timeout=130)
    finally:
        cluster_cli(name, "down")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not leftovers(name), leftovers(name)
    # 4.2 MB between 2 hosts at 5 Gbit/s: every host sends 4.2 MB, 6.71 ms on the wire
    assert ("across hosts (2 hosts x 2 ranks): every host sends at least 2(H-1)/H x 4.2 MB = 4.2 MB per call "
            "(the ring optimum); at 5 Gbit/s the wire bound is 6.71 ms") in done.stdout, done.stdout
    net = json.loads(path.read_text())["workloads"]["many-small"]["network"]
    assert net["hosts"] == 2 and net["ranks_per_host"] == [2, 2] and net["ring_bytes"] == 8 * 131072 * 4
    limit = net["methods"]["limit"]
    assert len(limit["host_bytes"]) == 2 and all(b > 0 for b in limit["host_bytes"]), limit
    assert 0.9 <= limit["x_ring"] <= 1.3, limit
    assert limit["x_wire"] == pytest.approx(limit["median_ms"] / net["wire_bound_ms"])
    assert limit["x_wire"] > 0.9, limit  # nothing goes faster than the link
    line = re.search(r"^  limit\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) MB\s+([\d.]+)\s+-$", done.stdout, re.M)
    assert line and float(line[4]) == pytest.approx(limit["x_ring"], abs=0.006), done.stdout


def test_cluster_rate_reshapes_every_host_and_none_unshapes():
    name = _name()
    try:
        made = cluster_cli(name, "up", "--hosts", "2", "--rate", "1gbit")
        assert made.returncode == 0, made
        assert all(re.match(r"qdisc tbf \S+: root .*rate 1Gbit ", qdisc(name, h)) for h in (1, 2))
        done = cluster_cli(name, "rate", "2.5gbit")
        assert done.returncode == 0 and f"cluster {name}: rate 2.5gbit on hosts 1, 2" in done.stdout, done
        assert all(re.match(r"qdisc tbf \S+: root .*rate 2500Mbit ", qdisc(name, h)) for h in (1, 2))
        assert cluster_cli(name, "rate", "none").returncode == 0
        assert not any("tbf" in qdisc(name, h) for h in (1, 2))
        assert cluster_cli(name, "rate", "none").returncode == 0  # unshaped already: nothing to remove
        assert cluster_cli(name, "rate", "500mbit").returncode == 0
        assert all(re.match(r"qdisc tbf \S+: root .*rate 500Mbit ", qdisc(name, h)) for h in (1, 2))
        bad = cluster_cli(name, "rate", "fast")
        assert bad.returncode == 2 and "--rate: expected a rate such as 1gbit" in bad.stderr, bad
        assert all("rate 500Mbit" in qdisc(name, h) for h in (1, 2))
    finally:
        cluster_cli(name, "down")
    assert not leftovers(name), leftovers(name)
    down = cluster_cli(name, "rate", "1gbit")
    assert down.returncode == 1 and f"cluster '{name}' is not up" in down.stderr, down


def test_bench_hosts_runs_each_rate_plots_and_takes_its_cluster_down(tmp_path: Path):
    name = _name()
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(BENCH_HOSTS), "--name", name, "--workload", "small",
                           "--rates", "1gbit,5gbit", "--methods", "limit,reducer", "--reps", "1", "--warmup", "0",
                           "--out", str(out), "--timeout", "100"],
                          capture_output=True, text=True, timeout=280, cwd=ROOT, env=_env())
    assert not leftovers(name), leftovers(name)
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
                           capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    assert again.returncode == 1, again  # no results at 2gbit
    assert re.search(r"^wire bound\s+0\.308\s+0\.0615$", again.stdout, re.M), again.stdout
    assert (tmp_path / "again.png").exists() and not leftovers(name)


def test_bench_hosts_refuses_a_bad_rate_and_makes_no_cluster():
    name = _name()
    done = subprocess.run([sys.executable, str(BENCH_HOSTS), "--name", name, "--rates", "1gbit,lots"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    assert done.returncode == 2 and "--rates: expected a positive rate such as 1gbit" in done.stderr, done
    assert not leftovers(name)

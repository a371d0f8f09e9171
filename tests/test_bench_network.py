"""The bench across hosts on one host: link rates, the wire bound, NIC counters, the host count, the table."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, everywhere
from mpi_gradreducer import bench
from mpi_gradreducer.bench import network


@pytest.mark.parametrize("text, bps", [
    ("1gbit", 1e9), ("500mbit", 5e8), ("2.5gbit", 2.5e9), ("100kbit", 1e5), ("1000bit", 1e3), ("0.5gbit", 5e8),
    (" 1GBit ", 1e9), ("1tbit", 1e12), (".5gbit", 5e8),
])
def test_link_rates_in_tc_spelling(text: str, bps: float):
    assert network.parse_link_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["fast", "", "1", "gbit", "0gbit", "-1gbit", "1 gbit/s", "1gbps", "1e9bit",
                                  "1.2.3gbit", "nan", "inf"])
def test_nonsense_rates_are_refused_naming_what_came(text: str):
    expected = ("--link-rate: expected a positive rate such as 1gbit, 500mbit or 2.5gbit (units bit, kbit, mbit, gbit, "
                f"tbit), got {text!r}")
    with pytest.raises(ValueError, match=re.escape(expected)):
        network.parse_link_rate(text)


@pytest.mark.parametrize("bps, label", [(1e9, "1 Gbit/s"), (5e8, "500 Mbit/s"), (2.5e9, "2.5 Gbit/s"),
                                        (1e5, "100 kbit/s"), (10.0, "10 bit/s")])
def test_rates_are_labelled(bps: float, label: str):
    assert network.format_rate(bps) == label


def test_ring_bytes_and_wire_bound():
    assert network.ring_bytes(100e6, 1) == 0.0
    assert network.ring_bytes(100e6, 2) == 100e6
    assert network.ring_bytes(100e6, 4) == 150e6
    assert network.ring_bytes(0, 8) == 0.0
    # 100 MB between 2 hosts at 1 Gbit/s: 800 ms; 4 hosts: 1.2 s; at 500 Mbit/s twice as long
    assert network.wire_bound_seconds(100e6, 2, 1e9) == pytest.approx(0.8)
    assert network.wire_bound_seconds(100e6, 4, 1e9) == pytest.approx(1.2)
    assert network.wire_bound_seconds(100e6, 2, 5e8) == pytest.approx(1.6)
    assert network.wire_bound_seconds(100e6, 1, 1e9) == 0.0
    with pytest.raises(ValueError, match="hosts: expected at least 1, got 0"):
        network.ring_bytes(1, 0)
    with pytest.raises(ValueError, match="nbytes: expected at least 0, got -1"):
        network.ring_bytes(-1, 2)
    with pytest.raises(ValueError, match="bits_per_second: expected a positive rate, got 0"):
        network.wire_bound_seconds(1, 2, 0)


def test_figures_divide_by_the_wire_bound_and_the_ring_optimum():
    hosts = network.Hosts(count=2, index=0, leader=True, ranks_per_host=(2, 2))
    fig = network.figures(hosts, 100_000_000, 1e9, {"limit": 880.0, "fp16": 500.0},
                          {"limit": [101e6, 99e6], "fp16": [52e6, 51e6]}, {"fp16": 50_000_000})
    assert fig["wire_bound_ms"] == pytest.approx(800.0) and fig["ring_bytes"] == 100e6
    assert fig["methods"]["limit"]["x_wire"] == pytest.approx(1.1)
    assert fig["methods"]["limit"]["busiest_bytes"] == 101e6 and fig["methods"]["limit"]["x_ring"] == 1.01
    assert fig["methods"]["limit"]["x_own"] is None
    assert fig["methods"]["fp16"]["x_ring"] == pytest.approx(0.52) and fig["methods"]["fp16"]["x_own"] == 1.04
    lines = network.format_lines(fig)
    assert "2(H-1)/H x 100.0 MB = 100.0 MB per call (the ring optimum); at 1 Gbit/s the wire bound is 800 ms" \
        in lines[0]
    assert lines[2].split() == ["limit", "880.00", "1.10", "101.0", "MB", "1.01", "-"]
    no_rate = network.figures(hosts, 100, None, {"limit": 1.0}, {})
    assert no_rate["wire_bound_ms"] is None and no_rate["methods"]["limit"]["x_wire"] is None
    assert "no --link-rate: no wire bound" in network.format_lines(no_rate)[0]
    one = network.Hosts(count=1, index=0, leader=True, ranks_per_host=(4,))
    assert network.format_lines(network.figures(one, 100, 1e9, {"limit": 1.0}, {})) == [
        "  across hosts (1 host x 4 ranks, 1 Gbit/s): wire bound 0: one host, nothing crosses a link; "
        "no NIC bytes counted"]


def _interface(root: Path, name: str, kind: int, sent: int | None) -> None:
    (root / name / "statistics").mkdir(parents=True)
    (root / name / "type").write_text(f"{kind}\n")
    if sent is not None:
        (root / name / "statistics" / "tx_bytes").write_text(f"{sent}\n")


def test_counters_sum_every_interface_but_the_loopback(tmp_path: Path):
    _interface(tmp_path, "lo", 772, 10**9)
    _interface(tmp_path, "eth0", 1, 1000)
    _interface(tmp_path, "eth1", 1, 234)
    _interface(tmp_path, "odd", 1, None)
    names = network.interfaces(root=str(tmp_path))
    assert names == ["eth0", "eth1", "odd"]
    assert network.tx_bytes(names, root=str(tmp_path)) == 1234
    assert network.interfaces(["eth1"], root=str(tmp_path)) == ["eth1"]
    with pytest.raises(ValueError, match="--nics: no interface wlan9 here; there are eth0, eth1, lo, odd"):
        network.interfaces(["eth1", "wlan9"], root=str(tmp_path))


#: The hosts of the launch: ``scripts/cluster.py`` tells the ranks (the code under test finds them by itself).
LAUNCH_HOSTS = int(os.environ.get("CLUSTER_HOSTS", "1"))


@pytest.mark.mpi(min_size=2)
def test_counters_count_what_each_host_sends():
    """Across hosts: the first rank sends 4 MiB to a rank of the next host; the counters its host's leader
    reads grow by that (plus headers), those of the receiving host by its acknowledgements only."""
    if not everywhere(LAUNCH_HOSTS > 1):
        pytest.skip("one host: no NIC between the ranks (run under scripts/cluster.py run --hosts 2 or more)")
    hosts = network.host_layout(WORLD)
    names = network.interfaces() if hosts.leader else []
    assert "lo" not in names
    first_of_next = WORLD.allgather(hosts.index).index(1)
    payload = np.ones(1 << 20, dtype=np.float32)
    WORLD.Barrier()
    before = network.tx_bytes(names)
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        WORLD.Send(payload, dest=first_of_next)
    elif WORLD.Get_rank() == first_of_next:
        WORLD.Recv(payload, source=0)
    WORLD.Barrier()
    grown = np.zeros(hosts.count)
    if hosts.leader:
        grown[hosts.index] = network.tx_bytes(names) - before
    WORLD.Allreduce(MPI.IN_PLACE, grown, op=MPI.SUM)
    assert payload.nbytes <= grown[0] <= 1.05 * payload.nbytes, grown
    assert grown[1] <= 0.05 * payload.nbytes, grown


@pytest.mark.mpi
def test_the_hosts_found_are_those_of_the_launch():
    hosts = network.host_layout(WORLD)
    assert hosts.count == LAUNCH_HOSTS
    assert hosts.ranks_per_host == (WORLD.Get_size() // LAUNCH_HOSTS,) * LAUNCH_HOSTS
    assert WORLD.allreduce(int(hosts.leader), op=MPI.SUM) == LAUNCH_HOSTS
    assert sorted(set(WORLD.allgather(hosts.index))) == list(range(LAUNCH_HOSTS))


@pytest.mark.mpi
def test_the_meter_counts_each_host_across_hosts_and_nothing_on_one():
    meter = network.NicMeter(WORLD)
    buf = np.ones(1 << 18, dtype=np.float32)  # 1 MiB
    for _ in range(2):
        meter.before(0)
        WORLD.Allreduce(MPI.IN_PLACE, buf)
        meter.after(0)
    sent = meter.per_call(["allreduce", "never run"])
    assert meter.active == (LAUNCH_HOSTS > 1)
    if LAUNCH_HOSTS == 1:
        assert sent == {}
    else:
        assert list(sent) == ["allreduce"] and len(sent["allreduce"]) == LAUNCH_HOSTS
        assert all(b >= network.ring_bytes(buf.nbytes, LAUNCH_HOSTS) * 0.9 for b in sent["allreduce"]), sent


@pytest.mark.mpi
def test_a_run_with_a_link_rate_gives_the_wire_bound_or_says_nothing_crosses_a_link(capsys):
    res = bench.main(["--workload", "small", "--methods", "limit", "reducer", "reducer-fp16", "--reps", "1",
                      "--warmup", "0", "--link-rate", "2.5gbit"], comm=WORLD)
    out, _ = capsys.readouterr()
    net = res["workloads"]["small"]["network"]
    assert net["hosts"] == LAUNCH_HOSTS and net["link_rate_bps"] == 2.5e9
    assert set(net["methods"]) == {"limit", "reducer", "reducer-fp16"}
    assert math.isclose(res["settings"]["link_rate"], 2.5e9)
    if LAUNCH_HOSTS == 1:
        assert net["wire_bound_ms"] == 0.0
        assert all(m["busiest_bytes"] is None and m["x_wire"] is None for m in net["methods"].values())
        expected = (f"across hosts (1 host x {WORLD.Get_size()} ranks, 2.5 Gbit/s): wire bound 0: one host, nothing "
                    "crosses a link; no NIC bytes counted")
    else:
        assert net["wire_bound_ms"] == pytest.approx(network.wire_bound_seconds(38440, LAUNCH_HOSTS, 2.5e9) * 1e3)
        assert all(m["busiest_bytes"] > 0 and m["x_wire"] > 0 for m in net["methods"].values())
        expected = "at 2.5 Gbit/s the wire bound is"
    if WORLD.Get_rank() == 0:
        assert expected in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("argv", [["--link-rate", "fast"], ["compression", "--link-rate", "1 gbit"],
                                  ["torch-optimizer", "--link-rate", "0mbit"]])
def test_a_nonsense_link_rate_is_a_usage_error_on_every_rank(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv, comm=WORLD)
    _, err = capsys.readouterr()
    assert exc.value.code == 2
    if WORLD.Get_rank() == 0:
        assert "argument --link-rate: expected a positive rate such as 1gbit, 500mbit or 2.5gbit" in err
    else:
        assert err == ""

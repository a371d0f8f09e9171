"""``python -m mpi_gradreducer.info``: the facts are right and the report prints."""

from __future__ import annotations

import io
import json
import os
import re

import numpy as np
import pytest
from mpi4py import MPI

import mpi_gradreducer
from mpi_gradreducer import info

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("which", ["world", "self", "split"])
def test_collect_counts_ranks_hosts_and_nodes(which: str) -> None:
    if which == "world":
        comm = WORLD
    elif which == "self":
        comm = MPI.COMM_SELF
    else:
        comm = WORLD.Split(WORLD.Get_rank() % 2, WORLD.Get_rank())
    try:
        facts = info.collect(comm)
        size, rank = comm.Get_size(), comm.Get_rank()
        assert facts["ranks"] == size
        assert facts["rank"] == rank
        assert sorted(r for ranks in facts["hosts"].values() for r in ranks) == list(range(size))
        assert MPI.Get_processor_name() in facts["hosts"]
        assert rank in facts["hosts"][MPI.Get_processor_name()]
        assert sum(facts["ranks_per_node"]) == size
        assert facts["nodes"] == len(facts["ranks_per_node"]) >= 1
        # Every rank of a shared-memory node counts the same node size.
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        assert node.Get_size() in facts["ranks_per_node"]
        node.Free()
        assert facts["mpi_gradreducer"] == mpi_gradreducer.__version__
        assert facts["numpy"] == np.__version__
        assert facts["mpi_standard"] == "{}.{}".format(*MPI.Get_version())
        assert facts["thread_level"].startswith("MPI_THREAD_")
        assert facts["cuda_aware"] in (True, False, None) and facts["cuda_aware_source"]
        # ULFM: Open MPI 5 has it, MPICH 5 and Intel MPI do not; enabled only under mpiexec --with-ft ulfm
        assert facts["ulfm"] == (MPI.get_vendor()[0] == "Open MPI"), facts["mpi_vendor"]
        assert facts["ulfm_enabled"] == (None if not facts["ulfm"] else
                                         os.environ.get("OMPI_MCA_mpi_ft_enable") in ("1", "true"))
        # the suite runs each MPI from its own venv: the mpiexec beside this Python is of this library
        assert facts["launcher_matches"] is True, (facts["launcher"], facts["mpi_vendor"])
        assert facts["launcher"].startswith(MPI.get_vendor()[0]), facts["launcher"]
        json.dumps(facts)  # plain values only
    finally:
        if which == "split":
            comm.Free()


def test_main_prints_one_screen_on_rank_0_only() -> None:
    out = io.StringIO()
    assert info.main([], out=out) == 0
    text = out.getvalue()
    if WORLD.Get_rank() == 0:
        for label in ("mpi_gradreducer", "MPI library", "MPI standard", "thread level", "ULFM", "launcher",
                      "CUDA-aware MPI", "cupy", "ranks per node"):
            assert label in text
        assert re.search(rf"^ranks\s+{WORLD.Get_size()}$", text, re.MULTILINE)
    else:
        assert text == ""


def test_main_json_round_trips() -> None:
    out = io.StringIO()
    info.main(["--json"], out=out)
    if WORLD.Get_rank() == 0:
        assert json.loads(out.getvalue())["ranks"] == WORLD.Get_size()
    else:
        assert out.getvalue() == ""


def test_main_writes_to_stdout_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    info.main([])
    captured = capsys.readouterr()
    assert ("MPI vendor" in captured.out) == (WORLD.Get_rank() == 0)
    assert captured.err == ""

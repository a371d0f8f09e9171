"""The benchmarks' command line under MPI: one rank prints, every rank exits alike; the subcommands."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conftest import WORLD, run_job
from mpi_gradreducer import bench
from mpi_gradreducer.bench import cli, compression, gpu, host

ROOT = Path(__file__).resolve().parents[1]


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv, comm=WORLD)
    return exc.value.code


@pytest.mark.mpi
@pytest.mark.parametrize("argv", [["--help"], ["gpu", "--help"], ["compression", "--help"],
                                  ["torch-optimizer", "--help"]])
def test_help_prints_on_rank_0_only_and_every_rank_exits_0(capsys, argv):
    code = _exit_code(argv)
    out, err = capsys.readouterr()
    assert code == 0
    if WORLD.Get_rank() == 0:
        assert out.startswith("usage: python -m mpi_gradreducer.bench") and err == ""
    else:
        assert (out, err) == ("", "")


@pytest.mark.mpi
@pytest.mark.parametrize("argv", [["--reps", "0"], ["--scale", "0"], ["--workload", "resnet18"],
                                  ["gpu", "--reps", "0"], ["compression", "--modes", "zip"],
                                  ["torch-optimizer", "--layers", "0"]])
def test_bad_options_are_one_error_on_rank_0_and_status_2_everywhere(capsys, argv):
    code = _exit_code(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    if WORLD.Get_rank() == 0:
        assert err.count("error:") == 1
    else:
        assert err == ""


@pytest.mark.mpi
def test_ranks_that_parse_differently_still_exit_alike():
    last = WORLD.Get_size() - 1
    argv = ["--reps", "0"] if WORLD.Get_rank() == last else ["--reps", "3"]
    with pytest.raises(SystemExit) as exc:
        cli.parse(host._parser(WORLD.Get_rank()), argv, WORLD, cli.check_shared)
    assert exc.value.code == 2
    args = cli.parse(host._parser(WORLD.Get_rank()), ["--reps", "3"], WORLD, cli.check_shared)
    assert args.reps == 3


def test_registry_names_importable_benchmarks():
    assert list(bench.COMMANDS) == ["host", "gpu", "compression", "torch-optimizer", "horovod"]
    assert bench.DEFAULT_COMMAND == "host"
    for name, (module, about) in bench.COMMANDS.items():
        assert callable(importlib.import_module(f"mpi_gradreducer.bench.{module}").main), name
        assert name in bench.describe_commands() and about in bench.describe_commands()
    assert bench._command(["gpu", "--reps", "2"]) == ("gpu", ["--reps", "2"])
    assert bench._command(["--scale", "0.5"]) == ("host", ["--scale", "0.5"])
    assert bench._command([]) == ("host", [])


def test_the_gpu_benchmark_has_one_entry_point():
    assert importlib.util.find_spec("mpi_gradreducer.bench_gpu") is None  # the old shim is gone
    assert bench.COMMANDS["gpu"][0] == "gpu" and callable(gpu.main)
    assert compression.MODES[0] == "none"


@pytest.mark.slow
@pytest.mark.parametrize("module, args, status, marker", [
    ("mpi_gradreducer.bench", ["--help"], 0, "usage:"),
    ("mpi_gradreducer.bench", ["gpu", "--bogus"], 2, "error: unrecognized arguments: --bogus"),
])
def test_module_under_mpiexec_prints_once(module, args, status, marker):
    job = run_job(module, *args, ranks=2, runner=False, module=True, limit=120)
    assert job.returncode == status, str(job)
    assert job.output.count(marker) == 1, str(job)

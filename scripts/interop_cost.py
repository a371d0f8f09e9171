"""What ingesting torch CPU tensors costs: per object by route, and per reducer call.

``python scripts/interop_cost.py`` times, in one process with timeit, each
candidate way of viewing one torch tensor of 1024 float32 as a numpy array.
Under ``mpiexec -n N`` it then times the reducer on ResNet-50-shaped and on
1000 small gradients, given as numpy arrays and as torch tensors (new
tensors every call, as after ``zero_grad()``), interleaved, medians.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpi_gradreducer import DistributedGradReducer
from mpi_gradreducer._core import interop
from mpi_gradreducer.bench import many_small, resnet50


def per_object() -> None:
    t = torch.ones(1024)
    tb = torch.ones(1024, dtype=torch.bfloat16)
    candidates = {
        "np.from_dlpack(t)": lambda: np.from_dlpack(t),
        "np.from_dlpack(t, copy=False)": lambda: np.from_dlpack(t, copy=False),
        "np.asarray(t) (via __array__)": lambda: np.asarray(t),
        "t.__array__()": lambda: t.__array__(),
        "hasattr(t, '__array_interface__')": lambda: hasattr(t, "__array_interface__"),
        "interop._capsule_view(t) (ctypes parse)": lambda: interop._capsule_view(t),
        "interop.view(t)": lambda: interop.view(t),
        "interop.view(bfloat16 t)": lambda: interop.view(tb),
    }
    for name, fn in candidates.items():
        fn()
        best = min(timeit.repeat(fn, number=5000, repeat=7)) / 5000
        print(f"{name:44s} {best * 1e6:6.2f} us")


def _cases(reducer: DistributedGradReducer, arrays: list[np.ndarray],
           tensors: list[Any]) -> dict[str, Callable[[], object]]:
    return {
        "numpy": lambda: reducer(arrays),
        "torch (new tensors)": lambda: reducer([torch.empty_like(t) for t in tensors]),
        "torch (same tensors)": lambda: reducer(tensors),
        "alloc new tensors only": lambda: [torch.empty_like(t) for t in tensors],
    }


def per_call(comm: MPI.Comm, reps: int = 15) -> None:
    for wl in (resnet50(), many_small()):
        arrays = [np.ones(s, d) for s, d in zip(wl.shapes, wl.dtypes, strict=True)]
        tensors = [torch.from_numpy(a.copy()) for a in arrays]
        with DistributedGradReducer(arrays, group=comm) as reducer:
            cases = _cases(reducer, arrays, tensors)
            times: dict[str, list[float]] = {k: [] for k in cases}
            for _ in range(3):
                for fn in cases.values():
                    fn()
            for _ in range(reps):
                for name, fn in cases.items():
                    comm.Barrier()
                    t0 = MPI.Wtime()
                    fn()
                    dt = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
                    times[name].append(dt)
        if comm.Get_rank() == 0:
            med = {k: float(np.median(v)) for k, v in times.items()}
            base = med["numpy"]
            new = med["torch (new tensors)"] - med["alloc new tensors only"]
            print(f"{wl.name} ({len(arrays)} tensors), {comm.Get_size()} ranks: numpy {base * 1e3:.2f} ms, "
                  f"torch same tensors {med['torch (same tensors)'] * 1e3:.2f} ms "
                  f"({med['torch (same tensors)'] / base - 1:+.1%}), torch new tensors {new * 1e3:.2f} ms "
                  f"net of allocation ({new / base - 1:+.1%})")


if __name__ == "__main__":
    world = MPI.COMM_WORLD
    if world.Get_rank() == 0:
        per_object()
    per_call(world)

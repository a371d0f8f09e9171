"""Horovod's settings (``HOROVOD_*`` environment variables): read in one place, once, by ``hvd.init()``.

:data:`VARIABLES` lists every variable of Horovod's torch/MPI path and what
this module does with it: honoured, not applicable (a warning says why, and
it is ignored), or refused (``hvd.init()`` raises, saying why).
:class:`Settings` holds what the engine honours; :meth:`Settings.from_environment`
parses and checks every variable, naming it, what was expected and what came.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .._core.options import DEFAULT_TIMEOUT, TIMEOUT_ENV

__all__ = ["Settings", "VARIABLES", "HONOURED", "NOT_APPLICABLE", "REFUSED", "FUSION_THRESHOLD", "CYCLE_TIME",
           "STALL_CHECK_TIME"]

HONOURED, NOT_APPLICABLE, REFUSED = "honoured", "not applicable", "refused"
_NO_AUTOTUNE = "no autotuning: HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME are used as set"
_NO_LOG = "no log of its own: errors are raised, stall warnings printed to stderr"
_BUILT = ("chosen when Horovod is built; here device tensors go through host memory and MPI")
_LAUNCHER = "set by horovodrun's gloo launcher; here the ranks come from MPI (start with mpiexec)"
_GLOO = "gloo is not supported: only MPI here (start with mpiexec -n N python -m mpi4py script.py)"
#: Every ``HOROVOD_*`` variable of Horovod's torch/MPI path: (what this module does, what it means here or why).
#: ``HOROVOD_CPU_OPERATIONS`` and ``HOROVOD_CONTROLLER`` are honoured as ``MPI`` and refused otherwise.
VARIABLES: Mapping[str, tuple[str, str]] = MappingProxyType({
    "HOROVOD_FUSION_THRESHOLD": (HONOURED, "bytes of one fusion buffer (default 128 MiB; 0: no fusion)"),
    "HOROVOD_CYCLE_TIME": (HONOURED, "milliseconds the engine collects requests before it negotiates them "
                                     "(default 1; sooner when the caller waits for a handle)"),
    "HOROVOD_DISABLE_GROUP_FUSION": (HONOURED, "1: a grouped call's tensors are not fused with other operations'"),
    "HOROVOD_HIERARCHICAL_ALLREDUCE": (HONOURED, "unset or 1: two levels where the ranks span hosts with as many "
                                                 "on each (the package's summers); 0: flat, in rank order"),
    "HOROVOD_STALL_CHECK_DISABLE": (HONOURED, "1: no stall warning"),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": (HONOURED, "seconds before the missing ranks are named (default 60)"),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": (HONOURED, "seconds before a stall ends every rank's operations with "
                                                      "HorovodInternalError (default 0: never)"),
    "HOROVOD_CPU_OPERATIONS": (HONOURED, "MPI (the only choice here); GLOO or CCL are refused"),
    "HOROVOD_CONTROLLER": (HONOURED, "MPI (the only choice here); GLOO is refused"),
    "HOROVOD_TIMELINE": (NOT_APPLICABLE, "start the timeline with hvd.start_timeline(path) after hvd.init()"),
    "HOROVOD_TIMELINE_MARK_CYCLES": (NOT_APPLICABLE, "pass mark_cycles=True to hvd.start_timeline()"),
    "HOROVOD_CACHE_CAPACITY": (NOT_APPLICABLE, "no response cache: a plain verdict already travels as its name "
                                               "alone"),
    "HOROVOD_AUTOTUNE": (NOT_APPLICABLE, _NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_LOG": (NOT_APPLICABLE, _NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": (NOT_APPLICABLE, _NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": (NOT_APPLICABLE, _NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": (NOT_APPLICABLE, _NO_AUTOTUNE),
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": (NOT_APPLICABLE, _NO_AUTOTUNE),
    "HOROVOD_LOG_LEVEL": (NOT_APPLICABLE, _NO_LOG),
    "HOROVOD_LOG_HIDE_TIMESTAMP": (NOT_APPLICABLE, _NO_LOG),
    "HOROVOD_HIERARCHICAL_ALLGATHER": (NOT_APPLICABLE, "allgather is one MPI Allgatherv, without levels"),
    "HOROVOD_MPI_THREADS_DISABLE": (NOT_APPLICABLE, "mpi4py initializes MPI (MPI_THREAD_MULTIPLE by default), "
                                                    "not this module"),
    "HOROVOD_THREAD_AFFINITY": (NOT_APPLICABLE, "the engine is a Python thread of the rank's process: bind the "
                                                "process instead (mpiexec -bind-to core)"),
    "HOROVOD_DYNAMIC_PROCESS_SETS": (NOT_APPLICABLE, "process sets can always be added and removed after "
                                                     "hvd.init()"),
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": (NOT_APPLICABLE, "no Adasum (op=hvd.Adasum raises NotImplementedError)"),
    "HOROVOD_NUM_NCCL_STREAMS": (NOT_APPLICABLE, "no NCCL: " + _BUILT),
    "HOROVOD_BATCH_D2D_MEMCOPIES": (NOT_APPLICABLE, "no device fusion buffers: " + _BUILT),
    "HOROVOD_ENABLE_ASYNC_COMPLETION": (NOT_APPLICABLE, "no device streams: " + _BUILT),
    "HOROVOD_GPU_OPERATIONS": (NOT_APPLICABLE, _BUILT),
    "HOROVOD_GPU_ALLREDUCE": (NOT_APPLICABLE, _BUILT),
    "HOROVOD_GPU_ALLGATHER": (NOT_APPLICABLE, _BUILT),
    "HOROVOD_GPU_BROADCAST": (NOT_APPLICABLE, _BUILT),
    "HOROVOD_GPU_ALLTOALL": (NOT_APPLICABLE, _BUILT),
    "HOROVOD_GPU_REDUCESCATTER": (NOT_APPLICABLE, _BUILT),
    "HOROVOD_ELASTIC": (NOT_APPLICABLE, "hvd.elastic.run works under Open MPI's ULFM without it"),
    "HOROVOD_HOSTNAME": (NOT_APPLICABLE, _LAUNCHER),
    "HOROVOD_RANK": (NOT_APPLICABLE, _LAUNCHER),
    "HOROVOD_SIZE": (NOT_APPLICABLE, _LAUNCHER),
    "HOROVOD_LOCAL_RANK": (NOT_APPLICABLE, _LAUNCHER),
    "HOROVOD_LOCAL_SIZE": (NOT_APPLICABLE, _LAUNCHER),
    "HOROVOD_CROSS_RANK": (NOT_APPLICABLE, _LAUNCHER),
    "HOROVOD_CROSS_SIZE": (NOT_APPLICABLE, _LAUNCHER),
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": (REFUSED, _GLOO),
    "HOROVOD_GLOO_RENDEZVOUS_PORT": (REFUSED, _GLOO),
    "HOROVOD_GLOO_TIMEOUT_SECONDS": (REFUSED, _GLOO),
})

#: Horovod's default fusion threshold (bytes): 128 MiB.
FUSION_THRESHOLD = 128 << 20
#: Horovod's default cycle time (seconds): 1 ms.
CYCLE_TIME = 1e-3
#: Horovod's default stall warning (seconds).
STALL_CHECK_TIME = 60.0


@dataclass(frozen=True)
class Settings:
    """What the engine of ``mpi_gradreducer.horovod`` honours of Horovod's settings.

    Attributes:
        fusion_threshold: ``HOROVOD_FUSION_THRESHOLD``: the most bytes of one
            fusion buffer (0: every tensor is reduced alone).
        cycle_time: ``HOROVOD_CYCLE_TIME`` (milliseconds there, seconds here):
            how long the engine collects requests before it negotiates them
            (sooner when the caller waits for a handle).
        stall_check: ``HOROVOD_STALL_CHECK_TIME_SECONDS``: after how long the
            coordinator names the ranks that have not submitted a tensor; None
            with ``HOROVOD_STALL_CHECK_DISABLE=1``.
        stall_shutdown: ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``: after how
            long such a stall ends the job with an error on every rank; None
            (Horovod's 0): never.
        hierarchical: ``HOROVOD_HIERARCHICAL_ALLREDUCE`` (unset: False, as in
            Horovod): sums in two levels where the ranks span hosts (see the
            core's ``Summers``); else flat, in rank order.
        group_fusion: False with ``HOROVOD_DISABLE_GROUP_FUSION=1``: a
            grouped call's tensors are not fused with other operations'.
        ignored: one warning per variable set that does not apply here.
        timeout: the package's watchdog timeout (``MPI_GRADREDUCER_TIMEOUT``,
            seconds or ``none``; default 1800): a fused reduction that takes
            longer ends the job, naming the ranks it waits for, as the reducer's do.
    """

    fusion_threshold: int = FUSION_THRESHOLD
    cycle_time: float = CYCLE_TIME
    stall_check: float | None = STALL_CHECK_TIME
    stall_shutdown: float | None = None
    hierarchical: bool = False
    group_fusion: bool = True
    ignored: tuple[str, ...] = ()
    timeout: float | None = DEFAULT_TIMEOUT

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings that ``environ`` (default ``os.environ``) asks for.

        Raises:
            ValueError: a variable whose value is not a number of the kind it
                takes, naming the variable, what it takes and what came; a
                refused variable, saying why.
        """
        env = os.environ if environ is None else environ
        ignored = []
        for name in sorted(n for n in env if n in VARIABLES):
            verdict, why = VARIABLES[name]
            value = env[name]
            if name in ("HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER"):
                if value.strip().lower() not in ("", "mpi"):
                    raise ValueError(f"{name}: expected MPI, got {value!r}: {_GLOO}")
            elif verdict == REFUSED:
                raise ValueError(f"{name}={value!r} is refused: {why}")
            elif verdict == NOT_APPLICABLE:
                ignored.append(f"{name}={value!r} is not applicable to mpi_gradreducer.horovod and is ignored: {why}")
        threshold = _number(env, "HOROVOD_FUSION_THRESHOLD", FUSION_THRESHOLD, integer=True)
        cycle = _number(env, "HOROVOD_CYCLE_TIME", CYCLE_TIME * 1e3) / 1e3
        check = _number(env, "HOROVOD_STALL_CHECK_TIME_SECONDS", STALL_CHECK_TIME)
        shutdown = _number(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0)
        disabled = _flag(env, "HOROVOD_STALL_CHECK_DISABLE")
        hierarchical = _flag(env, "HOROVOD_HIERARCHICAL_ALLREDUCE")
        timeout: float | None = None
        if env.get(TIMEOUT_ENV, "").strip().lower() != "none":
            timeout = _number(env, TIMEOUT_ENV, DEFAULT_TIMEOUT) or None
        return cls(int(threshold), cycle, None if disabled or check == 0 else check, shutdown or None, hierarchical,
                   not _flag(env, "HOROVOD_DISABLE_GROUP_FUSION"), tuple(ignored), timeout)


def _number(env: Mapping[str, str], name: str, default: float, integer: bool = False) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(int(text)) if integer else float(text)
    except ValueError:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise ValueError(f"{name}: expected {kind}, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name}: expected a finite non-negative number, got {text!r}")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    text = env.get(name, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}: expected 0 or 1, got {text!r}")

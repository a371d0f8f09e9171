"""The reducer's options, resolved once: argument checks, environment variables, the cross-rank signature."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from . import agreement, backend, compression as wire, interop, planning, transport
from .blas import share_of_cores
from .dtypes import SUPPORTED_NAMES, dtype_code
from .planning import ParamSpec
from .powersgd import PowerSGD
from .topology import Topology

__all__ = [
    "ABORT_ON_EXCEPTION_ENV",
    "agree",
    "CUDA_AWARE_ENV",
    "DEFAULT_STALL_WARNING",
    "STALL_WARNING_ENV",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT",
    "DIRECT_BYTES",
    "FIRST_BUCKET_BYTES",
    "Options",
    "TIMELINE_ENV",
    "TIMEOUT_ENV",
    "cuda_aware_default",
    "decide_progress",
    "describe_row",
    "param_specs",
    "positive",
    "resolve",
    "signature",
    "stall_warning_default",
]

#: Cap on a fused bucket. See docs/performance.rst for the measurement.
DEFAULT_BUCKET_BYTES = 4 << 20
#: Parameters from this size up travel alone and, when contiguous, are reduced
#: in place without a copy: packing them costs more than a separate message.
DIRECT_BYTES = 1 << 20
#: Cap on the first bucket (in backward order), so that overlapped
#: communication starts early, as PyTorch DDP does.
FIRST_BUCKET_BYTES = 1 << 20
#: Default watchdog timeout in seconds (torch.distributed's default), unless
#: the environment variable below says otherwise.
DEFAULT_TIMEOUT = 1800.0
TIMEOUT_ENV = "MPI_GRADREDUCER_TIMEOUT"
#: Default for ``timeline``: a file name, used when the argument is not given.
TIMELINE_ENV = "MPI_GRADREDUCER_TIMELINE"
#: Overrides the detected CUDA-awareness of the MPI library ("0" or "1").
CUDA_AWARE_ENV = "MPI_GRADREDUCER_CUDA_AWARE"
#: Default ``stall_warning`` in seconds, unless the environment variable below says otherwise.
DEFAULT_STALL_WARNING = 60.0
STALL_WARNING_ENV = "MPI_GRADREDUCER_STALL_WARNING"
#: Set to ``0`` to leave ``sys.excepthook`` alone while reducers exist.
ABORT_ON_EXCEPTION_ENV = "MPI_GRADREDUCER_ABORT_ON_EXCEPTION"

VALIDATE_MODES = ("always", "first", "never")
PROGRESS_MODES = ("auto", "thread", "deferred")


@dataclass(frozen=True)
class Options:
    """Every option of a reducer, checked, with the environment's defaults applied.

    Attributes:
        mean: divide the sums by ``degree``.
        degree: the divisor of the mean.
        fixed_degree: ``degree`` was given; otherwise a call divides by the
            number of ranks that contributed to it (all, until some join).
        ids: one fusion id per parameter.
        skip: one flag per parameter: leave that gradient alone.
        bucket_bytes: the cap on a fused bucket; None for ``"auto"``.
        validate: ``"always"``, ``"first"`` or ``"never"``.
        timeout: seconds before the watchdog aborts; None: never.
        stall_warning: seconds before the waiting ranks name the missing ones; None: never.
        abort_on_exception: an uncaught exception aborts the job while the reducer exists.
        check_finite: find NaN/Inf on every call.
        cuda_aware: hand device buffers straight to MPI.
        timeline: the trace file rank 0 writes at ``free()``, or None.
        compression: ``"fp16"``, ``"bf16"`` or None (the 16-bit wire formats).
        predivide: the compression's pre-division factor, or None (its default).
        coalesce: sort and sum the rows of reduced ``RowSparse`` gradients.
        progress: ``"auto"``, ``"thread"`` or ``"deferred"`` (as asked; the
            reducer decides ``"auto"`` collectively).
        powersgd: the low-rank compression (``compression=PowerSGD(...)``), or None.
        deterministic: every element of every dense bucket is summed in rank
            order, ``((g0 + g1) + g2) + ...``, whatever the buckets and chunks.
    """

    mean: bool
    degree: int
    fixed_degree: bool
    ids: tuple[int, ...]
    skip: tuple[bool, ...]
    bucket_bytes: int | None
    validate: str
    timeout: float | None
    stall_warning: float | None
    abort_on_exception: bool
    check_finite: bool
    cuda_aware: bool
    timeline: str | None
    compression: str | None
    predivide: float | None
    coalesce: bool
    progress: str
    powersgd: PowerSGD | None = None
    deterministic: bool = False

    def divisor(self, contributors: int) -> int:
        """The divisor of a mean over ``contributors`` ranks."""
        return self.degree if self.fixed_degree else max(1, contributors)


def positive(name: str, value: Any, *, integer: bool = False, none: bool = False, also: str = "") -> Any:
    """``value`` if it is a positive int (or number), else ``ValueError`` naming ``name``.

    Args:
        name: the argument, for the message.
        value: what came.
        integer: only ints are accepted (bools never are).
        none: None is accepted too.
        also: text naming the other accepted values, for the message.
    """
    if value is None and none:
        return None
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        what = "a positive int" if integer else "a positive number of seconds"
        raise ValueError(f"{name}: expected {what}{also}, got {value!r}")
    return int(value) if integer else float(value)


def param_specs(parameters: Iterable[Any]) -> tuple[ParamSpec, ...]:
    """Shape, dtype and device of each parameter (any iterable of arrays of any library).

    Raises:
        TypeError: a parameter that is not an array, or of an unsupported dtype.
    """
    specs = []
    for i, p in enumerate(parameters):
        described = interop.describe(p)  # any array by protocol; torch Parameters that require grad too
        if described is None:
            raise TypeError(f"parameters[{i}]: expected a numpy or cupy array, got {interop.explain(p)}; "
                            "any array with __dlpack__, __array_interface__ or __cuda_array_interface__ will do")
        shape, dtype, device = described
        if dtype_code(dtype) < 0:
            raise TypeError(f"parameters[{i}]: dtype {dtype} is not supported; expected one of "
                            + ", ".join(SUPPORTED_NAMES) + " (bfloat16: that of ml_dtypes)")
        specs.append(ParamSpec(tuple(shape), np.dtype(dtype), device))
    return tuple(specs)


def resolve(
    specs: Sequence[ParamSpec],
    size: int,
    *,
    mean: Any,
    degree: Any,
    fusion_type: Any,
    fusion: Any,
    split_indices: Any,
    bucket_bytes: Any,
    skip: Any,
    validate: Any,
    timeout: Any,
    check_finite: Any,
    cuda_aware: Any,
    timeline: Any,
    compression: Any,
    predivide: Any,
    coalesce: Any,
    progress: Any,
    stall_warning: Any = "env",
    deterministic: Any = False,
) -> Options:
    """Check every argument of ``DistributedGradReducer`` and apply the defaults (local).

    Args:
        specs: the parameters.
        size: the number of ranks of the group.
        mean, degree, fusion_type, fusion, split_indices, bucket_bytes, skip, validate, timeout,
            check_finite, cuda_aware, timeline, compression, predivide, coalesce, progress,
            stall_warning, deterministic: the constructor's arguments, as given.

    Raises:
        ValueError, TypeError: naming the argument, what was expected and what came.
    """
    if not isinstance(mean, (bool, np.bool_)):
        raise TypeError(f"mean: expected a bool, got {type(mean).__name__} {mean!r}")
    fixed_degree = degree is not None
    degree = size if degree is None else positive("degree", degree, integer=True)
    ids = planning.fusion_ids(len(specs), fusion_type, fusion, split_indices)
    skip = [False] * len(specs) if skip is None else list(skip)
    if len(skip) != len(specs):
        raise ValueError(f"skip: expected {len(specs)} bools (one per parameter), got {len(skip)}")
    compression, powersgd = _split_compression(compression)
    _check_compression(specs, size, degree, bool(mean), compression, predivide)
    if not (isinstance(bucket_bytes, str) and bucket_bytes == "auto"):
        bucket_bytes = positive("bucket_bytes", bucket_bytes, integer=True, also=" or 'auto'")
    if validate not in VALIDATE_MODES:
        raise ValueError(f"validate: expected one of {VALIDATE_MODES}, got {validate!r}")
    if isinstance(timeout, str) and timeout == "env":
        timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    timeout = positive("timeout", timeout, none=True, also=" or None")
    if isinstance(stall_warning, str) and stall_warning == "env":
        stall_warning = stall_warning_default()
    stall_warning = positive("stall_warning", stall_warning, none=True, also=" or None")
    if progress not in PROGRESS_MODES:
        raise ValueError(f"progress: expected one of {PROGRESS_MODES}, got {progress!r}")
    if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ValueError("progress='thread' needs MPI_THREAD_MULTIPLE, which MPI did not grant")
    if timeline is not None and not isinstance(timeline, (str, os.PathLike)):
        raise TypeError(f"timeline: expected a file name or None, got {type(timeline).__name__} {timeline!r}")
    if cuda_aware is not None and not isinstance(cuda_aware, (bool, np.bool_)):
        raise TypeError(f"cuda_aware: expected a bool or None, got {type(cuda_aware).__name__} {cuda_aware!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__} {deterministic!r}")
    if deterministic:
        devices = [i for i, s in enumerate(specs) if not backend.is_host(s.device)]
        if devices:
            raise ValueError(f"deterministic=True: expected host parameters only, got parameters[{devices[0]}] on "
                             f"{specs[devices[0]].device}; device buckets are summed by MPI in its own order")
    if cuda_aware is None and any(not backend.is_host(s.device) for s in specs):
        cuda_aware = bool(cuda_aware_default()[0])
    return Options(
        mean=bool(mean), degree=degree, fixed_degree=fixed_degree, ids=tuple(ids), skip=tuple(bool(s) for s in skip),
        bucket_bytes=None if bucket_bytes == "auto" else bucket_bytes, validate=validate, timeout=timeout,
        stall_warning=stall_warning, abort_on_exception=os.environ.get(ABORT_ON_EXCEPTION_ENV, "1").strip() != "0",
        check_finite=bool(check_finite), cuda_aware=bool(cuda_aware),
        timeline=os.fspath(timeline) if timeline is not None else os.environ.get(TIMELINE_ENV),
        compression=compression, predivide=None if predivide is None else float(predivide),
        coalesce=bool(coalesce), progress=progress, powersgd=powersgd, deterministic=bool(deterministic),
    )


def agree(comm: MPI.Intracomm, parameters: Iterable[Any],
          kwargs: dict[str, Any]) -> tuple[tuple[ParamSpec, ...], Options]:
    """The parameters' specs and the options, checked locally, then agreed by every rank (collective).

    Raises:
        ValueError, TypeError: on every rank, when any rank's arguments are bad or differ from rank 0's.
    """
    error: Exception | None = None
    specs: tuple[ParamSpec, ...] = ()
    options: Options | None = None
    try:
        specs = param_specs(parameters)
        options = resolve(specs, comm.Get_size(), **kwargs)
    except (ValueError, TypeError) as exc:
        error = exc
    agreement.raise_if_any(comm, error)
    assert options is not None  # else some rank's error was raised on every rank
    agreement.check_same(comm, signature(options, specs), describe_row,
                         lambda i: f"parameter {i - 1}" if i else "the configuration")
    return specs, options


def stall_warning_default() -> float | None:
    """``MPI_GRADREDUCER_STALL_WARNING`` (seconds, or ``none``), else 60.

    Raises:
        ValueError: the environment variable is neither a positive number nor ``none``.
    """
    text = os.environ.get(STALL_WARNING_ENV)
    if text is None:
        return DEFAULT_STALL_WARNING
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{STALL_WARNING_ENV}: expected a positive number of seconds or 'none', got {text!r}")
    return value


def decide_progress(comm: MPI.Intracomm, topology: Topology, asked: str) -> str:
    """The progress mode (collective): ``"auto"`` takes a thread only where every rank has a spare core.

    Args:
        comm: the reducer's communicator.
        topology: its hosts.
        asked: the ``progress`` option.

    Returns:
        ``"thread"`` or ``"deferred"``, the same on every rank.
    """
    if asked != "auto":
        return asked
    multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    spare = np.array([int(multiple and share_of_cores(topology.local_size) >= 2)], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, spare, op=MPI.MIN)
    return "thread" if spare[0] else "deferred"


def _split_compression(compression: Any) -> tuple[Any, PowerSGD | None]:
    """``(wire format name or None, PowerSGD or None)`` from ``compression``; refuses them combined."""
    if isinstance(compression, PowerSGD):
        return None, compression
    if isinstance(compression, (list, tuple, set)) and any(isinstance(c, PowerSGD) for c in compression):
        raise ValueError(f"compression: PowerSGD cannot be combined with another compression (fp16/bf16), "
                         f"got {compression!r}; its P and Q travel in the gradients' own dtype")
    if isinstance(compression, type) and issubclass(compression, PowerSGD):
        raise TypeError("compression: expected a PowerSGD instance, got the class; write PowerSGD(...)")
    return compression, None


def _check_compression(specs: Sequence[ParamSpec], size: int, degree: int, mean: bool, compression: Any,
                       predivide: Any) -> None:
    """Raise unless ``compression`` and ``predivide`` fit the parameters."""
    try:
        comp = wire.get_compression(compression)
    except ImportError as exc:
        raise ValueError(str(exc)) from exc
    if comp is not None:
        if any(not backend.is_host(s.device) for s in specs):
            raise TypeError("compression: works on host (numpy) gradients only; got device arrays")
        comp.scales(size, degree, mean, predivide)  # checks predivide
    elif predivide is not None:
        raise ValueError(f"predivide: only applies with compression='fp16' or 'bf16', got predivide={predivide!r}")


def cuda_aware_default() -> tuple[bool | None, str]:
    """Whether device buffers may go straight to MPI, and how we know.

    The environment variable ``MPI_GRADREDUCER_CUDA_AWARE`` (``0`` or ``1``)
    wins; otherwise the MPI library is asked (:func:`transport.cuda_support`).

    Returns:
        ``(answer, source)``: answer is None when nothing could tell.

    Raises:
        ValueError: the environment variable is neither 0 nor 1.
    """
    env = os.environ.get(CUDA_AWARE_ENV)
    if env is not None:
        if env.strip() not in ("0", "1"):
            raise ValueError(f"{CUDA_AWARE_ENV}: expected 0 or 1, got {env!r}")
        return env.strip() == "1", f"the environment variable {CUDA_AWARE_ENV}={env.strip()}"
    return transport.cuda_support()


#: The header's PowerSGD fields: whether it is on, then its options.
_POWERSGD_FIELDS = 1 + len(PowerSGD().signature())


def signature(options: Options, specs: Sequence[ParamSpec]) -> list[tuple[int, ...]]:
    """What every rank's reducer must have in common: one header row, one row per parameter."""
    cap = -1 if options.bucket_bytes is None else options.bucket_bytes
    kind = 0 if options.compression is None else 1 + wire.COMPRESSIONS.index(options.compression)
    predivide = 0.0 if options.predivide is None else options.predivide
    powersgd = (1, *options.powersgd.signature()) if options.powersgd is not None else (0,) * _POWERSGD_FIELDS
    header = (len(specs), cap, int(options.mean), options.degree, int(options.cuda_aware), kind,
              int(predivide * 1e6), PROGRESS_MODES.index(options.progress), int(options.fixed_degree),
              int(options.check_finite), int(options.coalesce), int(options.timeline is not None), *powersgd,
              int(options.deterministic))
    rows: list[tuple[int, ...]] = [header]
    for spec, fid, skip in zip(specs, options.ids, options.skip, strict=True):
        device_kind = 0 if backend.is_host(spec.device) else 1
        rows.append((dtype_code(spec.dtype), fid, int(skip), device_kind, len(spec.shape), *spec.shape))
    return rows


def describe_row(index: int, row: tuple[int, ...]) -> str:
    """A readable form of one row of :func:`signature`."""
    if index == 0:
        names = (None,) + wire.COMPRESSIONS
        return "(parameters={}, bucket_bytes={}, mean={}, degree={}, cuda_aware={}, ".format(*row[:5]) + \
            f"compression={names[row[5]]!r}, predivide={row[6] / 1e6:g}, progress={PROGRESS_MODES[row[7]]!r}, " \
            "degree given={}, check_finite={}, coalesce={}, timeline={}, ".format(*row[8:12]) + \
            _describe_powersgd(row[12:12 + _POWERSGD_FIELDS]) + f", deterministic={row[12 + _POWERSGD_FIELDS]})"
    dtype, fid, skip, device_kind, ndim, *shape = row
    return (
        f"shape {tuple(shape)} {SUPPORTED_NAMES[dtype]} on {'cpu' if device_kind == 0 else 'gpu'} "
        f"(fusion id {fid}{', skipped' if skip else ''})"
    )


def _describe_powersgd(values: Sequence[int]) -> str:
    """The PowerSGD part of the signature's first row, readable."""
    if not values or not values[0]:
        return "powersgd=None"
    rank, start, rate, feedback, warm, seed = values[1:7]
    return (f"powersgd=PowerSGD(rank={rank}, start_iter={start}, min_compression_rate={rate / 1e6:g}, "
            f"error_feedback={bool(feedback)}, warm_start={bool(warm)}, seed={seed})")

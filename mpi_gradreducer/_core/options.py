"""The reducer's options: declared once (:class:`Options`), checked once (:func:`resolve`), agreed by every rank.

Every front takes the same object: ``DistributedGradReducer(params,
options=...)``, the torch ``DistributedOptimizer`` and the Horovod module's
optimizer. Which options every rank must share, and how they are compared,
is read from the fields themselves (:func:`signature`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from . import agreement, backend, interop, planning, transport, wire
from .blas import share_of_cores
from .dtypes import SUPPORTED_NAMES, dtype_code
from .planning import DEFAULT_BUCKET_BYTES, ParamSpec
from .powersgd import PowerSGD
from .topology import Topology

__all__ = [
    "ABORT_ON_EXCEPTION_ENV",
    "CUDA_AWARE_ENV",
    "DEFAULT_STALL_WARNING",
    "DEFAULT_TIMEOUT",
    "Options",
    "STALL_WARNING_ENV",
    "TIMELINE_ENV",
    "TIMEOUT_ENV",
    "agree",
    "cuda_aware_default",
    "decide_progress",
    "param_specs",
    "positive",
    "resolve",
    "signature",
]

#: Default watchdog timeout in seconds (torch.distributed's default), unless the environment variable below says
#: otherwise.
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


def _agreed(key: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """The metadata of a field that every rank must give alike (``key``: what of it must agree)."""
    return {"agree": key or (lambda value: value)}


def _name(value: Any) -> str | None:
    """What of a callable option must agree: its qualified name (its address differs from rank to rank)."""
    return None if value is None else getattr(value, "__qualname__", type(value).__qualname__)


@dataclass(frozen=True)
class Options:
    """Every option of a reducer, in one immutable object.

    ``DistributedGradReducer(params, options=Options(compression="fp16"))``
    and ``DistributedGradReducer(params, compression="fp16")`` are the same;
    keywords given beside ``options`` replace its fields
    (:meth:`replace`). The torch and Horovod optimizers take the same object.
    Nothing is checked when it is made: the reducer checks every field once,
    on every rank, and raises on every rank when some rank's are bad
    (``resolve``); ``reducer.options`` holds them
    resolved (defaults of the environment applied), ready to build another
    reducer with the same options.

    Attributes:
        mean: multiply the sums by ``1 / degree``.
        degree: the divisor of the mean; None: the number of ranks that
            contribute to a call (all of them, until some ``join()``).
        fusion_type: fusion id of every parameter (0: never fused), unless
            ``fusion`` or ``split_indices`` is given.
        fusion: one fusion id per parameter.
        split_indices: inclusive end indices of consecutive fusion groups
            (MindSpore's ``all_reduce_fusion_config``).
        bucket_bytes: cap on a fused bucket, in bytes, or ``"auto"``: the
            first blocking calls try a few caps (512 KiB to 32 MiB), and the
            one that was fastest on the slowest rank is kept (the same on every
            rank). Call ``allocate_grads`` after that if you use it.
        skip: one bool per parameter; True leaves that gradient untouched
            (MindSpore's layer-wise-parallel and parameter-server parameters).
        validate: how much each rank checks its gradients before the ranks
            agree (always, in the call header, before any caller's array is
            modified): ``"always"`` everything on every call, including
            whether two gradients share memory; ``"first"`` that aliasing
            check on the first call only; ``"never"`` not at all.
        timeout: seconds a collective may take before the watchdog prints a
            diagnostic and aborts the job; None disables it; ``"env"``
            (default): the ``MPI_GRADREDUCER_TIMEOUT`` environment variable,
            else 1800.
        stall_warning: seconds a collective may wait before every waiting
            rank prints the ranks that have not arrived (``missing ranks: 2``)
            and what they are doing, and goes on waiting; None disables it;
            ``"env"`` (default): ``MPI_GRADREDUCER_STALL_WARNING`` (seconds or
            ``none``), else 60.
        abort_on_exception: while the reducer exists, an exception that
            escapes on one rank ends the whole job; ``"env"`` (default): True
            unless ``MPI_GRADREDUCER_ABORT_ON_EXCEPTION=0``.
        check_finite: find out on each call whether any rank's gradients held
            NaN or Inf (``reducer.nonfinite``).
        cuda_aware: for cupy arrays, hand device buffers straight to MPI
            (True) or stage them through pinned host buffers (False); None
            (default): ``MPI_GRADREDUCER_CUDA_AWARE``, else what the MPI
            library says (``python -m mpi_gradreducer.info``).
        timeline: a file name: record pack, allreduce and unpack of every
            bucket on every rank, and write them, merged by rank 0, as a Chrome
            trace-event file when the reducer is freed (Perfetto or
            ``chrome://tracing``). Default: ``MPI_GRADREDUCER_TIMELINE``.
        compression: ``"fp16"`` or ``"bf16"``: float32/float64 gradients
            travel as 16-bit floats, each rank summing one slice in float32
            (``"bf16"`` needs ``ml_dtypes``); a :class:`~mpi_gradreducer.PowerSGD`:
            large gradient matrices travel as low-rank products, with error
            feedback; None (default): no compression.
        predivide: with ``"fp16"``/``"bf16"``, divide by this factor before the
            sum and multiply after (default: the number of ranks for fp16, 1
            for bf16).
        coalesce: sort the rows of reduced ``RowSparse`` gradients and sum
            repeated rows.
        progress: how buckets launched by ``begin``/``reduce_async`` advance
            while the caller computes: ``"thread"``, on a communication thread
            (needs ``MPI_THREAD_MULTIPLE``); ``"deferred"``, all in ``wait()``;
            ``"auto"`` (default): a thread where MPI grants
            ``MPI_THREAD_MULTIPLE`` and every rank on a host has a core to
            spare for it, else deferred.
        deterministic: sum every element of the dense host buckets in rank
            order, ``((g0 + g1) + g2) + ...``, in the gradient's dtype
            (float32 for 16-bit floats), then scale it: the results are then
            bitwise the same whatever ``bucket_bytes``, fusion layout, bucket
            views or ordinary arrays, blocking or asynchronous call, and MPI
            library. Host parameters only.
        hook: a bucket hook, ``hook(bucket) -> None`` (PyTorch DDP's comm
            hooks): it is handed each bucket of each call as a
            :class:`~mpi_gradreducer.GradBucket` and leaves the bucket's sum
            across ranks, times ``bucket.scale``, in ``bucket.buffer``, on
            every rank alike (``bucket.reduce()`` is the reducer's own sum).
            Not with ``compression="fp16"``/``"bf16"``, which is such a hook.
        elsewhere: what else this process may wait in besides the reducer,
            for the stall diagnoses of the other ranks: a callable that returns
            one string per operation in progress (``["hvd.allreduce 'loss' in
            process set 0, submitted 61.0 s ago"]``). When a rank's collective
            stalls, the watchdogs it asks quote it for their rank, so that a
            rank waiting in the reducer while another waits in some other
            collective is named with both. Called on the watchdog's thread,
            only when a rank asks. A framework that runs collectives of its own
            beside the reducer passes it (``mpi_gradreducer.horovod`` does).
    """

    mean: bool = field(default=True, metadata=_agreed())
    degree: int | None = field(default=None, metadata=_agreed())
    fusion_type: int = 1
    fusion: Sequence[int] | None = None
    split_indices: Sequence[int] | None = None
    bucket_bytes: int | str = field(default=DEFAULT_BUCKET_BYTES, metadata=_agreed())
    skip: Sequence[bool] | None = None
    validate: str = "always"
    timeout: float | str | None = "env"
    stall_warning: float | str | None = "env"
    abort_on_exception: bool | str = "env"
    check_finite: bool = field(default=False, metadata=_agreed())
    cuda_aware: bool | None = field(default=None, metadata=_agreed())
    timeline: str | None = field(default=None, metadata=_agreed(lambda path: path is not None))
    compression: str | PowerSGD | None = field(default=None, metadata=_agreed())
    predivide: float | None = field(default=None, metadata=_agreed())
    coalesce: bool = field(default=False, metadata=_agreed())
    progress: str = field(default="auto", metadata=_agreed())
    deterministic: bool = field(default=False, metadata=_agreed())
    hook: Callable[[Any], None] | None = field(default=None, metadata=_agreed(_name))
    elsewhere: Callable[[], Sequence[str]] | None = None

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes``.

        Raises:
            TypeError: a name that is not an option (the message lists them).
        """
        unknown = sorted(set(changes) - _NAMES)
        if unknown:
            raise TypeError(f"unexpected option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                            f"the options are: {', '.join(sorted(_NAMES))}")
        return dataclasses.replace(self, **changes) if changes else self

    # -- what a resolved object tells (see resolve) ------------------------------------------------

    @property
    def ids(self) -> tuple[int, ...]:
        """The fusion id of each parameter (resolved options)."""
        assert self.fusion is not None, "options not resolved"
        return tuple(self.fusion)

    @property
    def skipped(self) -> tuple[bool, ...]:
        """Whether each parameter's gradient is left alone, one flag per parameter (resolved options)."""
        assert self.skip is not None, "options not resolved"
        return tuple(self.skip)

    @property
    def cap(self) -> int | None:
        """The cap on a fused bucket; None for ``"auto"``."""
        return None if isinstance(self.bucket_bytes, str) else int(self.bucket_bytes)

    @property
    def fixed_degree(self) -> bool:
        """``degree`` was given: it divides every mean, whoever contributes."""
        return self.degree is not None

    def divisor(self, contributors: int) -> int:
        """The divisor of a mean over ``contributors`` ranks."""
        return self.degree if self.degree is not None else max(1, contributors)

    @property
    def wire_format(self) -> str | None:
        """The 16-bit wire format's name (``"fp16"``, ``"bf16"``), or None."""
        return self.compression if isinstance(self.compression, str) else None

    @property
    def powersgd(self) -> PowerSGD | None:
        """The low-rank compression, or None."""
        return self.compression if isinstance(self.compression, PowerSGD) else None


_NAMES = frozenset(f.name for f in dataclasses.fields(Options))


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


def _flag(name: str, value: Any, none: bool = False) -> Any:
    """``value`` as a bool (or None, with ``none``), else ``TypeError`` naming ``name``."""
    if value is None and none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool{' or None' if none else ''}, got {type(value).__name__} {value!r}")
    return bool(value)


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


def resolve(options: Options, specs: Sequence[ParamSpec], size: int) -> Options:
    """Check every option for ``specs`` on ``size`` ranks and apply the environment's defaults (local).

    Returns:
        The options resolved: ``fusion`` and ``skip`` one entry per parameter, ``timeout``,
        ``stall_warning``, ``abort_on_exception``, ``cuda_aware`` and ``timeline`` as they apply.

    Raises:
        ValueError, TypeError: naming the option, what was expected and what came.
    """
    if not isinstance(options, Options):
        raise TypeError(f"options: expected a mpi_gradreducer.Options, got {type(options).__name__} {options!r}")
    o = options
    _flag("mean", o.mean)
    if o.degree is not None:
        positive("degree", o.degree, integer=True)
    ids = planning.fusion_ids(len(specs), o.fusion_type, o.fusion, o.split_indices)
    skip = [False] * len(specs) if o.skip is None else list(o.skip)
    if len(skip) != len(specs):
        raise ValueError(f"skip: expected {len(specs)} bools (one per parameter), got {len(skip)}")
    _check_compression(specs, size, o)
    if not (isinstance(o.bucket_bytes, str) and o.bucket_bytes == "auto"):
        positive("bucket_bytes", o.bucket_bytes, integer=True, also=" or 'auto'")
    if o.hook is not None and not callable(o.hook):
        raise TypeError(f"hook: expected a callable hook(bucket) or None, got {type(o.hook).__name__} {o.hook!r}")
    if o.hook is not None and isinstance(o.compression, str):
        raise ValueError(f"hook: not with compression={o.compression!r}, which is a bucket hook of its own; "
                         "give one of them")
    if o.elsewhere is not None and not callable(o.elsewhere):
        raise TypeError(f"elsewhere: expected a callable that returns strings, or None, got "
                        f"{type(o.elsewhere).__name__} {o.elsewhere!r}")
    if o.validate not in VALIDATE_MODES:
        raise ValueError(f"validate: expected one of {VALIDATE_MODES}, got {o.validate!r}")
    timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT)) if _env(o.timeout) else o.timeout
    stall_warning = stall_warning_default() if _env(o.stall_warning) else o.stall_warning
    abort = (os.environ.get(ABORT_ON_EXCEPTION_ENV, "1").strip() != "0") if _env(o.abort_on_exception) \
        else _flag("abort_on_exception", o.abort_on_exception)
    if o.progress not in PROGRESS_MODES:
        raise ValueError(f"progress: expected one of {PROGRESS_MODES}, got {o.progress!r}")
    if o.progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ValueError("progress='thread' needs MPI_THREAD_MULTIPLE, which MPI did not grant")
    if o.timeline is not None and not isinstance(o.timeline, (str, os.PathLike)):
        raise TypeError(f"timeline: expected a file name or None, got {type(o.timeline).__name__} {o.timeline!r}")
    cuda_aware = _flag("cuda_aware", o.cuda_aware, none=True)
    if _flag("deterministic", o.deterministic):
        devices = [i for i, s in enumerate(specs) if not backend.is_host(s.device)]
        if devices:
            raise ValueError(f"deterministic=True: expected host parameters only, got parameters[{devices[0]}] on "
                             f"{specs[devices[0]].device}; device buckets are summed by MPI in its own order")
    if cuda_aware is None:
        cuda_aware = any(not backend.is_host(s.device) for s in specs) and bool(cuda_aware_default()[0])
    return dataclasses.replace(
        o, mean=bool(o.mean), degree=None if o.degree is None else int(o.degree), fusion_type=1, fusion=tuple(ids),
        split_indices=None, skip=tuple(bool(s) for s in skip),
        bucket_bytes=o.bucket_bytes if isinstance(o.bucket_bytes, str) else int(o.bucket_bytes),
        timeout=positive("timeout", timeout, none=True, also=" or None"),
        stall_warning=positive("stall_warning", stall_warning, none=True, also=" or None"),
        abort_on_exception=abort, check_finite=bool(o.check_finite), cuda_aware=cuda_aware,
        timeline=os.fspath(o.timeline) if o.timeline is not None else os.environ.get(TIMELINE_ENV),
        predivide=None if o.predivide is None else float(o.predivide), coalesce=bool(o.coalesce),
        deterministic=bool(o.deterministic))


def _env(value: Any) -> bool:
    """Whether an option says "the environment's default"."""
    return isinstance(value, str) and value == "env"


def agree(comm: MPI.Intracomm, parameters: Iterable[Any], options: Options,
          specs: Sequence[ParamSpec] | None = None) -> tuple[tuple[ParamSpec, ...], Options]:
    """The parameters' specs and the options, resolved locally, then agreed by every rank (collective).

    Args:
        comm: the ranks that agree.
        parameters: the arrays whose specs are taken (not read when ``specs`` is given).
        options: the options asked for.
        specs: the parameters' specs, where known already (a reducer made again).

    Raises:
        ValueError, TypeError: on every rank, when any rank's arguments are bad or differ from rank 0's.
    """
    error: Exception | None = None
    resolved: Options | None = None
    known: tuple[ParamSpec, ...] = ()
    try:
        known = param_specs(parameters) if specs is None else tuple(specs)
        resolved = resolve(options, known, comm.Get_size())
    except (ValueError, TypeError) as exc:
        error = exc
    agreement.raise_if_any(comm, error)
    assert resolved is not None  # else some rank's error was raised on every rank
    rows, names = signature(resolved, known)
    agreement.check_same(comm, rows, lambda i, row: _describe(names[i], row), names.__getitem__)
    return known, resolved


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


def _check_compression(specs: Sequence[ParamSpec], size: int, o: Options) -> None:
    """Raise unless ``compression`` and ``predivide`` fit the parameters."""
    compression = o.compression
    if isinstance(compression, type) and issubclass(compression, PowerSGD):
        raise TypeError("compression: expected a PowerSGD instance, got the class; write PowerSGD(...)")
    if isinstance(compression, (list, tuple, set)) and any(isinstance(c, PowerSGD) for c in compression):
        raise ValueError(f"compression: PowerSGD cannot be combined with another compression (fp16/bf16), "
                         f"got {compression!r}; its P and Q travel in the gradients' own dtype")
    if isinstance(compression, PowerSGD):
        comp = None
    else:
        try:
            comp = wire.get_compression(compression)
        except ImportError as exc:
            raise ValueError(str(exc)) from exc
    if comp is not None:
        if any(not backend.is_host(s.device) for s in specs):
            raise TypeError("compression: works on host (numpy) gradients only; got device arrays")
        degree = size if o.degree is None else int(o.degree)
        comp.scales(size, degree, bool(o.mean), o.predivide)  # checks predivide
    elif o.predivide is not None:
        raise ValueError(f"predivide: only applies with compression='fp16' or 'bf16', got predivide={o.predivide!r}")


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


def signature(options: Options, specs: Sequence[ParamSpec]) -> tuple[list[tuple[int, ...]], list[str]]:
    """What every rank's reducer must have in common, and what each row is.

    One row per option whose field says it must agree (its value, or what of it
    must agree, as the bytes of its ``repr``), then one row per parameter:
    dtype, fusion id, skipped, host or device, shape.
    """
    rows: list[tuple[int, ...]] = []
    names: list[str] = []
    for f in dataclasses.fields(options):
        key = f.metadata.get("agree")
        if key is not None:
            rows.append(tuple(repr(key(getattr(options, f.name))).encode()))
            names.append(f"option {f.name}")
    rows.append((len(specs),))
    names.append("the number of parameters")
    for i, (spec, fid, skip) in enumerate(zip(specs, options.ids, options.skipped, strict=True)):
        device_kind = 0 if backend.is_host(spec.device) else 1
        rows.append((dtype_code(spec.dtype), fid, int(skip), device_kind, len(spec.shape), *spec.shape))
        names.append(f"parameter {i}")
    return rows, names


def _describe(name: str, row: tuple[int, ...]) -> str:
    """A readable form of one row of :func:`signature`."""
    if name.startswith("option "):
        return bytes(row).decode(errors="replace")
    if not name.startswith("parameter "):
        return str(row[0])
    dtype, fid, skip, device_kind, ndim, *shape = row
    return (f"shape {tuple(shape)} {SUPPORTED_NAMES[dtype]} on {'cpu' if device_kind == 0 else 'gpu'} "
            f"(fusion id {fid}{', skipped' if skip else ''})")

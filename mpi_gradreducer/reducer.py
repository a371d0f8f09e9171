"""``DistributedGradReducer``: validate, pack, Allreduce, unpack, in place."""

from __future__ import annotations

import ctypes
import os
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

from . import agreement, backend, compression as wire, interop, planning, transport
from .fusion import FusionBuffer, join_runs, largest_finite
from .groups import processor_names
from .sparse import RowSparse, allgather_rowsparse
from .staging import StagingPipeline
from .steps import CommThread, ReductionStep
from .timeline import Timeline
from .tuning import CANDIDATE_BUCKET_BYTES, BucketTuner
from .watchdog import Watchdog

__all__ = ["DistributedGradReducer", "ReducerStats", "DEFAULT_BUCKET_BYTES", "DIRECT_BYTES"]

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

_VALIDATE_MODES = ("always", "first", "never")
_PROGRESS_MODES = ("auto", "thread", "deferred")


@dataclass
class ReducerStats:
    """Always-on counters of a reducer (cheap: a few clock reads per bucket).

    Attributes:
        calls: completed reductions.
        messages: ``Allreduce`` calls made (buckets are sent in chunks of
            ``transport.CHUNK_BYTES``; adjacent buckets as one run).
        bytes: bytes handed to MPI, summed over calls.
        pack_seconds: time spent copying gradients into fusion buffers.
        allreduce_seconds: time spent in MPI (including in-place scaling).
        unpack_seconds: time spent copying results back (including scaling).
        launches: kernel launches made by device packs and unpacks.
    """

    calls: int = 0
    messages: int = 0
    bytes: int = 0
    pack_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    unpack_seconds: float = 0.0
    launches: int = 0


class DistributedGradReducer:
    """Averages lists of gradient arrays across the ranks of an MPI communicator.

    The framework-agnostic counterpart of MindSpore's
    ``nn.DistributedGradReducer``. Construction is collective over ``group``:
    every rank must build its reducer from parameters of the same count,
    shapes and dtypes, in the same order (checked; a difference raises
    ``ValueError`` on every rank). Each call is collective too.

    Args:
        parameters: arrays (numpy or cupy) whose count, shapes, dtypes and
            order fix the reduction plan.
        mean: multiply the sums by ``1 / degree``.
        degree: the divisor for ``mean``; defaults to the size of ``group``.
        fusion_type: fusion id of every parameter (0: never fused).
        group: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``. The
            reducer works on its own duplicate of it.
        fusion: one fusion id per parameter, instead of ``fusion_type``.
        split_indices: inclusive end indices of consecutive fusion groups
            (MindSpore's ``all_reduce_fusion_config``).
        bucket_bytes: cap on a fused bucket, in bytes, or ``"auto"``: the
            first blocking calls try a few caps (512 KiB to 32 MiB), and the
            one that was fastest on the slowest rank is kept (the same on every
            rank). Call ``allocate_grads`` after that if you use it.
        skip: one bool per parameter; True leaves that gradient untouched
            (MindSpore's layer-wise-parallel and parameter-server parameters).
        validate: ``"always"`` checks every call's gradients and makes all
            ranks agree on the outcome before any data moves; ``"first"`` does
            so on the first call only; ``"never"`` only checks locally, so a
            rank with bad input raises alone and the others are ended by the
            watchdog.
        timeout: seconds a collective may take before the watchdog prints a
            diagnostic and aborts the job; None disables it. Default: the
            ``MPI_GRADREDUCER_TIMEOUT`` environment variable, else 1800.
        check_finite: find out on each call whether any rank's gradients held
            NaN or Inf; the answer is :attr:`nonfinite`.
        cuda_aware: for cupy arrays, hand device buffers straight to MPI
            (True) or stage them through pinned host buffers (False). Default:
            the environment variable ``MPI_GRADREDUCER_CUDA_AWARE``, else what
            the MPI library says (see ``python -m mpi_gradreducer.info``).
        progress: how buckets launched by ``begin``/``reduce_async`` advance
            while the caller computes: ``"thread"``, on a communication thread
            (needs ``MPI_THREAD_MULTIPLE``); ``"deferred"``, all in ``wait()``
            (no overlap, no thread: the blocking call's speed); ``"auto"``
            (default): a thread when MPI grants ``MPI_THREAD_MULTIPLE`` and
            every rank on a node has at least two cores, else deferred (a
            busy-waiting MPI thread on a shared core slows the computation
            more than it hides).
        timeline: a file name: record pack, allreduce and unpack of every
            bucket on every rank, and write them, merged by rank 0, as a Chrome
            trace-event file when the reducer is freed (open it in Perfetto
            or ``chrome://tracing``). Default: ``MPI_GRADREDUCER_TIMELINE``.

    Raises:
        ValueError: a bad argument, or parameters that differ across ranks.
        TypeError: an argument of the wrong type, or an unsupported dtype.
    """

    def __init__(
        self,
        parameters: Sequence[Any],
        mean: bool = True,
        degree: Optional[int] = None,
        fusion_type: int = 1,
        group: Optional[MPI.Intracomm] = None,
        *,
        fusion: Optional[Sequence[int]] = None,
        split_indices: Optional[Sequence[int]] = None,
        bucket_bytes: Union[int, str] = DEFAULT_BUCKET_BYTES,
        skip: Optional[Sequence[bool]] = None,
        validate: str = "always",
        timeout: Union[float, None, str] = "env",
        check_finite: bool = False,
        cuda_aware: Optional[bool] = None,
        timeline: Optional[str] = None,
        compression: Optional[str] = None,
        predivide: Optional[float] = None,
        coalesce: bool = False,
        progress: str = "auto",
    ) -> None:
        comm = MPI.COMM_WORLD if group is None else group
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"group: expected an mpi4py intracommunicator, got {comm!r}")
        self._comm = comm.Dup()
        self._watchdog: Optional[Watchdog] = None
        try:
            error = None
            try:
                self._configure(parameters, mean, degree, fusion_type, fusion, split_indices, bucket_bytes,
                                skip, validate, timeout, check_finite, cuda_aware, compression, predivide,
                                progress)
            except (ValueError, TypeError) as exc:
                error = exc
            agreement.raise_if_any(self._comm, error)
            agreement.check_same(self._comm, self._signature(), self._describe_row,
                                 lambda i: f"parameter {i - 1}" if i else "the configuration")
        except BaseException:
            self._comm.Free()
            raise
        self._plan(self._bucket_bytes)
        self.stats = ReducerStats()
        self.nonfinite = False
        self._calls = 0
        self._active: Optional[ReductionStep] = None
        self._caller_grads: Optional[Sequence[Any]] = None  # interop: what the step's wait() returns
        self._control: Optional[MPI.Intracomm] = None
        self._thread: Optional[CommThread] = None
        self.progress = self._choose_progress()
        self._deferred: list[int] = []  # buckets launched but not yet reduced ("deferred" progress)
        self._devices: dict[str, tuple[Any, StagingPipeline]] = {}
        self._scale = 1.0 / self.degree if self.mean else 1.0
        self.coalesce = bool(coalesce)
        self._sparse: tuple[int, ...] = ()  # positions of RowSparse gradients in the current call
        path = timeline if timeline is not None else os.environ.get(TIMELINE_ENV)
        self._timeline = Timeline(self._comm, path) if path else None
        if self._timeout is not None:
            self._watchdog = Watchdog(self._timeout, self._abort, self._comm.Get_rank())

    # -- construction -----------------------------------------------------------------

    def _choose_progress(self) -> str:
        """The progress mode; ``"auto"`` is decided collectively, the same on every rank."""
        if self._progress != "auto":
            return self._progress
        multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        hosts = processor_names(self._comm)
        ranks_here = hosts.count(hosts[self._comm.Get_rank()])
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        spare = np.array([int(multiple and cores >= 2 * ranks_here)], dtype=np.int64)
        self._comm.Allreduce(MPI.IN_PLACE, spare, op=MPI.MIN)
        return "thread" if spare[0] else "deferred"

    def _configure(self, parameters, mean, degree, fusion_type, fusion, split_indices, bucket_bytes,
                   skip, validate, timeout, check_finite, cuda_aware, compression, predivide,
                   progress) -> None:
        self._compression: Optional[wire.Compression] = None
        params = list(parameters)
        specs = []
        supported = planning.supported_dtypes()
        for i, p in enumerate(params):
            # interop: any array by protocol (torch Parameters that require grad included)
            described = interop.describe(p)
            if described is None:
                raise TypeError(f"parameters[{i}]: expected a numpy or cupy array, got {interop.explain(p)}; "
                                "any array with __dlpack__, __array_interface__ or __cuda_array_interface__ will do")
            shape, dtype, device = described
            if dtype not in supported:
                raise TypeError(
                    f"parameters[{i}]: dtype {dtype} is not supported; expected one of "
                    + ", ".join(d.name for d in supported)
                )
            specs.append(planning.ParamSpec(shape, dtype, device))
        self._specs = tuple(specs)
        if not isinstance(mean, (bool, np.bool_)):
            raise TypeError(f"mean: expected a bool, got {type(mean).__name__} {mean!r}")
        self.mean = bool(mean)
        size = self._comm.Get_size()
        if degree is None:
            degree = size
        elif isinstance(degree, bool) or not isinstance(degree, (int, np.integer)) or degree <= 0:
            raise ValueError(f"degree: expected a positive int, got {degree!r}")
        self.degree = int(degree)
        self._ids = planning.fusion_ids(len(specs), fusion_type, fusion, split_indices)
        if skip is None:
            skip = [False] * len(specs)
        skip = list(skip)
        if len(skip) != len(specs):
            raise ValueError(f"skip: expected {len(specs)} bools (one per parameter), got {len(skip)}")
        self._skip = tuple(bool(s) for s in skip)
        try:
            self._compression = wire.get_compression(compression)
        except ImportError as exc:
            raise ValueError(str(exc)) from exc
        if self._compression is not None:
            if any(not backend.is_host(s.device) for s in specs):
                raise TypeError("compression: works on host (numpy) gradients only; got device arrays")
            self._wire_scales = self._compression.scales(
                self._comm.Get_size(), self.degree, self.mean, predivide
            )
        elif predivide is not None:
            raise ValueError(f"predivide: only applies with compression, got predivide={predivide!r}")
        self._predivide = 0.0 if predivide is None else float(predivide)
        self._tuner: Optional[BucketTuner] = None
        if isinstance(bucket_bytes, str) and bucket_bytes == "auto":
            self._tuner = BucketTuner(self._distinct_caps(CANDIDATE_BUCKET_BYTES))
            bucket_bytes = self._tuner.current()
        elif isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: expected a positive int or 'auto', got {bucket_bytes!r}")
        self._bucket_bytes = int(bucket_bytes)
        if validate not in _VALIDATE_MODES:
            raise ValueError(f"validate: expected one of {_VALIDATE_MODES}, got {validate!r}")
        self.validate = validate
        if isinstance(timeout, str) and timeout == "env":
            timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout: expected a positive number of seconds or None, got {timeout!r}")
        self._timeout = None if timeout is None else float(timeout)
        self.check_finite = bool(check_finite)
        if progress not in _PROGRESS_MODES:
            raise ValueError(f"progress: expected one of {_PROGRESS_MODES}, got {progress!r}")
        if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ValueError("progress='thread' needs MPI_THREAD_MULTIPLE, which MPI did not grant")
        self._progress = progress
        if cuda_aware is not None and not isinstance(cuda_aware, (bool, np.bool_)):
            raise TypeError(f"cuda_aware: expected a bool or None, got {type(cuda_aware).__name__} {cuda_aware!r}")
        if cuda_aware is None and any(not backend.is_host(s.device) for s in specs):
            cuda_aware = bool(transport.cuda_support()[0])
        #: True when device buffers go straight to MPI; False when they are
        #: staged through pinned host memory (only matters for device arrays).
        self.cuda_aware = bool(cuda_aware)

    def _signature(self) -> list[tuple[int, ...]]:
        codes = planning.supported_dtypes()
        cap = -1 if self._tuner is not None else self._bucket_bytes
        kind = 0 if self._compression is None else 1 + wire.COMPRESSIONS.index(self._compression.name)
        header = (len(self._specs), cap, int(self.mean), self.degree, int(self.cuda_aware), kind,
                  int(self._predivide * 1e6), _PROGRESS_MODES.index(self._progress))
        rows = [header]
        for spec, fid, skip in zip(self._specs, self._ids, self._skip):
            device_kind = 0 if backend.is_host(spec.device) else 1
            rows.append((codes.index(spec.dtype), fid, int(skip), device_kind, len(spec.shape), *spec.shape))
        return rows

    def _describe_row(self, index: int, row: tuple[int, ...]) -> str:
        if index == 0:
            names = (None,) + wire.COMPRESSIONS
            return "(parameters={}, bucket_bytes={}, mean={}, degree={}, cuda_aware={}, ".format(*row[:5]) + \
                f"compression={names[row[5]]!r}, predivide={row[6] / 1e6:g}, progress={_PROGRESS_MODES[row[7]]!r})"
        codes = planning.supported_dtypes()
        dtype, fid, skip, device_kind, ndim, *shape = row
        return (
            f"shape {tuple(shape)} {codes[dtype].name} on {'cpu' if device_kind == 0 else 'gpu'} "
            f"(fusion id {fid}{', skipped' if skip else ''})"
        )

    def _make_plan(self, bucket_bytes: int) -> tuple[planning.Bucket, ...]:
        comp = self._compression
        wire_dtype = planning.reduction_dtype
        if comp is not None:
            wire_dtype = lambda d: comp.wire_dtype if comp.applies_to(d) else planning.reduction_dtype(d)  # noqa: E731
        return planning.make_plan(
            self._specs, self._ids, bucket_bytes, DIRECT_BYTES, reverse=True,
            first_bucket_bytes=FIRST_BUCKET_BYTES, exclude=self._skip, wire_dtype=wire_dtype,
        )

    def _distinct_caps(self, caps: Sequence[int]) -> list[int]:
        """The caps that give different plans (the smallest of each kind)."""
        seen, kept = set(), []
        for cap in caps:
            shape = tuple(b.indices for b in self._make_plan(cap))
            if shape not in seen:
                seen.add(shape)
                kept.append(cap)
        return kept

    def _plan(self, bucket_bytes: int) -> None:
        self._bucket_bytes = bucket_bytes
        buckets = self._make_plan(bucket_bytes)
        self._fusion = [FusionBuffer(b, [self._specs[i].shape for i in b.indices]) for b in buckets]
        self._bucket_of = [-1] * len(self._specs)
        for k, b in enumerate(buckets):
            for i in b.indices:
                self._bucket_of[i] = k
        self._bucketed = tuple(i for b in buckets for i in b.indices)
        self._own_views: list[Any] = [None] * len(self._specs)
        self._checked = tuple(i for i, skip in enumerate(self._skip) if not skip)

    # -- public API -------------------------------------------------------------------

    @property
    def buckets(self) -> tuple[planning.Bucket, ...]:
        """The plan: one entry per fused message, in the order they are sent."""
        return tuple(f.bucket for f in self._fusion)

    @property
    def comm(self) -> MPI.Intracomm:
        """The reducer's own duplicate of ``group``."""
        return self._comm

    def allocate_grads(self) -> list[Any]:
        """Gradient arrays that are views into the reducer's fusion buffers.

        Write gradients into these (e.g. ``np.matmul(..., out=g)``) and pass
        the list back: buckets made of these views are reduced where they lie,
        with no packing copy (PyTorch DDP's ``gradient_as_bucket_view``). The
        buckets of one device and dtype are laid out back to back in one
        block, in plan order, so that consecutive buckets are reduced as one
        run, chunked across their boundaries.

        Returns:
            One zero-filled array per parameter, with its shape and dtype.
        """
        grads: list[Any] = [None] * len(self._specs)
        groups: dict[tuple[str, str], list[FusionBuffer]] = {}
        for f in self._fusion:
            if f.native:
                groups.setdefault((f.bucket.device, f.bucket.dtype.str), []).append(f)
        for (device, _), members in groups.items():
            block = backend.empty(sum(f.bucket.count for f in members), members[0].bucket.dtype, device)
            block[...] = 0
            offset = 0
            for f in members:
                f.allocate(block[offset : offset + f.bucket.count])
                offset += f.bucket.count
                for i, v in zip(f.bucket.indices, f.views):
                    grads[i] = self._own_views[i] = v
        for i, spec in enumerate(self._specs):
            if grads[i] is None:
                grads[i] = backend.empty(spec.size, spec.dtype, spec.device).reshape(spec.shape)
                grads[i][...] = 0
        return grads

    def __call__(self, grads: Sequence[Any]) -> Sequence[Any]:
        """Average (or sum) every gradient across the group, in place.

        Args:
            grads: one array per parameter, matching the plan.

        Returns:
            ``grads`` itself, its arrays now holding the reduced values.

        Raises:
            ValueError, TypeError: on every rank when any rank's gradients do
                not match the plan; no array has been modified on any rank.
            RuntimeError: when an asynchronous reduction is still in flight.
        """
        grads, views = self._start(grads)  # interop: numpy/cupy views of the caller's objects
        tuner = self._tuner
        if tuner is not None and tuner.current() != self._bucket_bytes:
            self._plan(tuner.current())
        t0 = time.perf_counter()
        self._run_buckets(range(len(self._fusion)), views)
        self._reduce_sparse(views)
        self._return_sparse(views, grads)
        if tuner is not None:
            tuner.record(time.perf_counter() - t0)
            if tuner.finished:
                self._plan(tuner.decide(self._comm))
                self._tuner = None
        self._finish()
        return grads

    def begin(self, grads: Sequence[Any]) -> ReductionStep:
        """Start a reduction whose buckets launch as their gradients become ready.

        Call ``step.ready(i)`` as soon as ``grads[i]`` is final (for example
        layer by layer during backward); each bucket is launched as soon as
        it and every bucket before it are ready, and reduced on a
        communication thread (``progress="thread"``) or in ``wait()``
        (``progress="deferred"``). Then ``step.wait()`` finishes and returns
        ``grads``. Results are bitwise identical to the blocking call. Do not
        write to a gradient after declaring it ready, nor call the reducer
        again before ``wait()``.

        Args:
            grads: one array per parameter, matching the plan; validated now,
                collectively, as by the blocking call.

        Returns:
            The step in flight.
        """
        grads, views = self._start(grads)  # interop
        if self._control is None:
            self._control = self._comm.Dup()
        if self._thread is None and self.progress == "thread":
            self._thread = CommThread()
        self._caller_grads = grads  # interop: what wait() returns
        self._active = ReductionStep(
            views, self._bucket_of, [len(f.bucket.indices) for f in self._fusion], self._launch, self._complete
        )
        return self._active

    def reduce_async(self, grads: Sequence[Any]) -> ReductionStep:
        """Start reducing all of ``grads`` in the background.

        Returns:
            A handle: ``handle.wait()`` returns the reduced ``grads``;
            ``handle.done()`` tells whether the communication has finished.
        """
        step = self.begin(grads)
        step.mark_all_ready()
        return step

    def free(self) -> None:
        """Write the timeline, release the communicators and threads (collective). Idempotent."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        if self._timeline is not None:
            self._timeline.close()
            self._timeline = None
        if self._compression is not None:
            self._compression.free()
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        for comm in (self._control, self._comm):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()
        self._control = None

    def __enter__(self) -> "DistributedGradReducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    # -- one call ---------------------------------------------------------------------

    def _start(self, grads: Any) -> tuple[Sequence[Any], Sequence[Any]]:
        """Check a call's gradients; returns them (a list if they came as an iterator) and their views."""
        if self._active is not None:
            raise RuntimeError("a reduction started with begin() or reduce_async() is still in flight; wait() for it first")
        if self._comm == MPI.COMM_NULL:
            raise RuntimeError("this reducer was freed")
        if not isinstance(grads, (list, tuple)):  # interop: any iterable, e.g. (p.grad for p in params)
            try:
                grads = list(grads)
            except TypeError:
                pass  # named by the check below, on every rank
        views = self._check(grads)
        self._calls += 1
        self.nonfinite = False
        return grads, views

    def _return_sparse(self, views: Sequence[Any], grads: Sequence[Any]) -> None:
        """interop: put the new RowSparse results into the caller's list too."""
        if views is not grads:
            for i in self._sparse:
                grads[i] = views[i]

    def _finish(self) -> None:
        self.stats.calls += 1

    def _launch(self, step: ReductionStep, batch: list[int]) -> None:
        if self._thread is None:
            self._deferred.extend(batch)  # reduced by wait()
            return
        for device in {self._fusion[k].bucket.device for k in batch} - {"cpu"}:
            self._device_state(device)[0].ready_for_mpi()  # the caller's kernels finish before the thread reads
        self._thread.submit(lambda: self._run_batch(step, batch, on_thread=True))

    def _run_batch(self, step: ReductionStep, batch: list[int], on_thread: bool = False) -> None:
        error: Optional[BaseException] = None
        try:
            self._run_buckets(batch, step.grads, on_thread)
        except BaseException as exc:  # reported by wait()
            error = exc
        for _ in batch:
            step.bucket_finished(error)

    def _complete(self, step: ReductionStep) -> Sequence[Any]:
        missing = step.not_ready()
        if self._comm.Get_size() > 1:
            counts = np.zeros(self._comm.Get_size(), dtype=np.int64)
            self._control.Allgather(np.array([len(missing)], dtype=np.int64), counts)
        else:
            counts = np.array([len(missing)], dtype=np.int64)
        if counts.any():
            step.mark_all_ready()  # every rank still issues every collective: no one hangs
        try:
            if self._deferred:
                batch, self._deferred = self._deferred, []
                self._run_batch(step, batch)
            step.join()
            if not counts.any():
                self._reduce_sparse(step.grads)
                self._return_sparse(step.grads, self._caller_grads)
        finally:
            self._active = None
        if counts.any():
            ranks = ", ".join(f"rank {r} ({c})" for r, c in enumerate(counts) if c)
            raise RuntimeError(
                f"wait() was called before ready() for every gradient on {ranks}"
                + (f"; here: grads{missing[:8]}" if missing else "")
                + ". The buckets were reduced anyway, with the values those gradients held at wait(), "
                "so that no rank hangs; call ready(i) for every gradient before wait()"
            )
        self._finish()
        grads, self._caller_grads = self._caller_grads, None  # interop: the caller's list
        return grads

    def _check(self, grads: Sequence[Any]) -> Sequence[Any]:
        """Validate ``grads`` (collectively, unless told not to); returns their numpy/cupy views."""
        agree = self.validate == "always" or (self.validate == "first" and self._calls == 0)
        self._sparse = ()
        views = grads
        try:
            error, views = self._local_error(grads, aliasing=agree)
        except Exception as exc:  # an unexpected object must not strand the others
            error = TypeError(f"grads: could not be checked ({exc!r})")
        if agree:
            layout = zlib.crc32(np.asarray(self._sparse, dtype=np.int64).tobytes())
            self._collective(lambda: "the validation of the gradients",
                             agreement.raise_if_any, self._comm, error, (layout,))
        elif error is not None:
            raise error
        return views

    def _local_error(self, grads: Sequence[Any], aliasing: bool) -> tuple[Optional[Exception], Sequence[Any]]:
        """This rank's verdict on ``grads``, and their numpy/cupy views (``grads`` itself when all are arrays)."""
        if not hasattr(grads, "__len__") or not hasattr(grads, "__getitem__"):  # interop
            return TypeError(f"grads: expected a list (or any iterable) of arrays, got {type(grads).__name__}"), grads
        n = len(self._specs)
        if len(grads) != n:
            return ValueError(f"grads: expected {n} arrays (one per parameter, as at construction), got {len(grads)}"), grads
        own, specs = self._own_views, self._specs
        sparse: list[int] = []
        views = grads  # interop: replaced by a list of views when an entry is not a numpy array
        for i in self._checked:
            g = grads[i]
            if g is own[i]:
                continue  # the reducer's own view: right shape, dtype and place by construction
            spec = specs[i]
            if (type(g) is not np.ndarray or g.shape != spec.shape or g.dtype != spec.dtype
                    or not g.flags.writeable or spec.device != "cpu"):
                if isinstance(g, RowSparse):
                    sparse.append(i)
                    error = _sparse_mismatch(i, g, spec, grads)
                else:
                    v = interop.view(g, spec.device)  # interop: a zero-copy numpy/cupy view, or None
                    if v is not g and v is not None:
                        if views is grads:
                            views = list(grads)
                        views[i] = v
                        if (type(v) is np.ndarray and v.shape == spec.shape and v.dtype == spec.dtype
                                and v.flags.writeable and spec.device == "cpu"):
                            continue  # the view fits
                    error = _mismatch(i, g, spec, v)
                if error is not None:
                    return error, grads
        self._sparse = tuple(sparse)
        if aliasing:
            buffers = {id(_owner(f.buffer)) for f in self._fusion if f.buffer is not None}
            dense = [i for i in self._bucketed if i not in sparse] if sparse else self._bucketed
            return _aliasing_error(views, dense, own, buffers, foreign=views is not grads), views
        return None, views

    def _run_buckets(self, ks: Sequence[int], grads: Sequence[Any], on_thread: bool = False) -> None:
        """Reduce buckets ``ks`` in order.

        Consecutive host buckets that lie back to back in memory are reduced
        as one run; consecutive device buckets go through one pipeline.
        """
        start = 0
        while start < len(ks):
            device = self._fusion[ks[start]].bucket.device
            end = start + 1
            if backend.is_host(device):
                run = self._in_place_run(ks[start], grads)
                if run is None:
                    self._run_bucket(ks[start], grads)
                else:
                    while end < len(ks) and (nxt := self._in_place_run(ks[end], grads)) is not None:
                        joined = join_runs(run, nxt)
                        if joined is None:
                            break
                        run, end = joined, end + 1
                    t0 = time.perf_counter()
                    self._allreduce(ks[start], run, self._scale)
                    t2 = time.perf_counter()
                    self._count(ks[start:end], t0, t0, t2, t2)
            else:
                while end < len(ks) and self._fusion[ks[end]].bucket.device == device:
                    end += 1
                self._run_device_buckets(ks[start:end], grads, on_thread)
            start = end

    def _run_device_buckets(self, ks: Sequence[int], grads: Sequence[Any], on_thread: bool) -> None:
        """Reduce buckets of device arrays: CUDA-aware MPI on device buffers, or staged."""
        device = self._fusion[ks[0]].bucket.device
        ops, pipeline = self._device_state(device)
        with ops.device:  # kernels, copies and cupy temporaries on the buckets' device, on any thread
            self._reduce_device_buckets(ks, grads, on_thread, ops, pipeline)

    def _reduce_device_buckets(self, ks: Sequence[int], grads: Sequence[Any], on_thread: bool, ops: Any,
                               pipeline: StagingPipeline) -> None:
        t0 = time.perf_counter()
        buffers, packed = [], []
        for k in ks:
            f = self._fusion[k]
            members = [grads[i] for i in f.bucket.indices]
            run = f.in_place(members)
            if run is None:
                f.pack(members)
                run = f.buffer
                packed.append((f, members))
            buffers.append(run)
        t1 = time.perf_counter()
        if self.cuda_aware:
            ops.ready_for_mpi()
            for k, buf in zip(ks, buffers):
                self._allreduce(k, buf, self._scale)
        else:
            pipeline.run(buffers, lambda pos, host: self._allreduce(ks[pos], host, self._scale))
        t2 = time.perf_counter()
        for f, members in packed:
            f.unpack(members)
        self.stats.launches += sum(f.launches for f in self._fusion) - self.stats.launches
        if on_thread:
            ops.ready_for_mpi()  # results complete before wait() returns
        t3 = time.perf_counter()
        self._count(ks, t0, t1, t2, t3)

    def _device_state(self, device: str) -> tuple[Any, StagingPipeline]:
        state = self._devices.get(device)
        if state is None:
            ops = backend.ops_for(device)
            state = self._devices[device] = (ops, StagingPipeline(ops))
        return state

    def _count(self, ks: Sequence[int], t0: float, t1: float, t2: float, t3: float) -> None:
        nbytes = sum(self._fusion[k].bucket.nbytes for k in ks)
        if self._timeline is not None:
            args = {"call": self._calls, "bucket": ks[0] if len(ks) == 1 else list(ks), "bytes": nbytes}
            for name, start, end in (("pack", t0, t1), ("allreduce", t1, t2), ("unpack", t2, t3)):
                if end > start:
                    self._timeline.record(name, start, end, **args)
        stats = self.stats
        stats.bytes += nbytes
        stats.pack_seconds += t1 - t0
        stats.allreduce_seconds += t2 - t1
        stats.unpack_seconds += t3 - t2

    def _in_place_run(self, k: int, grads: Sequence[Any]) -> Optional[Any]:
        """The 1-D view over bucket ``k``'s host gradients where they lie, if it can be reduced so."""
        f = self._fusion[k]
        if not backend.is_host(f.bucket.device) or not f.native:
            return None
        members = [grads[i] for i in f.bucket.indices]
        if self._sparse and any(i in self._sparse for i in f.bucket.indices):
            return None
        return f.in_place(members)

    def _run_bucket(self, k: int, grads: Sequence[Any]) -> None:
        """Reduce bucket ``k`` of ``grads`` by packing, summing and unpacking."""
        f = self._fusion[k]
        members = [grads[i] for i in f.bucket.indices]
        skip = [i in self._sparse for i in f.bucket.indices] if self._sparse else ()
        if skip and all(skip):
            return  # every member is row-sparse this call: gathered separately
        t0 = time.perf_counter()
        if self._compression is not None and f.bucket.wire_dtype == self._compression.wire_dtype:
            pre, post = self._wire_scales
            f.pack(members, pre, skip)
            t1 = time.perf_counter()
            self._collective(self._describe_bucket(k), wire.compressed_allreduce, self._comm, f.buffer,
                             self._compression, after=self._finite_check(k))
            t2 = time.perf_counter()
            f.unpack(members, post, skip)
        else:
            f.pack(members, 1.0, skip)
            t1 = time.perf_counter()
            self._allreduce(k, f.buffer, self._scale)  # scaled chunk by chunk, while in cache
            t2 = time.perf_counter()
            f.unpack(members, 1.0, skip)
        t3 = time.perf_counter()
        self._count((k,), t0, t1, t2, t3)

    def _allreduce(self, k: int, buf: Any, scale: float) -> None:
        self.stats.messages += self._collective(self._describe_bucket(k), transport.allreduce, self._comm,
                                                buf, scale, after=self._finite_check(k))

    def _describe_bucket(self, k: int) -> Callable[[], str]:
        return lambda: f"call {self._calls}, bucket {k} ({self._fusion[k].bucket.nbytes} bytes)"

    def _finite_check(self, k: int) -> Optional[Callable[[Any], None]]:
        """The per-chunk NaN/Inf test for bucket ``k``, when ``check_finite`` is on."""
        if not self.check_finite:
            return None
        limit = self._fusion[k].limit  # results must fit the gradients' own dtype
        return lambda chunk: self._check_finite_chunk(chunk, limit)

    def _reduce_sparse(self, grads: Sequence[Any]) -> None:
        """Gather each RowSparse gradient (in index order) and put the result in ``grads``."""
        for i in self._sparse:
            t0 = time.perf_counter()
            result = self._collective(
                lambda i=i: f"call {self._calls}, RowSparse grads[{i}]", allgather_rowsparse,
                self._comm, grads[i], self._scale, self.coalesce,
            )
            if self.check_finite and result.values.size:
                self._check_finite_chunk(result.values.reshape(-1), largest_finite(self._specs[i].dtype))
            grads[i] = result
            if self._timeline is not None:
                self._timeline.record("allgather", t0, time.perf_counter(), call=self._calls, index=i)

    def _check_finite_chunk(self, chunk: Any, limit: float) -> None:
        """Flag NaN, Inf or a value beyond ``limit`` (min/max propagate NaN; no temporaries)."""
        if self.nonfinite or chunk.size == 0:
            return
        real = chunk.view(chunk.real.dtype) if chunk.dtype.kind == "c" else chunk
        if not (-limit <= float(real.min()) and float(real.max()) <= limit):
            self.nonfinite = True

    def _collective(self, what: Callable[[], str], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        wd = self._watchdog
        if wd is None:
            return fn(*args, **kwargs)
        wd.arm(what)
        try:
            return fn(*args, **kwargs)
        finally:
            wd.disarm()

    def _abort(self) -> None:
        self._comm.Abort(1)


def _mismatch(i: int, g: Any, spec: planning.ParamSpec, v: Any) -> Optional[Exception]:
    """Why ``grads[i]`` (``g``, viewed as ``v``, None if it has no view) does not fit parameter ``i``, or None."""
    # interop: checks run on the view; the message names what the caller passed
    device = None if v is None else backend.device_of(v)
    if device is None:
        return TypeError(
            f"grads[{i}]: expected a numpy or cupy array, got {interop.explain(g)}; any array that numpy or "
            f"cupy can view without a copy will do (shape {spec.shape}, dtype {spec.dtype}, on {spec.device}, "
            f"as parameter {i})"
        )
    what = "" if v is g else f" ({type(g).__module__.split('.')[0]}.{type(g).__qualname__})"
    if v.shape != spec.shape:
        return ValueError(f"grads[{i}]: expected shape {spec.shape} (as parameter {i}), got {tuple(v.shape)}{what}")
    if v.dtype != spec.dtype:
        return TypeError(f"grads[{i}]: expected dtype {spec.dtype} (as parameter {i}), got {v.dtype}{what}")
    if device != spec.device:
        return ValueError(f"grads[{i}]: expected an array on {spec.device} (as parameter {i}), got {device}{what}")
    if not getattr(v.flags, "writeable", True):  # cupy arrays have no such flag, and are always writeable
        return ValueError(f"grads[{i}]{what} is read-only, but results are written in place; pass a writeable array")
    return None


def _sparse_mismatch(i: int, g: RowSparse, spec: planning.ParamSpec, grads: Sequence[Any]) -> Optional[Exception]:
    """Why RowSparse ``grads[i]`` cannot stand for parameter ``i``, or None."""
    if not isinstance(grads, list):
        return TypeError(
            f"grads: a RowSparse gradient (grads[{i}]) is replaced by its reduced RowSparse, "
            f"so grads must be a list, got {type(grads).__name__}"
        )
    if spec.device != "cpu":
        return TypeError(f"grads[{i}]: a RowSparse gradient needs a host parameter, but parameter {i} is on {spec.device}")
    error = g.check()
    if error is not None:
        return type(error)(f"grads[{i}]: {error}")
    if g.dense_shape != spec.shape or g.dtype != spec.dtype:
        return ValueError(
            f"grads[{i}]: expected a RowSparse of dense_shape {spec.shape} and dtype {spec.dtype} "
            f"(as parameter {i}), got dense_shape {g.dense_shape} and dtype {g.dtype}"
        )
    return None


def _aliasing_error(
    grads: Sequence[Any], indices: Sequence[int], own: Sequence[Any], buffers: set[int], foreign: bool = False
) -> Optional[Exception]:
    """ValueError naming two gradients that share memory, or None.

    Arrays can only overlap when they are views of the same owner, so byte
    bounds (slow to read) are compared only within such groups. The
    reducer's own views (``own``, into the fusion ``buffers``) are disjoint
    by construction and are looked at only when another gradient is a view
    of the same buffer. ``foreign``: some entries are views of other
    libraries' objects, whose owners do not tell whether they share memory
    (two torch views of one storage have different owners), so all byte
    bounds are compared.
    """
    if foreign:  # interop
        by_device: dict[Optional[str], list[int]] = {}
        for i in indices:
            if grads[i] is not own[i]:
                by_device.setdefault(backend.device_of(grads[i]), []).append(i)
        for members in by_device.values():
            error = _overlap_error(grads, members)
            if error is not None:
                return error
        return None
    seen: set[int] = set()
    shared = False
    for i in indices:
        g = grads[i]
        if g is own[i]:
            continue
        base = getattr(g, "base", None)
        key = id(g) if base is None else id(_owner(base))  # most gradients own their memory
        if key in seen or key in buffers:
            shared = True
            break
        seen.add(key)
    if not shared:
        return None
    owners: dict[int, list[int]] = {}
    for i in indices:
        owners.setdefault(id(_owner(grads[i])), []).append(i)
    for members in owners.values():
        if len(members) > 1:
            error = _overlap_error(grads, members)
            if error is not None:
                return error
    return None


def _owner(a: Any) -> Any:
    """The object that owns ``a``'s memory (the end of its chain of bases)."""
    base = getattr(a, "base", None)
    while base is not None:
        a, base = base, getattr(base, "base", None)
    return a


def _bounds(a: Any) -> tuple[int, int]:
    """interop: ``backend.byte_bounds``, three times faster for contiguous writeable host arrays
    of numpy's own dtypes (the buffer protocol has no format for bfloat16)."""
    if type(a) is np.ndarray and a.flags.c_contiguous and a.flags.writeable and a.size and a.dtype.isbuiltin == 1:
        lo = ctypes.addressof(ctypes.c_char.from_buffer(a))
        return lo, lo + a.nbytes
    return backend.byte_bounds(a)


def _overlap_error(grads: Sequence[Any], indices: Sequence[int]) -> Optional[Exception]:
    bounds = np.array([_bounds(grads[i]) for i in indices], dtype=np.int64)
    order = np.argsort(bounds[:, 0], kind="stable")
    lo, hi = bounds[order, 0], bounds[order, 1]
    reach = np.maximum.accumulate(hi)
    for k in np.nonzero(lo[1:] < reach[:-1])[0] + 1:
        for j in range(k):
            if hi[j] > lo[k]:
                a, b = sorted((indices[order[j]], indices[order[k]]))
                xp = np if isinstance(grads[a], np.ndarray) else __import__("cupy")  # interop: device views too
                if xp.shares_memory(grads[a], grads[b]):
                    return ValueError(
                        f"grads[{a}] and grads[{b}] share memory, but results are written in place; "
                        "pass distinct arrays"
                    )
    return None

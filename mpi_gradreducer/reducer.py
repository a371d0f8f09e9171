"""``DistributedGradReducer``: the front class over the plan, validation, execution paths and instrument."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mpi4py import MPI

from ._core import paths, shard
from ._core.call import Call, close, open_call
from ._core.context import Context
from ._core.fusion import distinct_caps, plan_for
from ._core.hooks import bucket_hook
from ._core.instrument import Instrument, ReducerStats
from ._core.lowrank import LowRankPath
from ._core.options import Options, agree as resolve_options, decide_progress
from ._core.planning import DEFAULT_BUCKET_BYTES, DIRECT_BYTES, ParamSpec
from ._core.polling import Polling
from ._core.replay import Replay
from ._core.singleton import check_not_singleton
from ._core.steps import Overlap, ReductionStep
from ._core.summers import Summers
from ._core.topology import Topology
from ._core.tuning import CANDIDATE_BUCKET_BYTES, BucketTuner
from ._core.validation import Checked, check_grads

__all__ = ["DistributedGradReducer", "ReducerStats", "DEFAULT_BUCKET_BYTES", "DIRECT_BYTES"]


class _Default:
    """The value of an argument that was not given: the field of ``options`` applies."""

    def __repr__(self) -> str:
        return "<from options>"


#: An argument left to ``options`` (its field, or the field's default).
DEFAULT = _Default()


class DistributedGradReducer:
    """Averages lists of gradient arrays across the ranks of an MPI communicator.

    The framework-agnostic counterpart of MindSpore's
    ``nn.DistributedGradReducer``. Construction is collective over ``group``:
    every rank must build its reducer from parameters of the same count,
    shapes and dtypes, in the same order (checked; a difference raises
    ``ValueError`` on every rank). Each call is collective too.

    Args:
        parameters: arrays (numpy or cupy, or any array they can view) whose
            count, shapes, dtypes and order fix the reduction plan.
        mean: multiply the sums by ``1 / degree`` (:attr:`Options.mean`).
        degree: the divisor for ``mean``; default: the number of ranks that
            contribute (:attr:`Options.degree`).
        fusion_type: fusion id of every parameter (0: never fused).
        group: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``. The
            reducer works on its own duplicate of it.
        options: every option in one object (:class:`~mpi_gradreducer.Options`);
            default ``Options()``.
        **more: any field of :class:`~mpi_gradreducer.Options` by name
            (``compression="fp16"``, ``bucket_bytes="auto"``, ...); these and
            ``mean``, ``degree`` and ``fusion_type``, where given, replace the
            fields of ``options``.

    Raises:
        ValueError: a bad option, or parameters that differ across ranks.
        TypeError: an argument of the wrong type, an unsupported dtype, or a
            keyword that is not an option.
    """

    def __init__(
        self,
        parameters: Iterable[Any],
        mean: bool | _Default = DEFAULT,
        degree: int | None | _Default = DEFAULT,
        fusion_type: int | _Default = DEFAULT,
        group: MPI.Intracomm | None = None,
        *,
        options: Options | None = None,
        **more: Any,
    ) -> None:
        check_not_singleton()  # a launcher's N tasks that MPI made N worlds of 1: refused before anything
        given = {k: v for k, v in (("mean", mean), ("degree", degree), ("fusion_type", fusion_type))
                 if v is not DEFAULT}
        asked = (Options() if options is None else options).replace(**more, **given)
        comm = MPI.COMM_WORLD if group is None else group
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"group: expected an mpi4py intracommunicator, got {comm!r}")
        #: What a rebuild carries over (the tuned cap, PowerSGD's state) until it has succeeded: a rebuild cut
        #: short by another loss takes it from here again, not from the half-made parts.
        self._carry: tuple[int | None, dict[str, Any] | None] | None = None
        self._setup(comm, parameters, asked)

    # -- construction steps -----------------------------------------------------------

    def _setup(self, group: MPI.Intracomm, parameters: Iterable[Any], asked: Options,
               specs: Sequence[ParamSpec] | None = None, tuned: int | None = None) -> None:
        """Everything the reducer holds, over a duplicate of ``group`` (collective).

        ``specs``: the parameters' specs, known already; ``tuned``: the cap
        that ``bucket_bytes="auto"`` chose before (no tuning again).
        """
        self._comm = group.Dup()
        try:
            self._specs, self.options = resolve_options(self._comm, parameters, asked, specs)
            self._topology = Topology.of(self._comm)
            self.progress = decide_progress(self._comm, self._topology, self.options.progress)
        except BaseException:
            self._comm.Free()
            raise
        options = self.options
        self.mean, self.validate = options.mean, options.validate
        self.degree = options.divisor(self._comm.Get_size())
        self.check_finite, self.cuda_aware, self.coalesce = options.check_finite, options.cuda_aware, options.coalesce
        self._instrument = Instrument(self._comm, options)
        self.stats = self._instrument.stats
        #: How the communication thread waits for its collectives (None: no thread, blocking calls).
        self._polling = Polling() if self.progress == "thread" else None
        #: The sums across ranks: in two levels across hosts (not with ``deterministic``).
        self._summers = Summers(self._comm, self._topology, two_levels=not options.deterministic,
                                wait=None if self._polling is None else self._polling.wait)
        #: What sums each bucket instead of the reducer: the user's, or compression's (None: the reducer).
        self._hook = bucket_hook(options)
        self._tuner: BucketTuner | None = None
        #: PowerSGD's path and state (None without it); kept when the tuner changes the plan.
        self._lowrank = LowRankPath(self._comm, self._specs, options, self._instrument, self._summers) \
            if options.powersgd is not None else None
        self._local = MPI.COMM_SELF.Dup()  # local copies: the buckets' (transport.Gather), the replay's
        self._replay = Replay(self._local)
        cap = options.cap if options.cap is not None else tuned
        if cap is None:
            self._tuner = BucketTuner(distinct_caps(self._specs, options, CANDIDATE_BUCKET_BYTES))
            self._build_plan(self._tuner.current())
        else:
            self._build_plan(cap)
        #: With ``check_finite``: whether the last call's results held NaN or Inf (on any rank).
        self.nonfinite = False
        #: How many ranks contributed to the last call (the same on every rank; see ``join``).
        self.contributors = self._comm.Get_size()
        self._calls = 0
        self._active: ReductionStep | None = None
        self._sharder: shard.Sharder | None = None
        self._overlap = Overlap(self._comm, self._polling)

    def _build_plan(self, bucket_bytes: int) -> None:
        """The buckets for ``bucket_bytes``, their buffers and the path of each."""
        self._bucket_bytes = bucket_bytes
        self._replay.forget()
        self._plan = plan_for(self._specs, self.options, bucket_bytes, self._local)
        self._ctx = Context(self._comm, self._plan, self.options, self._instrument, self._summers, self._hook)
        self._paths = paths.assign(self._ctx)
        #: The buckets in plan order, as runs of one path each.
        self._runs = paths.runs(self._paths, range(len(self._paths)))
        self._sparse = paths.SparsePath(self._ctx)
        #: What runs after the buckets: the RowSparse gradients, then PowerSGD's.
        self._tail: Any = self._sparse if self._lowrank is None else _Tail(self._sparse, self._lowrank)

    # -- public API -------------------------------------------------------------------

    @property
    def buckets(self) -> tuple[Any, ...]:
        """One entry per fused message (the plan), in the order they are sent."""
        return self._plan.buckets

    @property
    def comm(self) -> MPI.Intracomm:
        """The reducer's own duplicate of ``group``."""
        return self._comm

    def waiting(self) -> str | None:
        """The collective this reducer waits in now, in words (``call 4, bucket 0 (4096 bytes)``); None when none.

        For a framework's diagnoses (the ``elsewhere`` of another component);
        safe to call from any thread.
        """
        return self._instrument.waiting()

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
        self._replay.forget()
        return self._plan.allocate_grads()

    def __call__(self, grads: Sequence[Any]) -> Sequence[Any]:
        """Average (or sum) every gradient across the group, in place.

        Args:
            grads: one array per parameter, matching the plan.

        Returns:
            ``grads`` itself, its arrays now holding the reduced values.

        Raises:
            ValueError, TypeError: on every rank when any rank's gradients do
                not match the plan; no array has been modified on any rank.
            RuntimeError: on this rank alone, when an asynchronous reduction
                is still in flight or the reducer was freed (a programming
                error that leaves the other ranks waiting: the watchdog ends them).
        """
        call = self._start(grads)
        self._run(call, tune=True)
        return call.caller

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
        call = self._start(grads, asynchronous=True)
        self._active = self._overlap.begin(call, self._plan, self._paths, self._tail, self._finish)
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

    def reduce_scatter(self, grads: Sequence[Any]) -> shard.Shard:
        """Like ``reducer(grads)``, but this rank receives only its pieces of the result (collective).

        For ZeRO-style sharded optimizers (``mpi_gradreducer._core.shard``): ``shard.allgather(params)`` then
        shares the updated pieces; ``grads`` are left as they are. Raises ``ValueError``/``TypeError`` on
        every rank for bad gradients on any rank (arrays only, validated as by the blocking call), for a
        rank in ``join()``, for a plain call on another rank, or with ``compression=PowerSGD(...)``.
        """
        call = self._start(grads, sharded=True)
        self._sharder = shard.Sharder.of(self._sharder, self._comm, self._plan, self._instrument,
                                         self._summers)
        result = self._sharder.reduce_scatter(call)
        self._finish(call)
        return result

    def state_dict(self) -> dict[str, Any]:
        """PowerSGD's state on this rank: host numpy arrays and ints only, picklable (local).

        Returns:
            ``{"iteration": int, "q": {i: ndarray (m, rank)}, "error": {i: ndarray shaped like
            parameter i}}``: the number of calls made, the Q that the next call uses for each
            compressed parameter ``i`` (the same on every rank), and this rank's error.

        Raises:
            ValueError: the reducer has no PowerSGD compression.
        """
        return self._powersgd("state_dict").state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (collective: every rank its own state).

        The calls that follow give the same bits as those that followed the
        ``state_dict()`` call. Checked on every rank before anything changes.

        Raises:
            ValueError, TypeError: on every rank, when some rank's ``state`` does not fit this
                reducer's compressed parameters, or the ranks' iterations or Q differ.
            RuntimeError: (this rank alone) a reduction is in flight.
        """
        if self._active is not None and not self._active.closed:
            raise RuntimeError("load_state_dict: a reduction started with begin() is still in flight; wait() first")
        self._powersgd("load_state_dict").load_state_dict(state)

    def _powersgd(self, method: str) -> LowRankPath:
        if self._lowrank is None:
            raise ValueError(f"{method}: this reducer has no state to save: it was built without "
                             "compression=PowerSGD(...)")
        return self._lowrank

    def free(self) -> None:
        """Write the timeline, release the communicators and threads (collective). Idempotent."""
        self._overlap.close()
        self._instrument.close()
        if self._comm != MPI.COMM_NULL:
            self._plan.free()
            self._replay.forget()
            self._local.Free()
            self._summers.free()
            self._comm.Free()

    def communicators(self) -> list[MPI.Intracomm]:
        """Every communicator this reducer made and holds (local).

        Its duplicate of ``group`` (:attr:`comm`) first, then those of its
        parts: the hosts' and the cross-host levels, the control channel of
        ``begin()``/``wait()``, the watchdog's side channel. What a lost
        rank's recovery revokes (:mod:`mpi_gradreducer.elastic`). Empty once
        freed.
        """
        if self._comm == MPI.COMM_NULL:
            return []
        made = [self._comm, self._local, *self._summers.communicators(), *self._overlap.communicators(),
                *self._instrument.communicators()]
        return [c for c in made if c != MPI.COMM_NULL]  # a rebuild cut short by a loss leaves parts released

    def abandon(self) -> None:
        """Release everything with no collective and no timeline: some of the ranks are gone (local).

        For recovery from a lost rank (:mod:`mpi_gradreducer.elastic`),
        after the reducer's :meth:`communicators` were revoked: the
        communication thread ends at once (its operations fail), the watchdog
        stops, and the communicators are freed locally (Open MPI with ULFM
        frees a revoked communicator without its peers). The reducer is
        then unusable until :meth:`rebuild`. Idempotent.
        """
        self._overlap.close()
        self._instrument.close(write=False)
        if self._comm != MPI.COMM_NULL:
            self._plan.free()
            self._replay.forget()
            for release in (self._local.Free, self._summers.free, self._comm.Free):
                try:
                    release()
                except MPI.Exception:
                    pass

    def rebuild(self, group: MPI.Intracomm) -> None:
        """Make this reducer again over ``group``, for the same parameters and options (collective over ``group``).

        The reducer is first abandoned (:meth:`abandon`, local), then made
        as ``DistributedGradReducer(params, group=group, options=reducer.options)``
        would make it, in place: references to it stay valid. A ``degree``
        that was not given stays unset, so the new reducer divides by its
        own number of ranks. Views from :meth:`allocate_grads` belong to the
        old buffers: allocate them again.

        What the reducer learned is kept, as rank 0 of ``group`` has it (a
        rank that was there before: the survivors come first): the cap that
        ``bucket_bytes="auto"`` chose, and PowerSGD's iteration and Q; each
        rank keeps its own PowerSGD error feedback (zeros on a new rank).

        Args:
            group: the new ranks, e.g. the survivors of a lost rank.

        Raises:
            TypeError: ``group`` is not an intracommunicator.
        """
        if not isinstance(group, MPI.Intracomm) or group == MPI.COMM_NULL:
            raise TypeError(f"group: expected an mpi4py intracommunicator, got {group!r}")
        if self._carry is None:
            self._carry = (self._bucket_bytes if self._tuner is None and self.options.cap is None else None,
                           self._lowrank.state_dict() if self._lowrank is not None else None)
        tuned, lowrank = self._carry
        self.abandon()
        tuned = group.bcast(tuned, root=0)  # a new rank has not tuned (None): rank 0's choice for all
        self._setup(group, (), self.options, self._specs, tuned)
        if self._lowrank is not None and lowrank is not None:
            shared = self._comm.bcast((lowrank["iteration"], lowrank["q"]), root=0)
            self._lowrank.load_state_dict({"iteration": shared[0], "q": shared[1], "error": lowrank["error"]})
        self._carry = None

    def __enter__(self) -> DistributedGradReducer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def join(self) -> None:
        """This rank has no more data: take part in the other ranks' calls with nothing (collective).

        Returns on every rank once all have joined. Each call meanwhile is
        averaged over its ``contributors`` (an explicit ``degree`` stays the
        divisor). The reducer is usable afterwards; this rank's
        ``allocate_grads`` views then hold zeros.
        """
        while True:
            with self._instrument.unwatched():  # the header: the others may still be computing
                call = self._start(None, joined=True)
            if call.void:
                self.contributors = 0
                return
            asynchronous = call.info is not None and call.info.asynchronous
            if asynchronous and self._overlap.agree_on_readiness(()).any():  # as the others do in wait()
                call.gather_sparse = False  # some rank was not ready: the others gather no RowSparse either
            self._run(call, tune=not asynchronous)

    # -- one call ---------------------------------------------------------------------

    def _start(self, grads: Any, asynchronous: bool = False, sharded: bool = False, joined: bool = False) -> Call:
        """Validate ``grads`` (or, ``joined``, none), open the call, read its header if it goes ahead."""
        if self._active is not None and not self._active.closed:
            raise RuntimeError("a reduction started with begin() or reduce_async() is still in flight; "
                               "wait() for it first")
        if self._comm == MPI.COMM_NULL:
            raise RuntimeError("this reducer was freed")
        if self._tuner is not None and self._tuner.current() != self._bucket_bytes:
            self._plan.free()
            self._build_plan(self._tuner.current())  # on every rank, before anything is sent
        checked = None
        epoch = None
        if not joined:
            checked = self._replay.recall(grads) if self._plan.host else None
            if checked is not None:  # the last call's gradients, unchanged: its verdict stands
                epoch = self._replay.epoch
            else:
                grads, checked = self._check(grads)
                if self._plan.host and self._replay.remember(grads, checked):
                    epoch = self._replay.epoch
            checked = shard.arrays_only(checked) if sharded else checked
            if sharded and self._lowrank is not None:  # refused on every rank, through the agreement
                checked = Checked(ValueError(
                    "reduce_scatter: not supported with compression=PowerSGD(...): a rank would own pieces of "
                    "a low-rank product; use the plain call (reducer(grads)), or a reducer without PowerSGD"))
        self._calls += 1  # on every rank, whether or not the call then raises
        call = open_call(self._calls, grads, self._plan, checked, check_finite=self.check_finite,
                         asynchronous=asynchronous, sharded=sharded)
        call.epoch = epoch
        if grads is None or asynchronous or sharded or call.local.error is not None or self._ctx.first.carrier is None:
            self._ctx.first.announce(call)  # the header now; raises on every rank for bad input on any
        self.nonfinite = False
        return call

    def _check(self, grads: Any) -> tuple[Any, Checked]:
        """The full local checks of ``grads``; any other iterable is first made a list, which is returned."""
        if grads is not None and not isinstance(grads, (list, tuple, Mapping, str, bytes)):
            try:  # any iterable, e.g. (p.grad for p in params)
                grads = list(grads)
            except Exception as exc:  # reported through the agreement, on every rank
                return grads, Checked(TypeError(f"grads: iterating over it raised {exc!r}"))
        aliasing = self.validate == "always" or (self.validate == "first" and self._calls == 0)
        return grads, check_grads(grads, self._plan, aliasing)

    def _run(self, call: Call, tune: bool) -> None:
        """Reduce every bucket of ``call``, then its RowSparse (and PowerSGD's) gradients, and finish it.

        ``tune``: a blocking call, timed while ``bucket_bytes="auto"`` tries its caps.
        """
        t0 = time.perf_counter() if self._tuner is not None else 0.0
        for path, ks in self._runs:  # each run: pack, sum, unpack (or the sum alone, in place)
            path.reduce(ks, call)
        self._tail.reduce(call)
        tuner = self._tuner
        if tuner is not None and tune:
            tuner.record(time.perf_counter() - t0)
            if tuner.finished:
                self._plan.free()
                self._build_plan(tuner.decide(self._comm))
                self._tuner = None
        self._finish(call)

    def _finish(self, call: Call) -> None:
        if call.grads is not call.caller and call.local.contributing:  # stand-ins or RowSparse results
            close(call)
        self.nonfinite = call.nonfinite
        self.contributors = call.info.contributors if call.info is not None else self._comm.Get_size()
        self.stats.calls += 1



class _Tail:
    """The steps after the buckets, in order: the RowSparse gradients, then PowerSGD's."""

    def __init__(self, *steps: Any) -> None:
        self.steps = steps

    def reduce(self, call: Any) -> None:
        """Run every step on ``call``."""
        for step in self.steps:
            step.reduce(call)

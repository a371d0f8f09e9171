"""The ``DistributedOptimizer``: an optimizer wrapper whose gradients are reduced while backward runs.

See the package's docstring for how it works.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .._core import agreement, groups
from .._core.options import Options
from .._core.steps import ReductionStep
from ..reducer import DistributedGradReducer
from .flags import CHANGED, MISUSES, NO_BACKWARD, NOT_DENSE, WRITTEN, ZERO_GRAD, Flags, with_flags, without_flags
from .optimizer_state import send_state
from .tensors import bytes_of, check_same_tensors

__all__ = ["MISUSES", "DistributedOptimizer"]


class DistributedOptimizer:
    """Wraps a torch optimizer: gradients are averaged across the ranks during backward, then it steps.

    Construction is collective over the reducer's ``group``: every rank must
    wrap an optimizer over parameters of the same shapes and dtypes, in the
    same order (checked; a difference raises ``ValueError`` on every rank).
    Parameters that do not require grad are left out (as DDP does).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters
            (every param group).
        backward_passes_per_step: backward passes accumulated locally before
            the gradients are reduced (each ``step()``).
        group: the reducer's communicator (default ``MPI.COMM_WORLD``).
        options: the reducer's options (:class:`~mpi_gradreducer.Options`).
            Per-parameter options (``fusion``, ``skip``, ``split_indices``)
            count the parameters that require grad, in param-group order.
        **more: any field of :class:`~mpi_gradreducer.Options` by name
            (``progress``, ``bucket_bytes``, ``compression``, ...), replacing
            that of ``options``.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: on every rank, for a bad option on any rank or models
            that differ between ranks.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backward_passes_per_step: int = 1,
                 group: MPI.Intracomm | None = None, *, options: Options | None = None, **more: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        asked = (Options() if options is None else options).replace(**more)
        comm = MPI.COMM_WORLD if group is None else group
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"group: expected an mpi4py intracommunicator, got {comm!r}")
        self.optimizer = optimizer
        self._count = _param_count(optimizer)
        where = [(g, j) for g, grp in enumerate(optimizer.param_groups) for j, p in enumerate(grp["params"])
                 if p.requires_grad]
        self._params: list[torch.Tensor] = [optimizer.param_groups[g]["params"][j] for g, j in where]
        self._names = [f"param_groups[{g}]['params'][{j}]" for g, j in where]
        error: BaseException | None = None
        flagged = asked
        try:
            if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                    or backward_passes_per_step < 1:
                raise ValueError(f"backward_passes_per_step: expected an int >= 1, got {backward_passes_per_step!r}")
            if not self._params:
                raise ValueError("optimizer: expected parameters that require grad, got none")
            flagged = with_flags(len(self._params), asked)
        except (TypeError, ValueError) as exc:
            error = exc
        agreement.raise_if_any(comm, error)
        check_same_tensors(comm, self._params, self._names)
        self.passes = backward_passes_per_step
        self._steps = 0
        self._no_sync = self._skip_sync = False
        self._attach(comm, flagged)

    def _attach(self, comm: MPI.Intracomm, flagged: Options) -> None:
        """The reducer over ``comm`` with the flags' options ``flagged``, its gradient views and the hooks
        (collective)."""
        size, rank = comm.Get_size(), comm.Get_rank()
        self._layout = Flags(len(self._params), size, rank, self._side_flags())
        first = self._params[0]
        flags = torch.zeros(self._layout.length, dtype=first.dtype, device=first.device)
        #: The underlying DistributedGradReducer; its first gradient is the flags, then one per parameter.
        self.reducer = DistributedGradReducer([flags, *(p.detach() for p in self._params)], group=comm,
                                              options=flagged)
        self._size, self._rank = size, rank
        self._skip = self.reducer.options.skipped[1:]
        # With a communication thread, buckets are launched during backward (begin/ready); otherwise nothing
        # would advance before step(), which then makes one blocking call: fewer messages, and no rank spins in
        # MPI for the header while the others still compute.
        self._overlap = self.reducer.progress == "thread"
        views = self.reducer.allocate_grads()
        self._flags = _as_tensor(views[0], flags)
        self._grads = [_as_tensor(v, p) for v, p in zip(views[1:], self._params, strict=True)]
        self._control = self.reducer.comm.Dup()  # the wrapper's own messages (join, misuse, state), apart from the data
        self._step: ReductionStep | None = None  # the reduction in flight (progress="thread")
        self._fired: list[int] = []  # per parameter: hook calls that count towards backward_passes_per_step
        self._ready: list[bool] = []  # per parameter: handed to the reduction in this step
        self._versions: list[int] = []  # per parameter: its gradient's version counter when handed over
        self._fired_any = False  # a hook ran since the last step()
        self._synchronized = False
        self._failures: list[tuple[int, str]] = []  # this rank's misuse since the last step(): (kind, message)
        self._reset()
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(_hook(me, i)) for i, p in enumerate(self._params)]

    # -- the optimizer's face ---------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (learning rates may be changed in place)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict()``."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the reduction plan is fixed when the wrapper is made.

        Raises:
            ValueError: always.
        """
        raise ValueError("add_param_group: DistributedOptimizer cannot take parameters added later (the reduction "
                         "plan is fixed); add every param group to the torch optimizer before wrapping it")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, backward_passes_per_step={self.passes})"

    # -- a step ---------------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Set every gradient to None (torch's default), or to zeros in place.

        A reduction already started (backward ran, no ``step()`` yet) is
        finished first, on every rank alike, and its result dropped.
        """
        if self._step is not None:
            self.synchronize()
        self._reset()
        for p, v in zip(self._params, self._grads, strict=True):
            if set_to_none:
                p.grad = None
            else:
                v.zero_()
                p.grad = v

    def synchronize(self) -> None:
        """Finish the reduction: every ``.grad`` then holds the average over the ranks (collective).

        A parameter that some rank used gets the average everywhere (zeros
        stood for the ranks that did not); one that no rank used keeps
        ``.grad`` None. Returns at once when already synchronized since the
        last backward.

        Raises:
            RuntimeError: on every rank, after the reduction, when some rank
                misused the optimizer (no backward since the last step, a
                gradient written after its hook fired, parameters added to the
                optimizer), naming that rank.
        """
        if self._synchronized:
            return
        if _param_count(self.optimizer) != self._count:
            self._fail(CHANGED, f"the optimizer has {_param_count(self.optimizer)} parameters, but "
                                 f"DistributedOptimizer was made with {self._count}; add every param group before "
                                 "wrapping it")
        if not self._fired_any:
            self._fail(NO_BACKWARD, "step() or synchronize() was called without a backward pass since the last "
                                     "step() (no gradient hook fired on this rank)")
        step = self._begin() if self._overlap else None
        used = [False] * len(self._params)
        for i, (p, v) in enumerate(zip(self._params, self._grads, strict=True)):
            g = p.grad
            if self._ready[i]:
                used[i] = True
                if g is not v or v._version != self._versions[i]:
                    self._fail(WRITTEN, f"{self._names[i]}: its gradient was written after its hook fired "
                                         "(after it was handed to the reduction); write gradients only in backward, "
                                         f"at most backward_passes_per_step={self.passes} times per step()")
                continue
            if g is None:
                v.zero_()
            else:
                used[i] = True
                if g is not v:
                    if not _dense(g):
                        self._fail(NOT_DENSE, f"{self._names[i]}: its gradient is {g.layout}; only dense "
                                               "gradients are reduced")
                        v.zero_()
                    else:
                        v.copy_(g)
                    p.grad = v
            if step is not None:
                step.ready(i + 1)
        local = self._layout.encode(used, (kind for kind, _ in self._failures))
        self._side_values(self._layout.side(local))
        self._flags.copy_(torch.from_numpy(local))
        try:
            if step is not None:
                step.ready(0)
                step.wait()
            else:
                self.reducer([self._flags, *self._grads])
        finally:
            self._step = None
        flags = self._flags.detach().cpu().to(torch.float32).numpy()
        for i, (p, some) in enumerate(zip(self._params, self._layout.used(flags), strict=True)):
            if p.grad is None and some and not self._skip[i]:
                p.grad = self._grads[i]  # used on another rank: the average is here
        self._side_reduced(self._layout.side(flags))
        self._synchronized = True
        misuse = self._layout.misuse(flags)
        if misuse is not None:
            failures = self._failures
            self._reset()
            self._raise_misuse(*misuse, failures)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for the reduction (unless in ``skip_synchronize()``), then step the wrapped optimizer.

        Args:
            closure: not supported (its backward would not be reduced): must be None.

        Returns:
            What the wrapped optimizer's ``step`` returns.

        Raises:
            RuntimeError: on every rank, as :meth:`synchronize`, and when some
                rank ran backward between ``synchronize()`` and this step (one
                small message after a ``synchronize()`` of the caller's, while
                no rank is in ``join()``); or inside ``skip_synchronize()``
                after a backward pass that ``synchronize()`` did not reduce.
        """
        if closure is not None:
            raise ValueError("step(closure): closures are not supported (their backward would not be reduced)")
        explicit = self._synchronized
        if not self._skip_sync:
            self.synchronize()
        elif self._fired_any and not self._synchronized:  # whatever the progress mode: nothing reduced yet
            raise RuntimeError("step() inside skip_synchronize() after a backward pass that was not reduced: call "
                               "synchronize() before it")
        if explicit and self.reducer.contributors == self._size:
            late = RuntimeError(self._failures[0][1]) if self._failures else None  # since synchronize()
            try:
                agreement.raise_if_any(self._control, late)
            except BaseException:
                self._reset()  # on every rank: the next step starts afresh everywhere
                raise
        result = self.optimizer.step()
        self._steps += 1
        self._reset()
        return result

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` in this block does not reduce: call ``synchronize()`` before it (e.g. to clip)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in this block accumulate gradients locally; the next one outside reduces them."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def join(self) -> int:
        """This rank has no more data: take part in the other ranks' steps with nothing (collective).

        Each of their steps is averaged over the ranks that contributed to it
        (see :meth:`mpi_gradreducer.DistributedGradReducer.join`). Once every rank has
        joined, the parameters and the optimizer state of the rank that took
        the most steps (the lowest such rank) are copied into every rank's.

        Returns:
            That rank (pass it as ``root`` to :func:`broadcast_parameters` to
            copy the model's buffers as well).

        Raises:
            RuntimeError: when backward ran on this rank since the last ``step()``.
        """
        if self._step is not None or self._fired_any:
            raise RuntimeError("join() after a backward pass without step(): step() first, or zero_grad()")
        self.reducer.join()
        counts = np.array(self._control.allgather(self._steps), dtype=np.int64)
        root = int(np.argmax(counts))
        with torch.no_grad():
            groups.broadcast_parameters([bytes_of(p.detach()) for p in self._params], root=root,
                                        group=self._control)
        send_state(self.comm, self.optimizer, root)
        self._reset()
        return root

    def free(self) -> None:
        """Remove the hooks and free the reducer (collective). Idempotent."""
        self._unhook()
        if self._control != MPI.COMM_NULL:
            self._control.Free()
        self.reducer.free()

    def communicators(self) -> list[MPI.Intracomm]:
        """Every communicator the wrapper holds: its control channel, then its reducer's (local).

        What a lost rank's recovery revokes (:mod:`mpi_gradreducer.elastic`).
        """
        control = [] if self._control == MPI.COMM_NULL else [self._control]
        return control + self.reducer.communicators()

    def abandon(self) -> None:
        """Release the hooks, the control channel and the reducer with no collective: ranks are gone (local).

        See :meth:`mpi_gradreducer.DistributedGradReducer.abandon`. The
        wrapper is unusable until :meth:`rebuild`. Idempotent.
        """
        self._unhook()
        if self._control != MPI.COMM_NULL:
            try:
                self._control.Free()
            except MPI.Exception:
                pass
        self.reducer.abandon()

    def rebuild(self, group: MPI.Intracomm) -> None:
        """Make the wrapper's reducer again over ``group`` (collective over ``group``).

        The wrapped torch optimizer, its state and the model are kept; the
        reducer is made again with the options it had, and the gradient
        hooks are registered over its new buffers. A reduction in flight is
        dropped (the step starts afresh). The new reducer starts afresh too:
        a ``bucket_bytes="auto"`` cap is tuned again, and PowerSGD starts
        from its first iteration (unlike a rebuilt
        :class:`~mpi_gradreducer.DistributedGradReducer`).

        Args:
            group: the new ranks, e.g. the survivors of a lost rank.
        """
        self.abandon()
        self._steps = 0  # every rank goes on from the same synced state (join() picks its root by steps)
        self._attach(group, with_flags(len(self._params), without_flags(self.reducer.options)))

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    @property
    def comm(self) -> MPI.Intracomm:
        """The wrapper's own duplicate of the reducer's communicator (``join`` and the optimizer state use it)."""
        return self._control

    @property
    def synchronized(self) -> bool:
        """True after ``synchronize()`` until the next ``step()`` or ``zero_grad()``."""
        return self._synchronized

    # -- internals ------------------------------------------------------------------------------

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _reset(self) -> None:
        self._step = None
        self._fired = [0] * len(self._params)
        self._ready = [False] * len(self._params)
        self._versions = [0] * len(self._params)
        self._fired_any = False
        self._synchronized = False
        self._failures = []

    def _begin(self) -> ReductionStep:
        if self._step is None:
            self._step = self.reducer.begin([self._flags, *self._grads])
        return self._step

    def _fail(self, kind: int, message: str) -> None:
        if all(k != kind for k, _ in self._failures):
            self._failures.append((kind, message))

    def _on_gradient(self, i: int, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of parameter ``i``."""
        self._fired_any = True
        if self._synchronized:
            self._fail(WRITTEN, f"{self._names[i]}: its gradient was computed after synchronize() and before "
                                 "step(); call backward before synchronize()")
            return
        g, v = p.grad, self._grads[i]
        if g is None:
            return
        if g is not v:
            if not _dense(g):
                self._fail(NOT_DENSE, f"{self._names[i]}: its gradient is {g.layout}; only dense gradients "
                                       "are reduced")
                return
            v.copy_(g)
            p.grad = v
        if self._no_sync:
            return
        self._fired[i] += 1
        if self._fired[i] == self.passes:
            self._ready[i] = True
            self._versions[i] = v._version
            if self._overlap:
                if v.is_cuda and torch.cuda.current_stream(v.device) != torch.cuda.default_stream(v.device):
                    torch.cuda.current_stream(v.device).synchronize()  # the reducer syncs the default stream only
                self._begin().ready(i + 1)
        elif self._fired[i] > self.passes:
            self._fail(WRITTEN, f"{self._names[i]}: its gradient was computed more than "
                                 f"backward_passes_per_step={self.passes} times before step(), the last time "
                                 "after its hook had handed it to the reduction")

    # -- protected hooks for subclasses (mpi_gradreducer.horovod) ----------------------------------------

    def _side_flags(self) -> int:
        """How many values of its own a subclass sends with each reduction's flags (called when the reducer is made).

        They ride in the last bucket like the flags (averaged over the ranks,
        a rank in ``join()`` counting zeros), so they cost no message.
        """
        return 0

    def _side_values(self, out: np.ndarray) -> None:
        """Write this rank's side values into ``out`` (zeros), before each reduction."""

    def _side_reduced(self, values: np.ndarray) -> None:
        """The side values averaged over the ranks, after each reduction (before misuse is raised)."""

    def _backward_ran(self) -> bool:
        """Whether a gradient hook ran since the last ``step()``."""
        return self._fired_any

    def _refuse_zero_grad(self, message: str) -> None:
        """Count ``zero_grad()`` between ``backward()`` and ``step()`` as misuse: raise it on every rank now.

        This rank raises ``message`` from here (its ``synchronize()``), the
        others from their ``step()`` or ``synchronize()``; the optimizer is
        usable again afterwards.
        """
        self._fail(ZERO_GRAD, message)
        self.synchronize()

    def _raise_misuse(self, kind: int, rank: int, failures: Sequence[tuple[int, str]]) -> None:
        """Raise the same RuntimeError on every rank, naming the misuse ``kind`` of ``rank``."""
        detail = next((m for k, m in failures if k == kind), None) if rank == self._rank else None
        if self.reducer.contributors == self._size:  # nobody in join(): the failing rank's words, everywhere
            error = RuntimeError(detail) if detail is not None else None
            agreement.raise_if_any(self._control, error if rank == self._rank else None)
        raise RuntimeError(f"rank {rank}: {MISUSES[kind]}")


def _hook(me: weakref.ReferenceType[DistributedOptimizer], i: int) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        opt = me()
        if opt is not None:
            opt._on_gradient(i, p)

    return hook


def _param_count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(g["params"]) for g in optimizer.param_groups)


def _dense(t: torch.Tensor) -> bool:
    return t.layout == torch.strided


def _as_tensor(view: Any, like: torch.Tensor) -> torch.Tensor:
    """A torch tensor over ``view`` (a numpy or cupy array), or a zero tensor like ``like`` when torch cannot."""
    try:
        t = torch.from_numpy(view) if isinstance(view, np.ndarray) else torch.from_dlpack(view)
    except (TypeError, RuntimeError, BufferError):  # e.g. ml_dtypes.bfloat16: the reducer packs a tensor of torch's
        t = None
    if t is None or t.dtype != like.dtype or t.shape != like.shape or t.device != like.device:
        t = torch.zeros_like(like, memory_format=torch.contiguous_format).detach()
    return t

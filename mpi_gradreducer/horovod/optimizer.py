"""Horovod's ``DistributedOptimizer``, on top of :class:`mpi_gradreducer.torch.DistributedOptimizer`.

Horovod's arguments become the reducer's options: ``op=Sum`` is
``mean=False``; ``Compression.fp16`` is the reducer's 16-bit wire format
(``compression="fp16"``) with ``gradient_predivide_factor`` as its
``predivide`` (Horovod's prescale ``1/f`` and postscale ``f/size``);
``groups``/``num_groups`` become fusion ids; ``process_set`` is the
reducer's communicator (a rank outside the set steps alone, as in Horovod).
Everything else (hooks that reduce while backward runs, ``synchronize``,
``skip_synchronize``, misuse raised on every rank) is the wrapped class's.

Sparse gradients (``nn.Embedding(sparse=True)``) are gathered on the
package's row-sparse path (every rank's rows, no dense copy), after the
dense reduction; with ``sparse_as_dense=True`` they are reduced dense and
made sparse again, as in Horovod. Which parameters had sparse gradients on
some rank rides with the reduction's flags, so a step sends nothing more
when there are none.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .. import torch as mgr_torch
from .._core.options import Options
from .._core.sparse import allgather_rowsparse
from .control import check
from .exceptions import internal_errors
from .ops import Average, Compression, Compressor, ReduceOp, Sum, resolve_op
from .process_sets import global_process_set
from .session import current, waiting_in
from .sparse import from_rowsparse, to_rowsparse
from .submit import set_of

__all__ = ["DistributedOptimizer"]

_WHAT = "DistributedOptimizer"
#: Horovod's warning when step() follows synchronize() outside skip_synchronize().
STEP_AFTER_SYNCHRONIZE = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                          "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


class DistributedOptimizer(mgr_torch.DistributedOptimizer):
    """Horovod's ``hvd.DistributedOptimizer``: gradients are reduced across the ranks, then the optimizer steps.

    Construction is collective over the process set; bad arguments on any
    rank raise the same error on every rank, before anything is changed.

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``(name, parameter)`` tuples (usually
            ``model.named_parameters()``) naming every parameter of the
            optimizer, each name once; used in messages. Default: Horovod's
            ``allreduce.noname.<group>.<index>``.
        compression: ``Compression.none`` or ``Compression.fp16``.
        backward_passes_per_step: backward passes accumulated (summed)
            locally before the gradients are reduced.
        op: ``Average`` or ``Sum`` (``Adasum`` raises ``NotImplementedError``).
        gradient_predivide_factor: ``f``: gradients are multiplied by ``1/f``
            before the sum and by ``f/size`` after it (``op=Average`` only).
            With ``Compression.fp16`` this is the wire format's scaling;
            without compression it changes nothing but rounding, and the
            average is computed directly.
        num_groups: deprecated (as in Horovod): ``groups=num_groups``.
        groups: an int ``k`` (the parameters in ``k`` consecutive groups of
            near-equal count) or lists of parameters, each list reduced
            together and every other parameter alone.
        sparse_as_dense: sparse gradients are reduced dense, then made sparse
            again; without it they are gathered sparse.
        process_set: the ranks that average their gradients; a rank outside
            the set makes the optimizer too and steps with its own gradients.
        options: not Horovod's: the reducer's :class:`~mpi_gradreducer.Options`,
            except what the arguments above set.
        **reducer_options: not Horovod's: any field of
            :class:`~mpi_gradreducer.Options` that the arguments above do not
            set (``progress``, ``bucket_bytes``, ``timeout``, ``timeline``, ...).

    Raises:
        ValueError, TypeError, NotImplementedError: on every rank of the
            process set, for a bad argument on any of them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: Any = global_process_set, *,
                 options: Options | None = None, **reducer_options: Any) -> None:
        ctx = current("hvd.DistributedOptimizer(...)")
        member = process_set is None or getattr(process_set, "included", lambda: True)() is not False
        error: BaseException | None = None
        asked = Options()
        names: dict[Any, str] = {}
        params: list[torch.Tensor] = []
        comm: MPI.Intracomm = MPI.COMM_SELF
        try:
            if member:
                comm = set_of(_WHAT, process_set).comm
            if num_groups != 0:
                warnings.warn("num_groups is deprecated (as in Horovod): use groups", DeprecationWarning, stacklevel=2)
                if groups is None:
                    groups = num_groups
            horovods, names, params = _options(optimizer, named_parameters, compression, op,
                                               gradient_predivide_factor, groups)
            taken = sorted(set(reducer_options) & {"mean", "compression", "predivide", "fusion", "fusion_type",
                                                   "split_indices", "group"})
            if taken:
                raise TypeError(f"{_WHAT}: {', '.join(taken)}: set by Horovod's arguments (op, compression, "
                                "gradient_predivide_factor, groups, process_set); not accepted as reducer options")
            asked = (Options() if options is None else options).replace(**reducer_options, **horovods)
            if asked.elsewhere is None:  # a stall names what else this rank waits in: the engine, other optimizers
                asked = asked.replace(elsewhere=functools.partial(waiting_in, weakref.ref(self)))
        except Exception as exc:  # raised on every rank of the set, never on one alone
            error = exc
        if member:
            check(_WHAT, (), error, process_set)
        elif error is not None:
            raise error
        #: Horovod's map of each parameter to its name.
        self._parameter_names = names
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self._sparse_params = params  # the parameters that require grad, in the wrapped class's order
        self._sparse: dict[int, torch.Tensor] = {}  # sparse gradients of this step, set aside
        self._sparse_dims: dict[int, int] = {}  # their sparse dimensions
        self._found: list[tuple[int, int]] = []  # (parameter, sparse dimensions) sparse on some rank
        self._had_sparse: dict[int, int] = {}  # parameters with sparse gradients last step: sparse dimensions
        self._skipping = False
        me = weakref.ref(self)
        self._sparse_hooks = [p.register_post_accumulate_grad_hook(_sparse_hook(me, i))
                              for i, p in enumerate(params)]  # registered first: they run before the reduction's
        super().__init__(optimizer, backward_passes_per_step=backward_passes_per_step, group=comm, options=asked)
        self.op = ReduceOp.Average if asked.mean else ReduceOp.Sum
        ctx.optimizers.append(weakref.ref(self))

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated before the reduction."""
        return self.passes

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change the number of backward passes per step (on every rank alike, between steps).

        Raises:
            ValueError: ``passes`` is not an int >= 1, or backward ran since the last step.
        """
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"set_backward_passes_per_step: passes: expected an int >= 1, got {passes!r}")
        if self._backward_ran():
            raise ValueError("set_backward_passes_per_step: backward ran since the last step(); call it between "
                             "steps")
        self.passes = passes

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; between ``backward()`` and ``step()`` it raises on every rank.

        The misuse is Horovod's (it raises ``AssertionError`` on the rank
        that made it); here every rank raises the same ``RuntimeError``: the
        misusing rank in ``zero_grad``, the others in ``step()``, and the
        optimizer is usable again after it. Sparse gradients zeroed in place
        stay sparse.
        """
        if self._backward_ran() and not self.synchronized:
            self._refuse_zero_grad("optimizer.zero_grad() was called after loss.backward() but before "
                                   "optimizer.step() or optimizer.synchronize(); call zero_grad() before backward() "
                                   "(or after step())")
        super().zero_grad(set_to_none)
        self._sparse.clear()
        if not set_to_none:
            for i, dims in self._had_sparse.items():
                self._sparse_params[i].grad = _empty_sparse(self._sparse_params[i], dims)

    def synchronize(self) -> None:
        """Finish the reduction (see the wrapped class); sparse gradients are then gathered (collective).

        Raises:
            HorovodInternalError: a rank was lost (as in Horovod; ``hvd.elastic.run`` recovers from it).
            RuntimeError: as the wrapped class; and on the ranks not in
                ``join()`` when some rank is (sparse gradients need every rank:
                use ``sparse_as_dense=True`` with ``join``).
        """
        if self.synchronized:
            return
        try:
            with internal_errors():
                super().synchronize()
        except BaseException:
            self._sparse.clear()
            self._found = []
            raise
        found, self._found = self._found, []
        self._had_sparse = dict(found)
        if found:
            with internal_errors():
                self._finish_sparse(found)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for the reduction (unless in ``skip_synchronize()``), then step the wrapped optimizer.

        Warns, as Horovod, when ``synchronize()`` was called and this step is
        not inside ``skip_synchronize()``.
        """
        if self.synchronized and not self._skipping:
            warnings.warn(STEP_AFTER_SYNCHRONIZE, stacklevel=2)
        return super().step(closure)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` in this block does not reduce: call ``synchronize()`` before it (e.g. to clip)."""
        self._skipping = True
        try:
            with super().skip_synchronize():
                yield
        finally:
            self._skipping = False

    def free(self) -> None:
        """Remove the hooks and free the reducer (collective). Idempotent."""
        for h in self._sparse_hooks:
            h.remove()
        self._sparse_hooks = []
        super().free()

    # -- sparse gradients --------------------------------------------------------------------------------

    def _side_flags(self) -> int:
        return 2 * len(self._sparse_params)

    def _side_values(self, out: np.ndarray) -> None:
        for i, dims in self._sparse_dims.items():
            out[2 * i], out[2 * i + 1] = 1.0, float(dims)
        self._sparse_dims = {}

    def _side_reduced(self, values: np.ndarray) -> None:
        pairs = values.reshape(-1, 2)
        self._found = [(int(i), int(round(pairs[i, 1] / pairs[i, 0]))) for i in np.flatnonzero(pairs[:, 0] > 0)]

    def _on_sparse(self, i: int, p: torch.Tensor) -> None:
        """The hook of parameter ``i`` when its gradient is sparse: set it aside (or make it dense)."""
        g = p.grad
        assert g is not None
        self._sparse_dims[i] = g.sparse_dim()
        if self.sparse_as_dense:
            p.grad = g.to_dense()
            return
        self._sparse[i] = g if i not in self._sparse else self._sparse[i] + g  # passes accumulate
        p.grad = None

    def _finish_sparse(self, found: list[tuple[int, int]]) -> None:
        if self.reducer.contributors != self.comm.Get_size():
            self._sparse.clear()
            raise RuntimeError(f"{_WHAT}: sparse gradients cannot be gathered while a rank is in join() (it takes "
                               "part in the dense reduction only): pass sparse_as_dense=True to reduce them dense")
        size = self.comm.Get_size()
        for i, dims in found:
            p = self._sparse_params[i]
            if self.sparse_as_dense:
                if p.grad is not None:
                    p.grad = p.grad.to_sparse(dims)
                continue
            mine = self._sparse.pop(i, None)
            if mine is None:  # unused here: no rows
                mine = _empty_sparse(p, dims).cpu()
            gathered = allgather_rowsparse(self.comm, to_rowsparse(mine))
            like = mine if mine.sparse_dim() == dims else mine.to_dense().to_sparse(dims)
            result = from_rowsparse(gathered, like, float(size) if self.op == ReduceOp.Average else 1.0)
            p.grad = result if p.grad is None else p.grad + result  # dense on some rank: summed with it
        self._sparse.clear()


def _empty_sparse(p: torch.Tensor, dims: int) -> torch.Tensor:
    """A sparse zero like ``p``'s gradient, with ``dims`` sparse dimensions."""
    return torch.sparse_coo_tensor(torch.zeros((dims, 0), dtype=torch.int64), torch.zeros((0, *p.shape[dims:]),
                                   dtype=p.dtype), p.shape, check_invariants=False).to(p.device)


def _sparse_hook(me: weakref.ReferenceType[DistributedOptimizer], i: int) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        opt = me()
        if opt is not None and p.grad is not None and p.grad.layout == torch.sparse_coo:
            opt._on_sparse(i, p)

    return hook


def _options(optimizer: Any, named_parameters: Any, compression: Any, op: Any, factor: Any,
             groups: Any) -> tuple[dict[str, Any], dict[Any, str], list[torch.Tensor]]:
    """The reducer's options, each parameter's name and the parameters that require grad (local; raises)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_WHAT}: optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    reduce_op = resolve_op(op, None, _WHAT)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"{_WHAT}: op: expected Average or Sum, got {reduce_op.name}")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < float(factor) < float("inf"):
        raise ValueError(f"{_WHAT}: gradient_predivide_factor: expected a positive finite number, got {factor!r}")
    if float(factor) != 1.0 and reduce_op != Average:
        raise ValueError(f"{_WHAT}: gradient_predivide_factor={factor!r} is not supported with op != Average (as in "
                         f"Horovod), got op={reduce_op.name}")
    if compression is Compression.none:
        options: dict[str, Any] = {}
    elif compression is Compression.fp16:
        options = {"compression": "fp16", "predivide": float(factor)}
    elif isinstance(compression, type) and issubclass(compression, Compressor):
        raise ValueError(f"{_WHAT}: compression: only Compression.none and Compression.fp16 are supported (the "
                         f"reducer packs the wire format itself), got {compression.__name__}")
    else:
        raise TypeError(f"{_WHAT}: compression: expected Compression.none or Compression.fp16, got {compression!r}")
    options["mean"] = reduce_op == Average
    params = _params(optimizer)
    names = _names(optimizer, named_parameters)
    ids = _fusion_ids(groups, params)
    if ids is not None:
        options["fusion"] = ids
    return options, names, params


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


def _names(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[Any, str]:
    """Horovod's checks of ``named_parameters``; each parameter's name (Horovod's ``_parameter_names``)."""
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(optimizer.param_groups)
                 for j, p in enumerate(g["params"])]
    else:
        named = list(named_parameters)
    bad = [i for i, item in enumerate(named) if not (isinstance(item, tuple) and len(item) == 2)]
    if bad:
        raise ValueError(f"{_WHAT}: named_parameters: expected a sequence of (name, parameter) tuples, usually "
                         f"model.named_parameters(), got {type(named[bad[0]]).__name__} {named[bad[0]]!r:.80} at "
                         f"index {bad[0]}")
    counts: dict[str, int] = {}
    for k, _ in named:
        counts[k] = counts.get(k, 0) + 1
    dups = sorted(str(k) for k, n in counts.items() if n > 1)
    if dups:
        raise ValueError(f"{_WHAT}: named_parameters: expected unique names, got duplicates: {', '.join(dups)}")
    by_id = {id(p): k for k, p in named}
    unnamed = [f"param_groups[{g}]['params'][{j}] {tuple(p.shape)}" for g, grp in enumerate(optimizer.param_groups)
               for j, p in enumerate(grp["params"]) if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"{_WHAT}: named_parameters: expected every parameter of the optimizer to be named, got "
                         f"{len(unnamed)} unnamed: {', '.join(unnamed[:5])}")
    return {p: k for k, p in sorted(named, key=lambda item: str(item[0]))}


def _fusion_ids(groups: Any, params: list[torch.Tensor]) -> list[int] | None:
    """Horovod's ``groups`` as one fusion id per parameter (None: the reducer's default)."""
    if groups is None:
        return None
    if isinstance(groups, numbers.Integral) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(f"{_WHAT}: groups: expected a non-negative int or lists of tensors, got {groups!r}")
        if groups == 0:
            return None
        count, k = len(params), int(groups)
        size, extra = divmod(count, k)
        ids: list[int] = []
        for g in range(k):
            ids += [g + 1] * (size + (1 if g < extra else 0))
        return ids
    if not isinstance(groups, (list, tuple)):
        raise ValueError(f"{_WHAT}: groups: expected a non-negative int or lists of tensors, got "
                         f"{type(groups).__name__}")
    where = {id(p): i for i, p in enumerate(params)}
    assigned: dict[int, int] = {}
    for g, members in enumerate(groups):
        if not isinstance(members, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in members):
            raise ValueError(f"{_WHAT}: groups[{g}]: expected a list of torch.Tensor, got {members!r:.80}")
        for p in members:
            if id(p) in assigned:
                raise ValueError(f"{_WHAT}: groups: a parameter can only appear once, got one in groups "
                                 f"{assigned[id(p)]} and {g}")
            assigned[id(p)] = g
    ids = [0] * len(params)
    alone = len(groups) + 1
    for p in params:
        i = where[id(p)]
        if id(p) in assigned:
            ids[i] = assigned[id(p)] + 1
        else:
            ids[i] = alone
            alone += 1
    return ids

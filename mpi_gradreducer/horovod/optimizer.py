"""Horovod's ``DistributedOptimizer``, on top of :class:`mpi_gradreducer.torch.DistributedOptimizer`.

Horovod's arguments become the reducer's options: ``op=Sum`` is
``mean=False``; ``Compression.fp16`` is the reducer's 16-bit wire format
(``compression="fp16"``) with ``gradient_predivide_factor`` as its
``predivide`` (Horovod's prescale ``1/f`` and postscale ``f/size``);
``groups``/``num_groups`` become fusion ids. Everything else (hooks that
reduce while backward runs, ``synchronize``, ``skip_synchronize``, misuse
raised on every rank) is the wrapped class's.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .. import torch as mgr_torch
from .._core.options import Options
from .collectives import raise_everywhere
from .context import current
from .elastic import internal_errors
from .ops import Average, Compression, Compressor, ReduceOp, Sum, resolve_op
from .process_sets import check_global, global_process_set

__all__ = ["DistributedOptimizer"]

_WHAT = "DistributedOptimizer"


class DistributedOptimizer(mgr_torch.DistributedOptimizer):
    """Horovod's ``hvd.DistributedOptimizer``: gradients are reduced across the ranks, then the optimizer steps.

    Construction is collective; bad arguments on any rank raise the same
    error on every rank, before anything is changed.

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``(name, parameter)`` tuples (usually
            ``model.named_parameters()``) naming every parameter of the
            optimizer, each name once; used in messages.
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
        sparse_as_dense: sparse gradients are made dense before the reduction
            (and stay dense); without it a sparse gradient is refused.
        process_set: only ``global_process_set``.
        options: not Horovod's: the reducer's :class:`~mpi_gradreducer.Options`,
            except what the arguments above set.
        **reducer_options: not Horovod's: any field of
            :class:`~mpi_gradreducer.Options` that the arguments above do not
            set (``progress``, ``bucket_bytes``, ``timeout``, ``timeline``, ...).

    Raises:
        ValueError, TypeError, NotImplementedError: on every rank, for a bad
            argument on any rank.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: Any = global_process_set, *,
                 options: Options | None = None, **reducer_options: Any) -> None:
        comm = current("hvd.DistributedOptimizer(...)").comm
        error: BaseException | None = None
        asked = Options()
        names: list[str] = []
        try:
            if num_groups != 0:
                warnings.warn("num_groups is deprecated (as in Horovod): use groups", DeprecationWarning, stacklevel=2)
                if groups is None:
                    groups = num_groups
            horovods, names = _options(optimizer, named_parameters, compression, op, gradient_predivide_factor,
                                       groups, process_set)
            taken = sorted(set(reducer_options) & {"mean", "compression", "predivide", "fusion", "fusion_type",
                                                   "split_indices", "group"})
            if taken:
                raise TypeError(f"{_WHAT}: {', '.join(taken)}: set by Horovod's arguments (op, compression, "
                                "gradient_predivide_factor, groups); not accepted as reducer options")
            asked = (Options() if options is None else options).replace(**reducer_options, **horovods)
        except Exception as exc:  # raised on every rank, never on one alone
            error = exc
        raise_everywhere(comm, error)
        self._densify_hooks = [p.register_post_accumulate_grad_hook(_densify) for p in _params(optimizer)] \
            if sparse_as_dense else []  # registered first: they run before the reduction's hooks
        super().__init__(optimizer, backward_passes_per_step=backward_passes_per_step, group=comm, options=asked)
        self._names = names
        self.op = ReduceOp.Average if asked.mean else ReduceOp.Sum

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
        if self._fired_any:
            raise ValueError("set_backward_passes_per_step: backward ran since the last step(); call it between "
                             "steps")
        self.passes = passes

    def synchronize(self) -> None:
        """Finish the reduction (collective); a lost rank raises :class:`HorovodInternalError`, as in Horovod."""
        with internal_errors():
            super().synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; between ``backward()`` and ``step()`` it raises on every rank.

        The misuse is Horovod's (it raises ``AssertionError`` on the rank
        that made it); here every rank raises the same ``RuntimeError``: the
        misusing rank in ``zero_grad``, the others in ``step()``, and the
        optimizer is usable again after it.
        """
        if self._fired_any and not self._synchronized:
            self._fail(mgr_torch._ZERO_GRAD, "optimizer.zero_grad() was called after loss.backward() but before "
                                             "optimizer.step() or optimizer.synchronize(); call zero_grad() before "
                                             "backward() (or after step())")
            self.synchronize()  # raises on every rank: the others are in step() or synchronize()
        super().zero_grad(set_to_none)

    def free(self) -> None:
        """Remove the hooks and free the reducer (collective). Idempotent."""
        for h in self._densify_hooks:
            h.remove()
        self._densify_hooks = []
        super().free()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


def _densify(p: torch.Tensor) -> None:
    if p.grad is not None and p.grad.layout != torch.strided:
        p.grad = p.grad.to_dense()


def _options(optimizer: Any, named_parameters: Any, compression: Any, op: Any, factor: Any, groups: Any,
             process_set: Any) -> tuple[dict[str, Any], list[str]]:
    """The reducer's options and the parameters' names (local; raises on bad arguments)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_WHAT}: optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_global(process_set, _WHAT)
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
    names = _names(optimizer, named_parameters, params)
    ids = _fusion_ids(groups, params)
    if ids is not None:
        options["fusion"] = ids
    return options, names


def _names(optimizer: torch.optim.Optimizer, named_parameters: Any, params: list[torch.Tensor]) -> list[str]:
    """Horovod's checks of ``named_parameters``; the names of ``params``."""
    every = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(every)]
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
    return [f"parameter {by_id[id(p)]!r}" for p in params]


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

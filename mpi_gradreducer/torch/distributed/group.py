"""``MPIProcessGroup``: every ``ProcessGroup`` call of torch on the package's collectives."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..._core import agreement
from ..._core.dtypes import digest
from ..._core.halves import SliceSum
from ..._core.options import TIMEOUT_ENV, Options, resolve
from ..._core.topology import Topology
from ..._core.transport import CHUNK_BYTES, CHUNK_BYTES_ACROSS_HOSTS
from ..._core.watchdog import Watchdog
from ..._core.wire import get_compression
from .basics import (
    _BOOL_OPS,
    _HALVES,
    _MPI_OPS,
    _MPI_TYPES,
    _OPERATIONS,
    _REDUCTIONS,
    BACKEND,
    _apart,
    _as_list,
    _check_reducible,
    _chunks,
    _displacements,
    _dtype_name,
    _env_has,
    _Host,
    _per_rank,
    _reduction,
    _row,
    _tensor,
)
from .work import MPIWork, _Engine

#: Where a group spans several hosts, its all-reduces go in chunks of ``CHUNK_BYTES_ACROSS_HOSTS`` (1 MiB), this
#: many in flight, which keeps the links busy (chosen with the DDP benchmark across hosts; the runs:
#: CHANGELOG, 0.8.0).
ACROSS_HOSTS_IN_FLIGHT = 4


class MPIProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group over its own MPI communicator.

    Made by ``init_process_group("mpi_gradreducer", ...)`` and ``new_group(...,
    backend="mpi_gradreducer")``; construction is collective over ``comm``.

    Args:
        comm: the group's ranks, in torch's order; the group takes it over
            (and frees it at ``shutdown()``).
        options: a :class:`~mpi_gradreducer.Options` (``validate``,
            ``timeout``, ``stall_warning``, ``abort_on_exception`` are read), or None.
        timeout: torch's timeout for the group: the watchdog's, unless
            ``options`` or ``MPI_GRADREDUCER_TIMEOUT`` give one.
    """

    def __init__(self, comm: MPI.Intracomm, options: Options | None = None,
                 timeout: datetime.timedelta | None = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())  # type: ignore[call-arg]
        asked = Options() if options is None else options
        error: BaseException | None = None
        resolved = asked
        try:
            if not isinstance(asked, Options):
                raise TypeError(f"pg_options: expected a mpi_gradreducer.Options or None, got {type(asked).__name__}")
            resolved = resolve(asked, (), comm.Get_size())
        except (TypeError, ValueError) as exc:
            error = exc
        agreement.raise_if_any(comm, error)
        self._comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._group_name, self._group_desc = "", ""
        self._validate = resolved.validate != "never"
        watchdog_timeout = resolved.timeout
        if asked.timeout == "env" and not _env_has(TIMEOUT_ENV) and timeout is not None:
            watchdog_timeout = timeout.total_seconds()
        self._spawner = comm.Dup()  # new_group's sub-communicators are made on it, from the caller's thread
        self._p2p = comm.Dup()  # point-to-point, posted from the caller's thread
        assert isinstance(watchdog_timeout, float | int | None) and not isinstance(resolved.stall_warning, str)
        self._watchdog = Watchdog(comm, watchdog_timeout, resolved.stall_warning,
                                  hook=bool(resolved.abort_on_exception))
        self._engine = _Engine(f"{BACKEND}-collectives", naps=False)
        self._p2p_engine = _Engine(f"{BACKEND}-p2p")
        self._halves: dict[torch.dtype, SliceSum] = {}
        across = Topology.of(comm).hosts > 1
        #: Bytes per Iallreduce, and how many are in flight (see ACROSS_HOSTS_IN_FLIGHT).
        self._chunk = CHUNK_BYTES_ACROSS_HOSTS if across else CHUNK_BYTES
        self._window = ACROSS_HOSTS_IN_FLIGHT if across else 1
        self._calls = 0
        self._closed = False

    # -- identity --

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    @property
    def comm(self) -> MPI.Intracomm:
        """The group's communicator (for MPI calls of the caller's own beside torch's)."""
        return self._comm

    def __repr__(self) -> str:
        return f"MPIProcessGroup(rank={self._rank}, size={self._size}, name={self._group_name!r})"

    # torch keeps a group's name and description in its C++ backends, of which a Python group has none.

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # -- the core of every collective --

    def _submit(self, operation: str, outputs: list[torch.Tensor], error: BaseException | None,
                rows: list[tuple[int, ...]], body: Callable[[], None]) -> MPIWork:
        """Queue ``body`` after the ranks' agreement on ``rows`` (and on ``error``); return its work."""
        if self._closed:
            raise RuntimeError(f"{operation}: the process group was shut down")
        self._calls += 1
        call = self._calls
        work = MPIWork(operation, outputs, self._engine)

        def job() -> None:
            self._watchdog.arm(lambda: operation, call)  # the agreement is where a missing rank is waited for
            try:
                if self._validate:
                    self._agree(operation, error, rows)
                elif error is not None:
                    raise error
                body()
            finally:
                self._watchdog.disarm()

        return self._engine.submit(work, job)

    def _agree(self, operation: str, error: BaseException | None, rows: list[tuple[int, ...]]) -> None:
        """Raise the same error on every rank when one rank failed or the ranks' rows differ."""
        try:
            agreement.raise_if_any(self._comm, error, checks=(len(rows), digest([v for r in rows for v in r])))
        except agreement.ChecksDiffer:
            def describe(i: int, row: tuple[int, ...]) -> str:
                if i == 0:
                    head = f"{_OPERATIONS[row[0]]}" if row and row[0] < len(_OPERATIONS) else "another operation"
                    more = f" with ReduceOp.{_REDUCTIONS[row[1]]}" if len(row) > 1 and row[1] >= 0 else ""
                    return head + more + (f" (root {row[2]})" if len(row) > 2 and row[2] >= 0 else "")
                return f"dtype {_dtype_name(row[0])}, {row[1]} dims" + (f", shape {tuple(row[2:])}" if len(row) > 2
                                                                      else "")

            agreement.check_same(self._comm, rows, describe,
                                 lambda i: f"{operation}: the call" if i == 0 else f"{operation}: tensor {i - 1}")
            raise

    def _head(self, operation: str, op: str = "", root: int = -1) -> tuple[int, ...]:
        return (_OPERATIONS.index(operation), _REDUCTIONS.index(op) if op in _REDUCTIONS else -1, root)

    def _wait(self, request: MPI.Request) -> None:
        self._engine.polling.wait(request)

    def _summer(self, dtype: torch.dtype) -> SliceSum:
        summer = self._halves.get(dtype)
        if summer is None:
            compression = get_compression("fp16" if dtype == torch.float16 else "bf16")
            summer = SliceSum(self._comm, compression, CHUNK_BYTES, "alltoall", wait=self._wait)
            self._halves[dtype] = summer
        return summer

    def _check_root(self, operation: str, root: int) -> None:
        if not 0 <= root < self._comm.Get_size():
            raise ValueError(f"{operation}: root: expected a rank in [0, {self._comm.Get_size() - 1}], got {root}")

    # -- reductions --

    def _reduce_host(self, h: _Host, op: str) -> None:
        """Reduce ``h.host`` across the ranks in place (every rank gets the result)."""
        t = h.host
        n, size = t.numel(), self._comm.Get_size()
        if n == 0:
            return
        if t.dtype in _HALVES:
            if op in ("SUM", "AVG"):
                summer = self._summer(t.dtype)
                summer.reduce(h.bytes().view(summer.compression.wire_dtype), 1.0 / size if op == "AVG" else 1.0)
                return
            wide = _Host(t.float())
            self._allreduce_bytes(wide, op)
            t.copy_(wide.host)
            return
        self._allreduce_bytes(h, op)
        if op == "AVG":
            t.div_(size)

    def _allreduce_bytes(self, h: _Host, op: str) -> None:
        t = h.host
        if self._comm.Get_size() == 1:
            return
        mpi_type = _MPI_TYPES[t.dtype]
        mpi_op = _BOOL_OPS[op] if t.dtype == torch.bool else _MPI_OPS[op]
        data = h.bytes()
        item = t.element_size()
        flight: list[MPI.Request] = []
        try:
            for part in _chunks(t.numel(), item, self._chunk):
                piece = data[part.start * item: part.stop * item]
                flight.append(self._comm.Iallreduce(MPI.IN_PLACE, [piece, part.stop - part.start, mpi_type],
                                                    op=mpi_op))
                if len(flight) >= self._window:
                    self._wait(flight.pop(0))
            while flight:
                self._wait(flight.pop(0))
        except BaseException:
            MPI.Request.Waitall(flight)  # MPI may still write the buffer
            raise

    def allreduce(self, tensors: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``all_reduce``: every ``ReduceOp`` MPI can do, ``AVG`` included."""
        return self._allreduce("allreduce", _as_list(tensors), opts)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> MPIWork:
        """``all_reduce_coalesced`` and the coalescing manager's ``all_reduce``: one work for all tensors."""
        return self._allreduce("allreduce", _as_list(tensors), opts)

    def _allreduce(self, operation: str, tensors: list[Any], opts: Any) -> MPIWork:
        op = _reduction(dist.ReduceOp.SUM if opts is None else getattr(opts, "reduceOp", opts))
        error: BaseException | None = None
        hosts: list[_Host] = []
        rows = [self._head(operation, op)]
        try:
            for i, t in enumerate(tensors):
                _tensor(t, f"tensors[{i}]", "all_reduce")
                rows.append(_row(t))
                _check_reducible("all_reduce", t.dtype, op)
                hosts.append(_Host(t))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for h in hosts:
                self._reduce_host(h, op)
            for h in hosts:
                h.back()

        return self._submit(operation, tensors, error, rows, body)

    def reduce(self, tensors: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``reduce``: the root gets the reduction (other ranks' tensors are left as they were)."""
        tensors = _as_list(tensors)
        op = _reduction(getattr(opts, "reduceOp", dist.ReduceOp.SUM))
        root = int(getattr(opts, "rootRank", 0))
        error: BaseException | None = None
        hosts: list[_Host] = []
        rows = [self._head("reduce", op, root)]
        try:
            self._check_root("reduce", root)
            for i, t in enumerate(tensors):
                _tensor(t, f"tensors[{i}]", "reduce")
                rows.append(_row(t))
                _check_reducible("reduce", t.dtype, op)
                hosts.append(_Host(t))
        except (TypeError, ValueError) as exc:
            error = exc
        rank = self._comm.Get_rank()

        def body() -> None:
            for h in hosts:
                t = h.host
                if t.dtype in _HALVES or self._comm.Get_size() == 1:
                    scratch = _Host(t.clone()) if rank != root else h
                    self._reduce_host(scratch, op)
                    continue
                mpi_type = _MPI_TYPES[t.dtype]
                mpi_op = _BOOL_OPS[op] if t.dtype == torch.bool else _MPI_OPS[op]
                data, n = h.bytes(), t.numel()
                if rank == root:
                    self._wait(self._comm.Ireduce(MPI.IN_PLACE, [data, n, mpi_type], op=mpi_op, root=root))
                    if op == "AVG":
                        t.div_(self._comm.Get_size())
                else:
                    self._wait(self._comm.Ireduce([data, n, mpi_type], None, op=mpi_op, root=root))
            if rank == root:
                for h in hosts:
                    h.back()

        return self._submit("reduce", tensors, error, rows, body)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``reduce_scatter``: rank ``r`` gets the reduction of every rank's ``input_list[r]``."""
        outputs, lists = _as_list(outputs), [list(x) for x in inputs]
        op = _reduction(getattr(opts, "reduceOp", dist.ReduceOp.SUM))
        size = self._comm.Get_size()
        error: BaseException | None = None
        pairs: list[tuple[_Host, _Host]] = []
        rows = [self._head("reduce_scatter", op)]
        try:
            if len(lists) != len(outputs):
                raise ValueError(f"reduce_scatter: expected one input list per output, got {len(lists)} for "
                                 f"{len(outputs)}")
            for i, (out, parts) in enumerate(zip(outputs, lists, strict=True)):
                _tensor(out, f"output[{i}]", "reduce_scatter")
                rows.append(_row(out))
                _check_reducible("reduce_scatter", out.dtype, op)
                if len(parts) != size:
                    raise ValueError(f"reduce_scatter: input_list: expected {size} tensors (one per rank), got "
                                     f"{len(parts)}")
                for j, p in enumerate(parts):
                    _tensor(p, f"input_list[{j}]", "reduce_scatter")
                    if p.dtype != out.dtype or p.numel() != out.numel():
                        raise ValueError(f"reduce_scatter: input_list[{j}]: expected {out.numel()} elements of "
                                         f"{out.dtype} (the output's), got {p.numel()} of {p.dtype}")
                flat = torch.cat([p.detach().reshape(-1).cpu() for p in parts]) if parts else out.new_empty(0)
                pairs.append((_Host(out, read=False), _Host(flat)))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for out, flat in pairs:
                self._reduce_scatter_host(out, flat, op)
                out.back()

        return self._submit("reduce_scatter", outputs, error, rows, body)

    def _reduce_scatter_host(self, out: _Host, flat: _Host, op: str) -> None:
        """``out`` = this rank's block of the reduction of every rank's ``flat``."""
        n, size, rank = out.host.numel(), self._comm.Get_size(), self._comm.Get_rank()
        if n == 0:
            return
        t = flat.host
        if t.dtype in _HALVES or size == 1:
            scratch = _Host(t.clone()) if not flat.copied else flat
            self._reduce_host(scratch, op)
            out.host.reshape(-1).copy_(scratch.host.reshape(-1)[rank * n:(rank + 1) * n])
            return
        mpi_type = _MPI_TYPES[t.dtype]
        mpi_op = _BOOL_OPS[op] if t.dtype == torch.bool else _MPI_OPS[op]
        send = flat.bytes()
        if np.may_share_memory(send, out.bytes()):
            send = send.copy()
        self._wait(self._comm.Ireduce_scatter_block([send, n, mpi_type], [out.bytes(), n, mpi_type],
                                                    op=mpi_op))
        if op == "AVG":
            out.host.div_(size)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        """``reduce_scatter_tensor``: rank ``r`` gets block ``r`` of the reduction of every rank's ``input``."""
        return self._reduce_scatter_tensors([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:
        """The coalesced ``reduce_scatter_tensor``: one work for all pairs."""
        return self._reduce_scatter_tensors(list(outputs), list(inputs), opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def _reduce_scatter_tensors(self, outputs: list[Any], inputs: list[Any], opts: Any) -> MPIWork:
        op = _reduction(getattr(opts, "reduceOp", dist.ReduceOp.SUM))
        size = self._comm.Get_size()
        error: BaseException | None = None
        pairs: list[tuple[_Host, _Host]] = []
        rows = [self._head("reduce_scatter_tensor", op)]
        try:
            if len(outputs) != len(inputs):
                raise ValueError(f"reduce_scatter_tensor: expected as many outputs as inputs, got {len(outputs)} "
                                 f"and {len(inputs)}")
            for i, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
                _tensor(out, f"output[{i}]", "reduce_scatter_tensor")
                _tensor(inp, f"input[{i}]", "reduce_scatter_tensor")
                rows.append(_row(inp))
                _check_reducible("reduce_scatter_tensor", inp.dtype, op)
                if out.dtype != inp.dtype or inp.numel() != size * out.numel():
                    raise ValueError(f"reduce_scatter_tensor: input[{i}]: expected {size} x {out.numel()} elements "
                                     f"of {out.dtype} (the output's, once per rank), got {inp.numel()} of {inp.dtype}")
                pairs.append((_Host(out, read=False), _Host(inp)))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for out, inp in pairs:
                self._reduce_scatter_host(out, inp, op)
                out.back()

        return self._submit("reduce_scatter_tensor", outputs, error, rows, body)

    # -- data movement --

    def broadcast(self, tensors: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``broadcast``: the root's tensor into every rank's."""
        tensors = _as_list(tensors)
        root = int(opts if isinstance(opts, int) else getattr(opts, "rootRank", 0))
        error: BaseException | None = None
        hosts: list[_Host] = []
        rows = [self._head("broadcast", root=root)]
        try:
            self._check_root("broadcast", root)
            for i, t in enumerate(tensors):
                rows.append(_row(_tensor(t, f"tensors[{i}]", "broadcast")))
                hosts.append(_Host(t, read=self._comm.Get_rank() == root))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for h in hosts:
                if h.host.numel() and self._comm.Get_size() > 1:
                    self._wait(self._comm.Ibcast(h.bytes(), root=root))
                h.back()

        return self._submit("broadcast", tensors, error, rows, body)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:
        """``all_gather``: every rank's tensor into every rank's list."""
        return self._allgather_lists([list(o) for o in outputs], _as_list(inputs))

    allgather_coalesced = allgather  # type: ignore[assignment]

    def _allgather_lists(self, outputs: list[list[Any]], inputs: list[Any]) -> MPIWork:
        size = self._comm.Get_size()
        error: BaseException | None = None
        jobs: list[tuple[_Host, list[_Host]]] = []
        rows = [self._head("allgather")]
        try:
            if len(outputs) != len(inputs):
                raise ValueError(f"all_gather: expected one output list per input, got {len(outputs)} for "
                                 f"{len(inputs)}")
            for i, (outs, inp) in enumerate(zip(outputs, inputs, strict=True)):
                rows.append(_row(_tensor(inp, f"input[{i}]", "all_gather")))
                if len(outs) != size:
                    raise ValueError(f"all_gather: tensor_list: expected {size} tensors (one per rank), "
                                     f"got {len(outs)}")
                for j, o in enumerate(outs):
                    _tensor(o, f"tensor_list[{j}]", "all_gather")
                    if o.dtype != inp.dtype or o.numel() != inp.numel():
                        raise ValueError(f"all_gather: tensor_list[{j}]: expected {inp.numel()} elements of "
                                         f"{inp.dtype} (the input's), got {o.numel()} of {o.dtype}")
                jobs.append((_Host(inp), [_Host(o, read=False) for o in outs]))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for inp, outs in jobs:
                nbytes = inp.bytes().nbytes
                gathered = np.empty(size * nbytes, dtype=np.uint8)
                self._wait(self._comm.Iallgather(inp.bytes(), gathered))
                for r, o in enumerate(outs):
                    o.bytes()[:] = gathered[r * nbytes:(r + 1) * nbytes]
                    o.back()

        return self._submit("allgather", [o for outs in outputs for o in outs], error, rows, body)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> MPIWork:
        """``all_gather_into_tensor``: every rank's tensor, in rank order, into one tensor."""
        return self._allgather_tensors([output], [input])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:
        """The coalesced ``all_gather_into_tensor``: one work for all pairs."""
        return self._allgather_tensors(list(outputs), list(inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def _allgather_tensors(self, outputs: list[Any], inputs: list[Any]) -> MPIWork:
        size = self._comm.Get_size()
        error: BaseException | None = None
        pairs: list[tuple[_Host, _Host]] = []
        rows = [self._head("all_gather_into_tensor")]
        try:
            if len(outputs) != len(inputs):
                raise ValueError(f"all_gather_into_tensor: expected as many outputs as inputs, got {len(outputs)} "
                                 f"and {len(inputs)}")
            for i, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
                _tensor(out, f"output[{i}]", "all_gather_into_tensor")
                rows.append(_row(_tensor(inp, f"input[{i}]", "all_gather_into_tensor")))
                if out.dtype != inp.dtype or out.numel() != size * inp.numel():
                    raise ValueError(f"all_gather_into_tensor: output[{i}]: expected {size} x {inp.numel()} elements "
                                     f"of {inp.dtype} (the input's, once per rank), got {out.numel()} of {out.dtype}")
                pairs.append((_Host(out, read=False), _Host(inp)))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            for out, inp in pairs:
                send = _apart(inp.bytes(), out.bytes(), self._comm.Get_rank())  # held: the request does not hold it
                self._wait(self._comm.Iallgather(send, out.bytes()))
                out.back()

        return self._submit("all_gather_into_tensor", outputs, error, rows, body)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``gather``: every rank's tensor into the root's list."""
        lists, inputs = [list(o) for o in outputs], _as_list(inputs)
        root = int(getattr(opts, "rootRank", 0))
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        error: BaseException | None = None
        inp: _Host | None = None
        outs: list[_Host] = []
        rows = [self._head("gather", root=root)]
        try:
            self._check_root("gather", root)
            if len(inputs) != 1:
                raise ValueError(f"gather: expected one input tensor, got {len(inputs)}")
            t = _tensor(inputs[0], "tensor", "gather")
            rows.append(_row(t))
            if rank == root:
                outs = [_Host(o, read=False) for o in _per_rank(lists, size, t, "gather_list", "gather")]
            inp = _Host(t)
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            assert inp is not None
            data = inp.bytes()
            if rank == root:
                gathered = np.empty(size * data.nbytes, dtype=np.uint8)
                self._wait(self._comm.Igather(data, gathered, root=root))
                for r, o in enumerate(outs):
                    o.bytes()[:] = gathered[r * data.nbytes:(r + 1) * data.nbytes]
                    o.back()
            else:
                self._wait(self._comm.Igather(data, None, root=root))

        return self._submit("gather", [o for x in lists for o in x], error, rows, body)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:  # type: ignore[override]
        """``scatter``: the root's list, one tensor to each rank."""
        outputs, lists = _as_list(outputs), [list(x) for x in inputs]
        root = int(getattr(opts, "rootRank", 0))
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        error: BaseException | None = None
        out: _Host | None = None
        send: _Host | None = None
        rows = [self._head("scatter", root=root)]
        try:
            self._check_root("scatter", root)
            if len(outputs) != 1:
                raise ValueError(f"scatter: expected one output tensor, got {len(outputs)}")
            t = _tensor(outputs[0], "tensor", "scatter")
            rows.append(_row(t))
            if rank == root:
                parts = _per_rank(lists, size, t, "scatter_list", "scatter")
                send = _Host(torch.cat([p.detach().reshape(-1).cpu() for p in parts]))
            out = _Host(t, read=False)
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            assert out is not None
            self._wait(self._comm.Iscatter(None if send is None else send.bytes(), out.bytes(), root=root))
            out.back()

        return self._submit("scatter", outputs, error, rows, body)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None) -> MPIWork:
        """``all_to_all_single``: even splits, or uneven ones along dimension 0."""
        error: BaseException | None = None
        pair: tuple[_Host, _Host] | None = None
        counts: tuple[list[int], list[int]] = ([], [])
        rows = [self._head("all_to_all_single")]
        try:
            out = _tensor(output, "output", "all_to_all_single")
            inp = _tensor(input, "input", "all_to_all_single")
            rows.append(_row(inp, shape=False))
            if out.dtype != inp.dtype:
                raise ValueError(f"all_to_all_single: output: expected dtype {inp.dtype} (the input's), got "
                                 f"{out.dtype}")
            counts = (self._splits("input", inp, list(input_split_sizes)),
                      self._splits("output", out, list(output_split_sizes)))
            pair = (_Host(out, read=False), _Host(inp))
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            assert pair is not None
            out, inp = pair
            send, recv = counts
            self._check_counts("all_to_all_single", send, recv)
            self._wait(self._comm.Ialltoallv([inp.bytes(), (send, _displacements(send)), MPI.BYTE],
                                             [out.bytes(), (recv, _displacements(recv)), MPI.BYTE]))
            out.back()

        return self._submit("all_to_all_single", [output], error, rows, body)

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def _splits(self, what: str, t: torch.Tensor, splits: list[int]) -> list[int]:
        """Bytes to or from each rank: ``splits`` rows of dimension 0 (even: none given)."""
        size = self._comm.Get_size()
        rows = t.shape[0] if t.dim() else 1
        row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
        if not splits:
            if rows % size:
                raise ValueError(f"all_to_all_single: {what}: {rows} rows cannot be split evenly over {size} ranks; "
                                 f"pass {what}_split_sizes")
            return [rows // size * row_bytes] * size
        if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"all_to_all_single: {what}_split_sizes: expected {size} sizes >= 0 that sum to "
                             f"{rows} (the {what}'s first dimension), got {splits}")
        return [int(s) * row_bytes for s in splits]

    def _check_counts(self, operation: str, send: list[int], recv: list[int]) -> None:
        """When validating: what each rank sends this one must be what it expects (else all raise)."""
        if not self._validate or self._comm.Get_size() == 1:
            return
        told = np.empty(self._comm.Get_size(), dtype=np.int64)
        self._wait(self._comm.Ialltoall(np.asarray(send, dtype=np.int64), told))
        error = None
        bad = [r for r in range(len(recv)) if told[r] != recv[r]]
        if bad:
            r = bad[0]
            error = ValueError(f"{operation}: rank {r} sends {int(told[r])} bytes to rank {self._comm.Get_rank()}, "
                               f"which expects {recv[r]}; make the split sizes agree")
        agreement.raise_if_any(self._comm, error)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> MPIWork:
        """``all_to_all``: ``input_list[r]`` to rank ``r``, rank ``r``'s into ``output_list[r]`` (any sizes)."""
        outputs, inputs = list(outputs), list(inputs)
        size = self._comm.Get_size()
        error: BaseException | None = None
        outs: list[_Host] = []
        send: _Host | None = None
        counts: tuple[list[int], list[int]] = ([], [])
        rows = [self._head("all_to_all")]
        try:
            if len(outputs) != size or len(inputs) != size:
                raise ValueError(f"all_to_all: expected {size} output and {size} input tensors (one per rank), got "
                                 f"{len(outputs)} and {len(inputs)}")
            for j, (o, i) in enumerate(zip(outputs, inputs, strict=True)):
                _tensor(o, f"output_tensor_list[{j}]", "all_to_all")
                _tensor(i, f"input_tensor_list[{j}]", "all_to_all")
                if o.dtype != inputs[0].dtype or i.dtype != inputs[0].dtype:
                    raise ValueError(f"all_to_all: expected every tensor of dtype {inputs[0].dtype}, got {o.dtype} "
                                     f"and {i.dtype} at [{j}]")
            rows.append(_row(inputs[0], shape=False) if inputs else (0,))
            counts = ([i.numel() * i.element_size() for i in inputs], [o.numel() * o.element_size() for o in outputs])
            send = _Host(torch.cat([i.detach().reshape(-1).cpu() for i in inputs]))
            outs = [_Host(o, read=False) for o in outputs]
        except (TypeError, ValueError) as exc:
            error = exc

        def body() -> None:
            assert send is not None
            sent, expected = counts
            self._check_counts("all_to_all", sent, expected)
            recv = np.empty(sum(expected), dtype=np.uint8)
            places = _displacements(expected)
            self._wait(self._comm.Ialltoallv([send.bytes(), (sent, _displacements(sent)), MPI.BYTE],
                                             [recv, (expected, places), MPI.BYTE]))
            for o, start, n in zip(outs, places, expected, strict=True):
                o.bytes()[:] = recv[start:start + n]
                o.back()

        return self._submit("all_to_all", outputs, error, rows, body)

    def barrier(self, opts: Any = None) -> MPIWork:
        """``barrier``: completes when every rank of the group has called it."""
        return self._submit("barrier", [], None, [self._head("barrier")],
                            lambda: self._wait(self._comm.Ibarrier()))

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that raises ``RuntimeError`` when it does not complete within ``timeout``.

        (torch's ``dist.monitored_barrier`` accepts only gloo groups: call it on the group
        itself. The package's watchdog names the missing ranks of any collective that stalls.)
        """
        self.barrier().wait(timeout)

    # -- point to point --

    def send(self, tensors: Any, dst: int, tag: int = 0) -> MPIWork:
        """``send``/``isend``: posted at once; the work completes when MPI is done with the tensor."""
        tensors = _as_list(tensors)
        self._check_peer("send", "dst", dst, tag, len(tensors))
        h = _Host(_tensor(tensors[0], "tensor", "send"))
        request = self._p2p.Isend(h.bytes(), dest=dst, tag=tag)
        work = MPIWork("send", tensors, self._p2p_engine)
        return self._p2p_engine.submit(work, lambda: self._p2p_engine.polling.wait(request))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> MPIWork:
        """``recv``/``irecv`` from rank ``src``."""
        tensors = _as_list(tensors)
        self._check_peer("recv", "src", src, tag, len(tensors))
        return self._receive(tensors, src, tag)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> MPIWork:
        """``recv`` from any rank (``src=None``); the work's ``_source_rank()`` says which."""
        tensors = _as_list(tensors)
        self._check_peer("recv", "src", 0, tag, len(tensors))
        return self._receive(tensors, MPI.ANY_SOURCE, tag)

    def _receive(self, tensors: list[torch.Tensor], src: int, tag: int) -> MPIWork:
        h = _Host(_tensor(tensors[0], "tensor", "recv"), read=False)
        # From any rank: a matched probe on the receiving thread, then the receive of that message. MPICH 5.0.2's
        # receive posted for MPI.ANY_SOURCE was seen to miss a message for good between hosts (shared memory and
        # the network module both in play); a matched probe takes it.
        request = None if src == MPI.ANY_SOURCE else self._p2p.Irecv(h.bytes(), source=src, tag=tag)
        work = MPIWork("recv", tensors, self._p2p_engine)

        def job() -> None:
            status = MPI.Status()
            if request is None:
                self._p2p.Mprobe(MPI.ANY_SOURCE, tag, status).Recv(h.bytes())
            else:
                request.Wait(status)
            count = status.Get_count(MPI.BYTE)
            if count != h.host.numel() * h.host.element_size():
                raise ValueError(f"recv: rank {status.Get_source()} sent {count} bytes, but the tensor holds "
                                 f"{h.host.numel() * h.host.element_size()}")
            work._source = status.Get_source()
            h.back()

        return self._p2p_engine.submit(work, job)

    def _check_peer(self, operation: str, what: str, peer: int, tag: int, count: int) -> None:
        if count != 1:
            raise ValueError(f"{operation}: expected one tensor, got {count}")
        if not 0 <= peer < self._comm.Get_size():
            raise ValueError(f"{operation}: {what}: expected a rank in [0, {self._comm.Get_size() - 1}], got {peer}")
        top = self._p2p.Get_attr(MPI.TAG_UB)
        if not 0 <= tag <= (top if isinstance(top, int) else 32767):
            raise ValueError(f"{operation}: tag: expected 0 <= tag <= {top}, got {tag}")

    # -- life --

    @property
    def mpi_error(self) -> MPI.Exception | None:
        """The last MPI error a call of this group raised (a lost rank, a revoked communicator), or None."""
        return self._engine.mpi_error or self._p2p_engine.mpi_error

    def communicators(self) -> Iterator[MPI.Comm]:
        """The group's own communicators: those a failure must revoke (:class:`ElasticGroup`)."""
        yield from (self._comm, self._spawner, self._p2p)

    def shutdown(self) -> None:
        """Finish the queued calls, stop the threads and the watchdog, free the communicators (local).

        After a lost rank, once :mod:`mpi_gradreducer.elastic` has revoked the
        communicators, the queued calls fail at once, and Open MPI with ULFM
        frees a revoked communicator without its peers.
        """
        if self._closed:
            return
        self._closed = True
        self._engine.close()
        self._p2p_engine.close(wait=0.0 if self.mpi_error is not None else None)
        self._watchdog.close()
        for summer in self._halves.values():
            summer.compression.free()
        for comm in (self._p2p, self._spawner, self._comm):
            try:
                comm.Free()
            except MPI.Exception:
                if self.mpi_error is None:
                    raise

    def abort(self) -> None:
        """As :meth:`shutdown` (MPI cannot cancel a collective in flight)."""
        self.shutdown()

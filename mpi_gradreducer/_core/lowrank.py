"""The PowerSGD path: the compressed gradients of a call, reduced as low-rank products, and their state.

The reducer's plan leaves PowerSGD's gradients out of its buckets; this path
reduces them after the buckets, on every rank, in one go per call:

1. ``M_r = G_r + e_r``, formed in the gradient's own memory (``e_r``: this
   rank's error; none without error feedback);
2. ``P = sum_r M_r Q``: every matrix's ``P`` in one buffer per device and
   dtype, summed by one chunked Allreduce;
3. ``P``'s columns made orthonormal (:func:`~.powersgd.orthonormalise`);
4. ``Q <- sum_r M_r^T P``: one buffer, one Allreduce;
5. ``G_r <- P Q^T * scale`` (``1 / degree`` for a mean), the same on every rank;
6. ``e_r <- M_r - P Q^T / c``, ``c`` the number of ranks that contributed
   (the group's size unless some rank has joined), so that ``sum_r e_r`` is
   exactly what the approximation missed.

Calls numbered below ``start_iter`` sum these gradients uncompressed, packed
into one buffer per device and dtype. M, P, Q and the error are float64 for
float64 gradients, else float32 (float16 and bfloat16 gradients are widened
into a buffer of their own, and the result rounded back). A rank that has joined contributes zeros to both
sums and keeps its error; every rank takes the summed ``Q``. A gradient that
is row-sparse in a call, or None on every contributing rank, is left out of
that call (its state unchanged). Where a matrix's summed ``P`` or ``Q`` is
not finite (the same verdict on every rank), its result is written but its
error and ``Q`` are kept: one NaN does not poison every later call.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from . import agreement, backend
from .blas import BlasThreads, share_of_cores
from .call import Call
from .dtypes import largest_finite, scaled_copy
from .instrument import Instrument
from .options import Options
from .planning import ParamSpec
from .powersgd import PowerSGD, compute_dtype, draw_q, matrix_shape, orthonormalise
from .summers import Summers, allreduce
from .topology import Topology

__all__ = ["LowRankPath"]


class _Group:
    """The compressed gradients of one device and compute dtype: their P and Q buffers, a workspace.

    Args:
        indices: the parameters, in buffer order.
        specs: every parameter.
        rank: PowerSGD's rank.
    """

    def __init__(self, indices: Sequence[int], specs: Sequence[ParamSpec], rank: int) -> None:
        self.indices = tuple(indices)
        first = specs[self.indices[0]]
        self.device, self.dtype = first.device, compute_dtype(first.dtype)
        self.shapes = {i: matrix_shape(specs[i].shape) for i in self.indices}
        self.host = backend.is_host(self.device)
        self.xp: Any = np if self.host else _cupy()
        #: Copies and streams of the group's device (None on the host).
        self.ops: Any = None if self.host else backend.ops_for(self.device)
        p_count = sum(n for n, _ in self.shapes.values()) * rank
        q_count = sum(m for _, m in self.shapes.values()) * rank
        self.p = backend.empty(p_count, self.dtype, self.device)
        self.q = backend.empty(q_count, self.dtype, self.device)
        self.p_views: dict[int, Any] = {}
        self.q_views: dict[int, Any] = {}
        po = qo = 0
        for i in self.indices:
            n, m = self.shapes[i]
            # P and Q are kept transposed (rank x n, rank x m): BLAS forms M Q as (Q^T M^T) and M^T P
            # as (P^T M) several times faster than in the other orientation (the rows of M are long).
            self.p_views[i] = self.p[po : po + n * rank].reshape(rank, n)
            self.q_views[i] = self.q[qo : qo + m * rank].reshape(rank, m)
            po, qo = po + n * rank, qo + m * rank
        self.work = backend.empty(max(n * m for n, m in self.shapes.values()), self.dtype, self.device)
        self.flat: Any = None  # the uncompressed calls' buffer (before start_iter), made when needed
        #: Largest finite magnitude of each member's own dtype (for check_finite).
        self.limits = {i: largest_finite(specs[i].dtype) for i in self.indices}

    def on_device(self) -> Any:
        """A context in which the group's arrays are current (the device; nothing on the host)."""
        return contextlib.nullcontext() if self.ops is None else self.ops.device

    def approximation(self, i: int, factor: float, out: Any = None) -> Any:
        """``P Q^T * factor`` of parameter ``i`` (after step 4), in ``out`` (default: the workspace).

        The factor scales ``P`` (``rank x n``) before the product: one pass
        over the ``n x m`` result where scaling it after would take two.
        """
        n, m = self.shapes[i]
        a = self.work[: n * m].reshape(n, m) if out is None else out
        p = self.p_views[i] if factor == 1.0 else self.p_views[i] * self.dtype.type(factor)
        self.xp.matmul(p.T, self.q_views[i], out=a)
        return a


def _cupy() -> Any:
    import cupy

    return cupy


class LowRankPath:
    """PowerSGD within a reducer's calls: its state (iteration, Q, errors) and one call's six steps.

    Construction is local; the state is the same on every rank by
    construction (seeded draws) and stays so (every rank takes the summed Q).

    Args:
        comm: the reducer's communicator.
        specs: every parameter.
        options: the reducer's options (``powersgd`` set).
        instrument: the reducer's counters and watchdog.
        summers: the reducer's summers (host sums: two levels across hosts); flat ones without it.
    """

    def __init__(self, comm: MPI.Intracomm, specs: Sequence[ParamSpec], options: Options,
                 instrument: Instrument, summers: Summers | None = None) -> None:
        assert options.powersgd is not None
        self.config: PowerSGD = options.powersgd
        self.comm, self.specs, self.options, self.instrument = comm, tuple(specs), options, instrument
        self.summers = summers if summers is not None else Summers(comm, Topology.of(comm), two_levels=False)
        self.indices = self.config.compressed(specs, options.skipped)
        #: The number of calls made so far (the next call's number, counting from 0).
        self.iteration = 0
        keyed: dict[tuple[str, str], list[int]] = {}
        for i in self.indices:
            keyed.setdefault((specs[i].device, compute_dtype(specs[i].dtype).str), []).append(i)
        self.groups = [_Group(members, specs, self.config.rank) for members in keyed.values()]
        #: The Q the next compressed call uses, per parameter, transposed (``rank x m``, on the parameter's device).
        self.q: dict[int, Any] = {}
        #: This rank's error per parameter, shaped like the parameter (with error feedback only).
        self.error: dict[int, Any] = {}
        for g in self.groups:
            for i in g.indices:
                n, m = g.shapes[i]
                self.q[i] = backend.empty(m * self.config.rank, g.dtype, g.device).reshape(self.config.rank, m)
                self._set(self.q[i], draw_q(self.config.seed, i, self.config.start_iter, m, self.config.rank).T)
                if self.config.error_feedback:
                    e = backend.empty(n * m, g.dtype, g.device).reshape(self.specs[i].shape)
                    e[...] = 0
                    self.error[i] = e
        self._scratch: dict[int, Any] = {}  # M of gradients that are not C-contiguous
        #: The host products' BLAS threads: this rank's share of its host's cores.
        self.blas = BlasThreads(share_of_cores(self.summers.topology.local_size))

    # -- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"iteration": int, "q": {i: (m, rank)}, "error": {i: shaped like parameter i}}``: host copies."""
        q = {i: np.ascontiguousarray(self._host_copy(self.q[i]).T) for i in self.indices}
        error = {}
        for i in self.indices:
            if i in self.error:
                error[i] = self._host_copy(self.error[i])
            else:
                error[i] = np.zeros(self.specs[i].shape, dtype=compute_dtype(self.specs[i].dtype))
        return {"iteration": int(self.iteration), "q": q, "error": error}

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict` (collective); raises on every rank before anything changes.

        Raises:
            ValueError, TypeError: on every rank, when some rank's ``state`` does not fit this
                reducer, or the ranks' iterations or Q differ.
        """
        error: Exception | None = None
        digest = np.zeros(2, dtype=np.int64)
        try:
            digest[:] = self._check_state(state)
        except (ValueError, TypeError) as exc:
            error = exc
        agreement.raise_if_any(self.comm, error)
        size = self.comm.Get_size()
        table = np.empty((size, 2), dtype=np.int64)
        self.comm.Allgather(digest, table)
        for r in range(1, size):
            if table[r, 0] != table[0, 0]:
                raise ValueError(f"load_state_dict: state['iteration'] is {table[0, 0]} at rank 0 but "
                                 f"{table[r, 0]} at rank {r}; load the same state's iteration on every rank")
            if table[r, 1] != table[0, 1]:
                raise ValueError(f"load_state_dict: state['q'] differs between rank 0 and rank {r}; Q must be "
                                 "the same on every rank (load states saved by the same call)")
        self.iteration = int(state["iteration"])
        for i in self.indices:
            self._set(self.q[i], np.asarray(state["q"][i]).T)
            if i in self.error:
                self._set(self.error[i], np.asarray(state["error"][i]))

    def _check_state(self, state: Any) -> tuple[int, int]:
        """Local checks of a state; returns its iteration and a digest of its Q."""
        if not isinstance(state, Mapping):
            raise TypeError(f"load_state_dict: state: expected a dict, got {type(state).__name__}")
        if set(state) != {"iteration", "q", "error"}:
            raise ValueError(f"load_state_dict: state: expected the keys ['error', 'iteration', 'q'], "
                             f"got {sorted(map(str, state))}")
        it = state["iteration"]
        if isinstance(it, bool) or not isinstance(it, (int, np.integer)) or it < 0:
            raise ValueError(f"load_state_dict: state['iteration']: expected an int >= 0, got {it!r}")
        crc = 0
        for key in ("q", "error"):
            part = state[key]
            if not isinstance(part, Mapping):
                raise TypeError(f"load_state_dict: state[{key!r}]: expected a dict, got {type(part).__name__}")
            if set(part) != set(self.indices):
                raise ValueError(f"load_state_dict: state[{key!r}]: expected the parameter indices "
                                 f"{list(self.indices)} (those PowerSGD compresses), got {sorted(part)}")
            for i in self.indices:
                spec = self.specs[i]
                shape = (matrix_shape(spec.shape)[1], self.config.rank) if key == "q" else spec.shape
                a = part[i]
                dtype = compute_dtype(spec.dtype)
                if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dtype:
                    got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                    raise ValueError(f"load_state_dict: state[{key!r}][{i}]: expected a numpy array of "
                                     f"{dtype} {shape}, got {got}")
                if not np.isfinite(a).all():
                    raise ValueError(f"load_state_dict: state[{key!r}][{i}]: holds NaN or Inf")
                if key == "error" and not self.config.error_feedback and a.any():
                    raise ValueError(f"load_state_dict: state['error'][{i}]: not zero, but this reducer's "
                                     "PowerSGD has error_feedback=False")
                if key == "q":
                    crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data, crc)
        return int(it), crc

    @staticmethod
    def _host_copy(a: Any) -> np.ndarray:
        return np.array(a, copy=True) if isinstance(a, np.ndarray) else backend.to_numpy(a)

    @staticmethod
    def _set(dst: Any, host: np.ndarray) -> None:
        """``dst[...] = host`` (cast to ``dst``'s dtype), wherever ``dst`` lives."""
        if isinstance(dst, np.ndarray):
            np.copyto(dst, host, casting="unsafe")
        else:
            backend.copy_from_host(dst, np.ascontiguousarray(host, dtype=dst.dtype))

    # -- one call ---------------------------------------------------------------------

    def reduce(self, call: Call) -> None:
        """PowerSGD's part of ``call`` (collective): compressed from ``start_iter`` on, else summed as it is."""
        if call.void or not call.gather_sparse:  # nobody contributes; or wait() found a rank not ready
            return
        info = call.info
        assert info is not None
        left_out = set(info.sparse) | set(info.absent)
        active = [i for i in self.indices if i not in left_out]
        if active:
            if self.iteration < self.config.start_iter:
                self._uncompressed(call, active)
            else:
                with self.blas.limited():
                    self._compressed(call, set(active))
        self.iteration += 1

    def _uncompressed(self, call: Call, active: Sequence[int]) -> None:
        """A call before ``start_iter``: pack, sum (and scale), unpack, one buffer per device and dtype."""
        for g in self.groups:
            members = [i for i in g.indices if i in active]
            if members:
                with g.on_device():
                    self._uncompressed_group(g, call, members)

    def _uncompressed_group(self, g: _Group, call: Call, members: Sequence[int]) -> None:
        """The gradients ``members`` of group ``g``, summed as they are (zeros on a rank that has joined)."""
        contributing = call.local.contributing
        if g.flat is None:
            g.flat = backend.empty(sum(self.specs[i].size for i in g.indices), g.dtype, g.device)
        t0 = time.perf_counter()
        offset, views = 0, []
        for i in members:
            view = g.flat[offset : offset + self.specs[i].size].reshape(self.specs[i].shape)
            offset += self.specs[i].size
            views.append(view)
            if contributing:
                scaled_copy(call.grads[i], view)
            else:
                view[...] = 0
        t1 = time.perf_counter()
        self._sum(g, g.flat[:offset], call, call.scale, "uncompressed")
        t2 = time.perf_counter()
        if contributing:
            for i, view in zip(members, views, strict=True):
                scaled_copy(view, call.grads[i])
                self._check(call, i, g)
        self._record(call, offset * g.dtype.itemsize, t0, t1 - t0, t2 - t1, time.perf_counter() - t2)

    def _compressed(self, call: Call, active: set[int]) -> None:
        """Steps 1 to 6 for the ``active`` compressed gradients of ``call``."""
        for g in self.groups:
            if active.intersection(g.indices):
                with g.on_device():
                    self._compressed_group(g, call, active)

    def _compressed_group(self, g: _Group, call: Call, active: set[int]) -> None:
        """The six steps for the members of group ``g`` that take part in ``call``."""
        g.flat = None  # no uncompressed call comes after this one
        contributing = call.local.contributing
        feedback = self.config.error_feedback
        xp = g.xp
        t0 = time.perf_counter()
        matrices: dict[int, Any] = {}
        for i in g.indices:  # 1-2: M = G + e, P = M Q (zeros where nothing is contributed)
            if i not in active or not contributing:
                g.p_views[i][...] = 0
                continue
            m = matrices[i] = self._matrix(i, call.grads[i], g.dtype)
            if feedback:
                m += self.error[i].reshape(m.shape)
            xp.matmul(self.q[i], m.T, out=g.p_views[i])  # P^T = Q^T M^T
        t1 = time.perf_counter()
        self._sum(g, g.p, call, 1.0, "P")
        t2 = time.perf_counter()
        for i in g.indices:  # 3-4: orthonormal P, Q = M^T P
            if i in matrices:
                orthonormalise(g.p_views[i].T)  # P's columns: the rows of P^T
                xp.matmul(g.p_views[i], matrices[i], out=g.q_views[i])  # Q^T = P^T M
            else:
                g.q_views[i][...] = 0
        t3 = time.perf_counter()
        self._sum(g, g.q, call, 1.0, "Q")
        t4 = time.perf_counter()
        self._finish_group(g, call, active, matrices)
        t5 = time.perf_counter()
        nbytes = (g.p.shape[0] + g.q.shape[0]) * g.dtype.itemsize
        self._record(call, nbytes, t0, (t1 - t0) + (t3 - t2), (t2 - t1) + (t4 - t3), t5 - t4)

    def _finish_group(self, g: _Group, call: Call, active: set[int], matrices: dict[int, Any]) -> None:
        """Steps 5-6 and the next Q, for one group (every rank computes the same verdicts)."""
        assert call.info is not None
        xp = g.xp
        contributors = call.info.contributors
        for i in g.indices:
            if i not in active:
                continue
            p, q = g.p_views[i], g.q_views[i]
            finite = bool(xp.isfinite(p).all()) and bool(xp.isfinite(q).all())  # the sums: the same everywhere
            if i in matrices:
                m = matrices[i]
                if finite and self.config.error_feedback:
                    e = g.approximation(i, 1.0 / contributors, out=self.error[i].reshape(m.shape))
                    xp.subtract(m, e, out=e)  # e = M - (P (1/c)) Q^T (M may be the gradient itself: before it)
                grad = call.grads[i]
                if m is not self._scratch.get(i):  # M lies in the gradient: the product goes straight there
                    g.approximation(i, call.scale, out=m)
                else:
                    scaled_copy(g.approximation(i, call.scale).reshape(grad.shape), grad)
                self._check(call, i, g)
            if finite:
                self._next_q(g, i, q)

    def _next_q(self, g: _Group, i: int, q: Any) -> None:
        """The Q of the next call: this one's (warm start; a zero column drawn afresh), or a fresh draw."""
        config = self.config
        upcoming = self.iteration + 1
        m = g.shapes[i][1]
        if not config.warm_start:
            self._set(self.q[i], draw_q(config.seed, i, upcoming, m, config.rank).T)
            return
        self.q[i][...] = q
        zero = g.xp.all(q == 0, axis=1)  # columns of Q: rows of Q^T
        if bool(zero.any()):  # P = M Q would stay zero for good
            fresh = draw_q(config.seed, i, upcoming, m, config.rank).T
            rows = np.flatnonzero(backend.to_numpy(zero) if not g.host else zero)
            host = self._host_copy(self.q[i])
            host[rows] = fresh[rows]
            self._set(self.q[i], host)

    @staticmethod
    def _check(call: Call, i: int, g: _Group) -> None:
        """With ``check_finite``: flag NaN, Inf or overflow in result ``i`` (the same on every rank)."""
        check = call.finite_check(g.limits[i])
        if check is not None:
            check(call.grads[i])

    def _matrix(self, i: int, grad: Any, dtype: np.dtype) -> Any:
        """Gradient ``i`` as its ``n x m`` matrix of ``dtype``: a view where it can be, else a copy (M's home)."""
        n, m = matrix_shape(self.specs[i].shape)
        if grad.flags.c_contiguous and grad.dtype == dtype:
            return grad.reshape(n, m)
        scratch = self._scratch.get(i)
        if scratch is None:
            scratch = self._scratch[i] = backend.empty(n * m, dtype, self.specs[i].device).reshape(n, m)
        scaled_copy(grad, scratch)
        return scratch

    def _sum(self, g: _Group, buf: Any, call: Call, scale: float, what: str) -> None:
        """Sum ``buf`` (1-D) of group ``g`` over the ranks in place, times ``scale`` (collective).

        Host sums take the reducer's summer of their dtype, and are all formed in rank order with ``deterministic``.
        """
        def describe() -> str:
            return f"PowerSGD {what} ({buf.nbytes} bytes, {g.dtype} on {g.device})"

        def reduce(data: Any) -> int:
            ordered = self.summers.ordered(data.dtype) if isinstance(data, np.ndarray) else None
            return allreduce(self.comm, data, scale, self.summers.chunk_bytes, ordered=ordered,
                             every_chunk=self.options.deterministic, split_sums=self.summers.split_sums)

        if g.host or self.options.cuda_aware:
            if g.ops is not None:
                g.ops.ready_for_mpi()
            self.instrument.stats.messages += self.instrument.collective(describe, call.number, reduce, buf)
            return
        host = backend.to_numpy(buf)  # no CUDA-aware MPI: through host memory
        self.instrument.stats.messages += self.instrument.collective(describe, call.number, reduce, host)
        backend.copy_from_host(buf, host)

    def _record(self, call: Call, nbytes: int, t0: float, before: float, mpi: float, after: float) -> None:
        """Count one group's bytes and times: computing before the last sum, in MPI, computing after."""
        stats = self.instrument.stats
        stats.bytes += nbytes
        stats.pack_seconds += before
        stats.allreduce_seconds += mpi
        stats.unpack_seconds += after
        self.instrument.event("powersgd", t0, time.perf_counter(), call=call.number, bytes=nbytes)

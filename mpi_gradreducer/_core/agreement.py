"""Make every rank reach the same verdict: one rank's bad input raises everywhere.

All traffic is buffer-based (no pickling of data from other ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

__all__ = ["ChecksDiffer", "KINDS", "exception_of", "raise_if_any", "check_same"]

_MESSAGE_BYTES = 2048


class ChecksDiffer(ValueError):
    """Raised by :func:`raise_if_any` on every rank when no rank failed but ``checks`` differ between ranks.

    A caller that wants to say *what* differs can catch it, on every rank
    alike, and run the costlier :func:`check_same`.
    """


#: The exception types that reach the other ranks as themselves (a subclass before its base); any other arrives
#: as a ``RuntimeError``.
KINDS: tuple[type[Exception], ...] = (NotImplementedError, OverflowError, ValueError, TypeError, RuntimeError)


def exception_of(kind: str, message: str) -> Exception:
    """The exception that another rank's error of type name ``kind`` becomes here: that type when it is one of
    :data:`KINDS` (exactly), else a ``RuntimeError``."""
    return next((cls for cls in KINDS if cls.__name__ == kind), RuntimeError)(message)


def raise_if_any(
    comm: MPI.Comm, error: BaseException | None, checks: Sequence[int] = ()
) -> None:
    """Raise on every rank if any rank has an error, or if ``checks`` differ.

    Costs one small Allreduce when all is well. When some rank failed, the
    lowest such rank broadcasts its message and every rank raises the same
    exception type with it, naming that rank.

    Args:
        comm: the communicator whose ranks must agree.
        error: this rank's error, or None.
        checks: ints that must be equal on every rank (e.g. a hash of the
            call's structure); a difference raises :class:`ChecksDiffer` (a
            ``ValueError``) everywhere.

    Raises:
        ValueError, TypeError, RuntimeError, NotImplementedError or OverflowError: as raised by the failing
            rank (:data:`KINDS`).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    n = len(checks)
    vec = np.empty(1 + 2 * n, dtype=np.int64)
    vec[0] = rank if error is not None else size
    vec[1 : 1 + n] = checks
    vec[1 + n :] = np.negative(vec[1 : 1 + n])
    if size > 1:
        comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MIN)
    failed = int(vec[0])
    if size == 1 and error is not None:
        raise error
    if failed == size:
        if n and not np.array_equal(vec[1 : 1 + n], -vec[1 + n :]):
            raise ChecksDiffer(
                "the ranks passed different values for arguments that must be the same on every rank; "
                "pass the same on every rank"
            )
        return
    message = np.zeros(_MESSAGE_BYTES, dtype=np.uint8)
    if rank == failed:
        kind = next((k for k, cls in enumerate(KINDS) if isinstance(error, cls)), len(KINDS) - 1)
        encoded = f"{error}".encode()[: _MESSAGE_BYTES - 1]
        message[0] = kind
        message[1 : 1 + len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    if size > 1:
        comm.Bcast(message, root=failed)
    cls = KINDS[int(message[0])]
    text = bytes(message[1:]).rstrip(b"\0").decode(errors="replace")
    exc = cls(f"rank {failed}: {text}")
    raise exc from (error if rank == failed else None)


def check_same(
    comm: MPI.Comm,
    rows: Sequence[Sequence[int]],
    describe: Callable[[int, tuple[int, ...]], str],
    name: Callable[[int], str],
) -> None:
    """Raise ``ValueError`` on every rank unless every rank has equal ``rows``.

    Rank 0's rows are broadcast; every rank compares its own; the lowest rank
    that differs, at the first differing row, is named on every rank with
    both descriptions (ChainerMN style).

    Args:
        comm: the communicator whose ranks must agree.
        rows: this rank's signature, one tuple of ints per item.
        describe: maps ``(row_index, row)`` to a readable description.
        name: maps a row index to what the row is, e.g. ``"parameter 3"``.

    Raises:
        ValueError: naming the item and both ranks' descriptions.
    """
    size = comm.Get_size()
    if size == 1:
        return
    widths = np.array([len(r) for r in rows], dtype=np.int64)
    flat = np.array([v for r in rows for v in r], dtype=np.int64)
    header = np.array([len(rows), flat.size], dtype=np.int64)
    comm.Bcast(header, root=0)
    root_widths = np.empty(int(header[0]), dtype=np.int64)
    root_flat = np.empty(int(header[1]), dtype=np.int64)
    if comm.Get_rank() == 0:
        root_widths[:], root_flat[:] = widths, flat
    comm.Bcast(root_widths, root=0)
    comm.Bcast(root_flat, root=0)
    root_rows = _split(root_flat, root_widths)
    first = -1
    for i in range(max(len(rows), len(root_rows))):
        if i >= len(rows) or i >= len(root_rows) or tuple(rows[i]) != tuple(root_rows[i]):
            first = i
            break
    # (first differing index, rank) with MINLOC-like order: lowest rank wins.
    verdict = np.array([comm.Get_rank() if first >= 0 else size], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, verdict, op=MPI.MIN)
    bad = int(verdict[0])
    if bad == size:
        return
    info = np.array([first, len(rows)], dtype=np.int64)
    comm.Bcast(info, root=bad)
    first, bad_count = int(info[0]), int(info[1])
    if first >= len(root_rows) or first >= bad_count:
        raise ValueError(
            f"the ranks disagree: {len(root_rows)} rows at rank 0 but {bad_count} at rank {bad}; "
            "pass the same arrays, in the same order, on every rank"
        )
    width = np.array([len(rows[first]) if comm.Get_rank() == bad else 0], dtype=np.int64)
    comm.Bcast(width, root=bad)
    row = np.empty(int(width[0]), dtype=np.int64)
    if comm.Get_rank() == bad:
        row[:] = rows[first]
    comm.Bcast(row, root=bad)
    raise ValueError(
        f"the ranks disagree: {name(first)} is {describe(first, tuple(root_rows[first]))} "
        f"at rank 0 but {describe(first, tuple(int(v) for v in row))} at rank {bad}; "
        "pass the same arrays and options, in the same order, on every rank"
    )


def _split(flat: np.ndarray, widths: np.ndarray) -> list[tuple[int, ...]]:
    ends = np.cumsum(widths)
    return [tuple(int(v) for v in flat[e - w : e]) for w, e in zip(widths, ends, strict=True)]

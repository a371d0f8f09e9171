"""What the checks found of the tensors of recent in-place grouped allreduces, kept while they are proven unchanged.

Training hands ``hvd.grouped_allreduce_`` the same gradient tensors every
step. Checking each of them again and telling the other ranks its dtype and
shape is most of such a call's time on the caller's thread. :class:`Views`
keeps, per call site (the call's name and reduction), that the last call's
tensors passed and what their entries were, and hands the entries back when
the core's :class:`~mpi_gradreducer._core.replay.Replay` proves that a call
passes the very same tensors in the very same state (data pointer, strides,
shape, dtype, device, ``requires_grad``): the reducer's own proof, armed when
the same tensors come twice. Nothing of the tensors is kept alive (weak
references): a host view would make a tensor's storage refuse ``resize_``.
The caller makes each call's views anew, one ``numpy()`` per tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from mpi4py import MPI

from .._core.replay import Replay
from .._core.validation import Checked

__all__ = ["Views", "CAPACITY"]

#: Call sites remembered per process set (the least recently used is forgotten first).
CAPACITY = 8
#: Fewer tensors than this are looked at each time: the proof would cost about as much.
FEW = 8

#: What a call site remembers of its tensors: their entries (dtype name and shape).
Entries = tuple[tuple[str, tuple[int, ...]], ...]


class Views:
    """What this rank's latest in-place grouped allreduces found of their tensors, per call site (caller's thread)."""

    def __init__(self) -> None:
        self._sites: OrderedDict[Hashable, tuple[Replay, tuple[Any, ...]]] = OrderedDict()

    def recall(self, site: Hashable, tensors: Any) -> Entries | None:
        """The entries of the last call at ``site`` when ``tensors`` are its tensors, unchanged; else None."""
        held = self._sites.get(site)
        if held is None or not (type(tensors) is list or type(tensors) is tuple) or len(tensors) < FEW:
            return None
        replay, entries = held
        if replay.recall(tensors) is None:
            return None
        self._sites.move_to_end(site)
        return entries

    def remember(self, site: Hashable, tensors: Any, entries: Entries) -> None:
        """Note that a call at ``site`` passed the checks on ``tensors`` (armed when the same tensors come again)."""
        if not (type(tensors) is list or type(tensors) is tuple) or len(tensors) < FEW:
            return
        held = self._sites.pop(site, None)
        # Tensors are read through data_ptr() and stride(): the copies of object headers on COMM_SELF that serve
        # the reducer's numpy arrays are not made here.
        replay = held[0] if held is not None else Replay(MPI.COMM_SELF, layout=False)
        replay.remember(tensors, Checked(None, arrays=tensors))  # arrays: the tensors themselves (nothing kept)
        self._sites[site] = (replay, entries)
        while len(self._sites) > CAPACITY:
            self._sites.popitem(last=False)[1][0].forget()

    def clear(self) -> None:
        """Forget every call site."""
        for replay, _ in self._sites.values():
            replay.forget()
        self._sites.clear()

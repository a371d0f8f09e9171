"""The host views of the tensors of recent in-place grouped allreduces, kept while they are proven unchanged.

Training hands ``hvd.grouped_allreduce_`` the same gradient tensors every
step. Checking each of them again, viewing it and telling the other ranks
its dtype and shape is most of such a call's time on the caller's thread.
:class:`Views` keeps, per call site (the call's name and reduction), the
last call's views and entries, and hands them back when the core's
:class:`~mpi_gradreducer._core.replay.Replay` proves that a call passes the
very same tensors in the very same state (data pointer, strides, shape,
dtype, device, ``requires_grad``): the reducer's own proof, armed when the
same tensors come twice. As the reducer's armed views do, the kept views
hold their tensors' memory: torch then refuses to ``resize_`` it in place
(assigning ``.data`` works) until another list takes the site's place, or
:func:`~.session.shutdown` drops the sites.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .._core.replay import Replay
from .._core.validation import Checked

__all__ = ["Views", "CAPACITY"]

#: Call sites remembered per process set (the least recently used is forgotten first).
CAPACITY = 8
#: Fewer tensors than this are looked at each time: the proof would cost about as much.
FEW = 8

#: Per tensor, its dtype name and shape (what the other ranks see).
Entries = tuple[tuple[str, tuple[int, ...]], ...]
#: What a call site remembers: its tensors' 1-D host views, and their entries.
Found = tuple[list[np.ndarray], Entries]


class Views:
    """This rank's views of the tensors of its latest in-place grouped allreduces, per call site (any thread)."""

    def __init__(self) -> None:
        self._sites: OrderedDict[Hashable, tuple[Replay, Entries]] = OrderedDict()
        self._lock = threading.Lock()  # callers on several threads share a process set's sites

    def recall(self, site: Hashable, tensors: Any) -> Found | None:
        """What the last call at ``site`` found, when ``tensors`` are its tensors, unchanged; else None."""
        if not (type(tensors) is list or type(tensors) is tuple) or len(tensors) < FEW:
            return None
        with self._lock:
            held = self._sites.get(site)
            if held is None:
                return None
            replay, entries = held
            checked = replay.recall(tensors)
            if checked is None:
                return None
            self._sites.move_to_end(site)
            return checked.arrays, entries

    def remember(self, site: Hashable, tensors: Any, arrays: Sequence[np.ndarray], entries: Entries) -> None:
        """Note what a call at ``site`` found by looking at every tensor (armed when the same tensors come again)."""
        if not (type(tensors) is list or type(tensors) is tuple) or len(tensors) < FEW:
            return
        with self._lock:
            held = self._sites.pop(site, None)
            # Tensors are read through data_ptr() and stride(): the copies of object headers on COMM_SELF that
            # serve the reducer's numpy arrays are not made here.
            replay = held[0] if held is not None else Replay(MPI.COMM_SELF, layout=False)
            replay.remember(tensors, Checked(None, arrays=list(arrays)))
            self._sites[site] = (replay, entries)
            while len(self._sites) > CAPACITY:
                self._sites.popitem(last=False)[1][0].forget()

"""Whether a call's gradients are the previous call's, unchanged: a cheap proof, so that the checks need not run again.

Training hands the reducer the same gradient arrays call after call (numpy
gradients allocated once, torch's ``p.grad`` while it persists). The local
checks of :mod:`validation` depend only on which objects came and on what can
change on an existing object: its data pointer, shape, strides, dtype and
flags for a numpy array (all but the pointer can be reassigned in place, and
``resize`` moves the data); its data pointer, shape, strides, dtype, device
and ``requires_grad`` for a torch tensor (``.data =``, ``set_()`` and
``resize_()`` change them). A tensor's version counter is not part of the
proof: it counts writes to the data, which every step makes, and says nothing
about where the data lies.

:class:`Replay` remembers a verdict of the full checks in two steps. After a
call whose gradients passed, it keeps their identities (weak references:
nothing of the caller's is kept alive; the death of any of them voids the
memory). When the next call passes the very same objects, their state is
recorded (the *armed* state) with the views made of other libraries' arrays
(which keep those objects alive while armed). From then on a call
whose gradients are those objects, in the same state, gets the armed verdict
at once. Which objects a list or tuple holds is read from it in one copy (the
addresses of its entries; while every armed object lives, an address is that
object). The numpy arrays' states are read by two MPI copies on ``COMM_SELF``
(an ``hindexed`` datatype over the arrays' object headers, where numpy keeps
the data pointer, dimensions, strides, dtype and flags, then one over their
dimensions and strides), compared byte for byte with the recorded ones.
Where CPython's or numpy's object layout is not the one checked on probes at
first use, the entries' ids and the arrays' interfaces are compared instead
(slower, as sound).

Nothing else changes: the call's header still carries this rank's verdict to
every rank before any array is modified.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import sys
import weakref
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .validation import Checked

__all__ = ["Replay", "numpy_layout", "sequence_layout"]

#: Tag of the copies that read the arrays' states (on the reducer's own duplicate of ``COMM_SELF``).
_TAG = 32767
#: Sequences shorter than this are told by their entries' ids (cheaper than one copy of their addresses).
_FEW_ENTRIES = 16
#: numpy's ``NPY_ARRAY_C_CONTIGUOUS`` and ``NPY_ARRAY_WRITEABLE`` flags.
_C_CONTIGUOUS, _WRITEABLE = 0x0001, 0x0400
#: Bytes read from each array's object, in one block from the data pointer: the data pointer,
#: ``nd`` (and the padding after it), the dimensions and strides pointers, the base, the dtype and the flags.
_HEAD_BYTES = 52
_HEAD_RECORD = np.dtype({"names": ["nd", "dims", "strides"], "formats": ["<i4", "<u8", "<u8"],
                         "offsets": [8, 16, 24], "itemsize": _HEAD_BYTES})


class Layout(NamedTuple):
    """Where a numpy array object keeps its state, in bytes from the object's address.

    Attributes:
        data: the data pointer, then ``nd`` (an int).
        dims: the dimensions pointer, then the strides pointer, the base, the dtype and the flags (an int);
            16 bytes after ``data``.
    """

    data: int
    dims: int


@functools.cache
def numpy_layout() -> Layout | None:
    """numpy's array object layout (``PyArrayObject_fields``, part of its ABI), checked on probe arrays.

    Returns:
        The offsets, or None where they do not read back what the probes' own
        attributes say (another interpreter, another layout): the state is
        then compared through ``__array_interface__``.
    """
    if (sys.implementation.name != "cpython" or ctypes.sizeof(ctypes.c_void_p) != 8
            or ctypes.sizeof(ctypes.c_int) != 4 or ctypes.sizeof(ctypes.c_ssize_t) != 8):
        return None
    head = object.__basicsize__
    layout = Layout(head, head + 16)  # as _HEAD_RECORD reads them
    square = np.zeros((3, 4), np.float32)
    readonly = np.arange(10.0)[::2]
    readonly.flags.writeable = False
    probes = [square, np.zeros((5, 2), np.complex64).T, readonly, np.zeros((), np.int16), np.zeros(0)]
    try:
        if not all(_reads_back(a, layout) for a in probes):
            return None
        square.shape = (4, 3)  # reassigned in place: new dimensions and strides
        return layout if _reads_back(square, layout) else None
    except Exception:  # an unreadable layout: fall back to the interfaces
        return None


@functools.cache
def sequence_layout() -> tuple[int, int] | None:
    """Where a list keeps the pointer to its entries, and where a tuple keeps its entries, in bytes from the object.

    Returns:
        The offsets, or None where they do not read back the entries of probe
        sequences (another interpreter, another layout): the entries' ids are
        then compared one by one.
    """
    if sys.implementation.name != "cpython" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    offsets = (object.__basicsize__ + 8, tuple.__basicsize__)  # behind the length: ob_item, or the items inline
    probe = [object() for _ in range(3)]
    probe.extend(object() for _ in range(6))  # grown: its entries moved
    try:
        if all(_entries(seq, offsets) == _ids(seq) for seq in (probe, tuple(probe), probe[:1], (probe[0],))):
            return offsets
    except Exception:  # an unreadable layout: compare the ids
        pass
    return None


def _entries(grads: list[Any] | tuple[Any, ...], offsets: tuple[int, int]) -> bytes:
    """The addresses of the entries of ``grads`` (a list or a tuple), read from the sequence object in one copy."""
    n = len(grads)
    if n == 0:
        return b""
    at = id(grads)
    if type(grads) is list:
        at = ctypes.c_void_p.from_address(at + offsets[0]).value or 0
    else:
        at += offsets[1]
    return ctypes.string_at(at, 8 * n)


def _ids(grads: Sequence[Any]) -> bytes:
    """The ids of ``grads``' entries, as 64-bit native integers."""
    return np.fromiter(map(id, grads), np.int64, len(grads)).tobytes()


def _reads_back(a: np.ndarray, layout: Layout) -> bool:
    """Whether ``a``'s state, read at ``layout``'s offsets, is what its attributes say."""
    at = id(a)
    pointer = ctypes.c_void_p.from_address
    data = pointer(at + layout.data).value or 0
    nd = ctypes.c_int.from_address(at + layout.data + 8).value
    dims, strides, _, descr = (pointer(at + layout.dims + 8 * k).value or 0 for k in range(4))
    flags = ctypes.c_int.from_address(at + layout.dims + 32).value
    if nd != a.ndim or descr != id(a.dtype) or data != a.__array_interface__["data"][0]:
        return False
    if bool(flags & _WRITEABLE) != a.flags.writeable or bool(flags & _C_CONTIGUOUS) != a.flags.c_contiguous:
        return False
    if nd == 0:
        return True
    return (tuple((ctypes.c_ssize_t * nd).from_address(dims)) == a.shape
            and tuple((ctypes.c_ssize_t * nd).from_address(strides)) == a.strides)


def _joined(lengths: Sequence[int], places: Sequence[int]) -> tuple[list[int], list[int]]:
    """The blocks ``(lengths, places)`` with each block that starts where the one before ends joined to it.

    numpy allocates an array's strides right behind its dimensions: one block each, half the blocks to copy.
    """
    joined_lengths: list[int] = []
    joined_places: list[int] = []
    end = -1
    for length, place in zip(lengths, places, strict=True):
        if place == end and joined_lengths:
            joined_lengths[-1] += length
        else:
            joined_lengths.append(length)
            joined_places.append(place)
        end = place + length
    return joined_lengths, joined_places


class _Copy:
    """One ``Sendrecv`` on ``COMM_SELF`` of the memory blocks at absolute addresses into a reused buffer."""

    def __init__(self, local: MPI.Intracomm, lengths: Sequence[int], addresses: Sequence[int]) -> None:
        self._local = local
        self._type = MPI.BYTE.Create_hindexed(list(lengths), list(addresses)).Commit()
        self._buffer = bytearray(sum(lengths))

    def read(self) -> bytearray:
        """The blocks' bytes now, back to back (the same buffer every time)."""
        self._local.Sendrecv([MPI.BOTTOM, 1, self._type], 0, _TAG, [self._buffer, MPI.BYTE], 0, _TAG)
        return self._buffer

    def free(self) -> None:
        self._type.Free()


class _NumpyStates:
    """The states of numpy arrays, read in two copies: their object headers, then their dimensions and strides.

    The second copy reads through the pointers found by the first, so it runs
    only when the first found them unchanged (the memory is then still the
    arrays' own).
    """

    def __init__(self, local: MPI.Intracomm, arrays: Sequence[np.ndarray], layout: Layout) -> None:
        at = np.fromiter(map(id, arrays), np.int64, len(arrays))
        self._heads = _Copy(local, [_HEAD_BYTES] * len(arrays), (at + layout.data).tolist())
        self._shapes: _Copy | None = None
        try:
            head = bytes(self._heads.read())
            record = np.frombuffer(head, _HEAD_RECORD)
            lengths = np.repeat(8 * record["nd"].astype(np.int64), 2)
            places = np.empty(2 * len(arrays), np.int64)
            places[0::2], places[1::2] = record["dims"].view(np.int64), record["strides"].view(np.int64)
            self._shapes = _Copy(local, *_joined(lengths.tolist(), places.tolist()))
            self._expected = (head, bytes(self._shapes.read()))
        except BaseException:
            self.free()
            raise

    def unchanged(self) -> bool:
        """Whether every array's state is still the recorded one."""
        assert self._shapes is not None
        return self._heads.read() == self._expected[0] and self._shapes.read() == self._expected[1]

    def free(self) -> None:
        self._heads.free()
        if self._shapes is not None:
            self._shapes.free()


#: What can change on a numpy array in place, read through its interface (when the layout is unknown).
_interface = operator.attrgetter("__array_interface__", "dtype")
#: What can change on a torch tensor (and any object that tells its memory by ``data_ptr()`` and ``stride()``).
_data_ptr, _stride = operator.methodcaller("data_ptr"), operator.methodcaller("stride")
_tensor_facts = operator.attrgetter("shape", "dtype", "device", "requires_grad")


def _tensor_states(objs: Sequence[Any]) -> list[Any]:
    return list(zip(map(_data_ptr, objs), map(_stride, objs), map(_tensor_facts, objs), strict=True))


def _interface_states(objs: Sequence[Any]) -> list[Any]:
    return list(map(_interface, objs))


class _Dead:
    """Set when one of the remembered objects is collected (the weak references' callback)."""

    __slots__ = ("dead",)

    def __init__(self) -> None:
        self.dead = False

    def __call__(self, _ref: Any) -> None:
        self.dead = True


#: How to read the states of some entries, which entries (from ``grads``), and their recorded states.
_Check = tuple[Callable[[Sequence[Any]], list[Any]], Callable[[Sequence[Any]], Any], list[Any]]


class _Armed:
    """A verdict, the objects it is for, and how to tell that they are unchanged."""

    def __init__(self, entries: bytes | list[int], checked: Checked, numpy: _NumpyStates | None, others: list[_Check],
                 foreign: bool) -> None:
        self.entries = entries
        self.checked = checked
        self.numpy = numpy
        self.others = others
        self.foreign = foreign

    def unchanged(self, grads: Sequence[Any]) -> bool:
        if self.numpy is not None and not self.numpy.unchanged():
            return False
        return all(states(take(grads)) == expected for states, take, expected in self.others)

    def free(self) -> None:
        if self.numpy is not None:
            self.numpy.free()


def _taker(positions: Sequence[int]) -> Callable[[Sequence[Any]], Any]:
    """``grads -> [grads[i] for i in positions]`` in one C call."""
    get = operator.itemgetter(*positions)
    return (lambda grads: (get(grads),)) if len(positions) == 1 else get


class Replay:
    """The last verdict of the full checks, and the proof that a call's gradients are what it was for.

    Args:
        local: the reducer's own duplicate of ``COMM_SELF`` (the state copies run on it).
        layout: read numpy arrays' states from their objects where numpy's layout
            was confirmed (else, and with False, through their interfaces).
    """

    def __init__(self, local: MPI.Intracomm, layout: bool = True) -> None:
        self._local = local
        self._layout = layout
        #: Incremented each time a new set of gradients is armed: the copies kept for a set
        #: (:class:`~.transport.Gather`) are known by it.
        self.epoch = 0
        self._ids: list[int] | None = None
        self._refs: list[Any] = []
        self._dead = _Dead()
        self._armed: _Armed | None = None

    def recall(self, grads: Any) -> Checked | None:
        """The armed verdict when ``grads`` are the armed objects, unchanged; else None (check them)."""
        armed = self._armed
        if armed is None or self._dead.dead or not (type(grads) is list or type(grads) is tuple):
            return None
        if len(grads) != len(self._refs) or self._entries(grads) != armed.entries or not armed.unchanged(grads):
            return None
        return armed.checked if armed.foreign else Checked(None, arrays=grads)

    def remember(self, grads: Any, checked: Checked) -> bool:
        """Note the gradients of a call that went through the full checks; arm them when they came twice.

        Returns:
            Whether ``grads`` are now armed (the caller's copies may be kept for :attr:`epoch`).
        """
        if (checked.error is not None or checked.sparse or checked.absent or checked.views
                or not (type(grads) is list or type(grads) is tuple)):
            self.forget()
            return False
        ids = list(map(id, grads))
        if ids == self._ids and not self._dead.dead:  # the same objects again: (re)arm them in their state now
            if self._armed is not None:
                self._armed.free()
            self._armed = self._arm(grads, checked)
            if self._armed is not None:
                self.epoch += 1
            return self._armed is not None
        self.forget()
        dead = _Dead()
        try:
            self._refs = list(map(weakref.ref, grads, repeat(dead)))
        except TypeError:  # an object without weak references: never replayed
            return False
        self._ids, self._dead = ids, dead
        return False

    def forget(self) -> None:
        """Drop what is remembered (the plan changed, or the gradients did)."""
        if self._armed is not None:
            self._armed.free()
        self._ids, self._refs, self._dead, self._armed = None, [], _Dead(), None

    def _entries(self, grads: list[Any] | tuple[Any, ...]) -> bytes | list[int]:
        """Which objects ``grads`` holds: their addresses, read in one copy where the sequences' layout is known.

        Below :data:`_FEW_ENTRIES` entries, or where the layout is unknown, their ids (one C loop).
        """
        offsets = sequence_layout() if self._layout and len(grads) >= _FEW_ENTRIES else None
        return list(map(id, grads)) if offsets is None else _entries(grads, offsets)

    def _arm(self, grads: Sequence[Any], checked: Checked) -> _Armed | None:
        """The armed state of ``grads`` (just checked into ``checked``), or None when some entry cannot be proven."""
        arrays = checked.arrays
        plain: list[int] = []
        tensors: list[int] = []
        interfaces: list[int] = []
        for i, g in enumerate(grads):
            if type(g) is np.ndarray:
                plain.append(i)
            elif callable(getattr(g, "data_ptr", None)) and callable(getattr(g, "stride", None)):
                tensors.append(i)
            elif hasattr(g, "__array_interface__"):
                interfaces.append(i)
            else:
                return None  # e.g. an object seen through DLPack only
        layout = numpy_layout() if self._layout else None
        if layout is None:  # numpy arrays through their interfaces
            interfaces, plain = interfaces + plain, []
        others: list[_Check] = []
        for states, positions in ((_tensor_states, tensors), (_interface_states, interfaces)):
            if positions:
                take = _taker(positions)
                others.append((states, take, states(take(grads))))
        numpy = None
        if plain:
            assert layout is not None
            numpy = _NumpyStates(self._local, [grads[i] for i in plain], layout)
        foreign = arrays is not grads
        kept = Checked(None, arrays=list(arrays)) if foreign else checked._replace(arrays=None)
        assert type(grads) is list or type(grads) is tuple
        return _Armed(self._entries(grads), kept, numpy, others, foreign)

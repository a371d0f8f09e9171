"""The gradient shapes the benchmarks reduce: real models' parameter lists, and synthetic ones.

Pure: shapes and dtypes only, no MPI and no arrays until :meth:`Workload.arrays`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = [
    "WORKLOADS",
    "Workload",
    "bert_base",
    "make_workload",
    "many_small",
    "mixed",
    "resnet50",
    "small",
]

_F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class Workload:
    """A list of gradient shapes and dtypes.

    Attributes:
        name: the workload's name.
        shapes: one shape per tensor, in parameter order.
        dtypes: one dtype per tensor.
        note: how the shapes were made.
    """

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    note: str

    @property
    def count(self) -> int:
        """Number of tensors."""
        return len(self.shapes)

    @property
    def elements(self) -> int:
        """Total number of elements (parameters)."""
        return int(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes))

    @property
    def nbytes(self) -> int:
        """Total bytes of the gradients."""
        return int(sum(int(np.prod(s, dtype=np.int64)) * d.itemsize
                       for s, d in zip(self.shapes, self.dtypes, strict=True)))

    def facts(self, ranks: int) -> dict[str, Any]:
        """What a results file records about the workload, run over ``ranks`` ranks."""
        return {
            "tensors": self.count,
            "parameters": self.elements,
            "bytes": self.nbytes,
            "dtypes": sorted({d.name for d in self.dtypes}),
            "ranks": ranks,
            "note": self.note,
        }

    def arrays(self) -> list[np.ndarray]:
        """One separately allocated, zero-filled numpy array per tensor."""
        return [np.zeros(s, dtype=d) for s, d in zip(self.shapes, self.dtypes, strict=True)]


def _float32(name: str, shapes: list[tuple[int, ...]], note: str) -> Workload:
    return Workload(name, tuple(shapes), (_F32,) * len(shapes), note)


def resnet50(num_classes: int = 1000) -> Workload:
    """ResNet-50's parameters, in torchvision's order.

    A 7x7 stem convolution, then bottleneck blocks (1x1, 3x3, 1x1 convolutions,
    each followed by a batch norm with weight and bias) in stages of 3, 4, 6
    and 3 blocks of widths 64, 128, 256 and 512 (expansion 4); the first
    block of each stage has a 1x1 projection shortcut with its batch norm; then
    the classifier: 161 tensors, 25,557,032 float32 parameters.

    Args:
        num_classes: outputs of the classifier.
    """
    shapes: list[tuple[int, ...]] = []

    def conv_bn(cout: int, cin: int, k: int) -> None:
        shapes.extend([(cout, cin, k, k), (cout,), (cout,)])

    conv_bn(64, 3, 7)
    cin = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True):
        for b in range(blocks):
            conv_bn(width, cin, 1)
            conv_bn(width, width, 3)
            conv_bn(4 * width, width, 1)
            if b == 0:
                conv_bn(4 * width, cin, 1)
            cin = 4 * width
    shapes.extend([(num_classes, cin), (num_classes,)])
    return _float32("resnet50", shapes, "ResNet-50 (torchvision layout), float32")


def bert_base(scale: float = 1.0) -> Workload:
    """BERT-base's parameters (the encoder with pooler), optionally shrunk.

    Full size: embeddings (30522-word vocabulary, 512 positions, 2 token
    types, hidden 768, layer norm), 12 layers of self-attention (query, key,
    value and output projections with biases, layer norm) and feed-forward
    (768 -> 3072 -> 768 with biases, layer norm), and the pooler: 199 float32
    tensors, 109,482,240 parameters.

    ``scale`` < 1 keeps every per-layer shape as it is (hidden 768,
    intermediate 3072) and scales the two things that make up the size: the
    number of layers, ``max(1, round(12 * scale))``, and the vocabulary,
    ``round(30522 * scale)``; the parameter count is then about ``scale``
    times the full one.

    Args:
        scale: in (0, 1].

    Raises:
        ValueError: when ``scale`` is outside (0, 1].
    """
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale: expected a number in (0, 1], got {scale!r}")
    hidden, inter, positions, types = 768, 3072, 512, 2
    layers = max(1, round(12 * scale))
    vocab = max(1, round(30522 * scale))
    shapes: list[tuple[int, ...]] = [(vocab, hidden), (positions, hidden), (types, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _qkvo in range(4):
            shapes.extend([(hidden, hidden), (hidden,)])
        shapes.extend([(hidden,), (hidden,)])
        shapes.extend([(inter, hidden), (inter,), (hidden, inter), (hidden,), (hidden,), (hidden,)])
    shapes.extend([(hidden, hidden), (hidden,)])
    note = f"BERT-base, {layers} of 12 layers, vocabulary {vocab} of 30522 (scale {scale:g}), float32"
    return _float32("bert-base", shapes, note)


def many_small(count: int = 1000, size: int = 1024) -> Workload:
    """``count`` float32 tensors of ``size`` elements each.

    Raises:
        ValueError: when ``count`` or ``size`` is not positive.
    """
    if count <= 0 or size <= 0:
        raise ValueError(f"many-small: expected a positive count and size, got {count} x {size}")
    return _float32("many-small", [(size,)] * count, f"{count} x {size} float32")


def small() -> Workload:
    """The digits MLP of ``scripts/train_digits.py``: 64 -> 128 -> 10, float32.

    Four tensors (64 x 128, 128, 128 x 10, 10): 9,610 parameters, 38,440
    bytes. At this size a reduction is all fixed costs: the figure to read is
    the reducer against one raw Allreduce of the same bytes.
    """
    return _float32("small", [(64, 128), (128,), (128, 10), (10,)], "digits MLP 64-128-10, float32")


def mixed() -> Workload:
    """A small mixed-precision transformer: float16 weights, float32 embedding and norms.

    A float32 embedding (4096 x 256), then 8 blocks of [float32 layer norm
    weight and bias, float16 QKV (768 x 256) and output (256 x 256)
    projections with float16 biases, float32 layer norm, float16 feed-forward
    256 -> 1024 -> 256 with float16 biases], then a float32 final layer norm:
    99 tensors, 7.4 M parameters, 16.8 MB. The reducer sends the float16
    gradients as 16 bits and sums them in float32, each rank one slice.
    """
    f16 = np.dtype(np.float16)
    d, ff = 256, 1024
    shapes: list[tuple[int, ...]] = [(4096, d)]
    dtypes: list[np.dtype] = [_F32]
    for _ in range(8):
        block: list[tuple[tuple[int, ...], np.dtype]] = [
            ((d,), _F32), ((d,), _F32),
            ((3 * d, d), f16), ((3 * d,), f16), ((d, d), f16), ((d,), f16),
            ((d,), _F32), ((d,), _F32),
            ((ff, d), f16), ((ff,), f16), ((d, ff), f16), ((d,), f16),
        ]
        shapes.extend(s for s, _ in block)
        dtypes.extend(t for _, t in block)
    shapes.extend([(d,), (d,)])
    dtypes.extend([_F32, _F32])
    return Workload("mixed", tuple(shapes), tuple(dtypes), "float16 weights, float32 embedding and norms")


#: Every workload by its command-line name; each builder takes the options' ``scale``,
#: ``small_count`` and ``small_size``.
WORKLOADS: Mapping[str, Callable[[float, int, int], Workload]] = MappingProxyType({
    "resnet50": lambda scale, count, size: resnet50(),
    "bert-base": lambda scale, count, size: bert_base(scale),
    "many-small": lambda scale, count, size: many_small(count, size),
    "mixed": lambda scale, count, size: mixed(),
    "small": lambda scale, count, size: small(),
})


def make_workload(name: str, scale: float = 1.0, small_count: int = 1000, small_size: int = 1024) -> Workload:
    """The workload called ``name`` on the command line.

    Args:
        name: a key of :data:`WORKLOADS`.
        scale: bert-base's size in (0, 1].
        small_count: many-small's number of tensors.
        small_size: many-small's elements per tensor.

    Raises:
        ValueError: for an unknown name, or sizes the workload refuses.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name](scale, small_count, small_size)

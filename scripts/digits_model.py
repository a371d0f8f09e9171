"""The data and the model of ``scripts/train_digits.py``.

The data: scikit-learn's 8x8 digits (shipped inside the package: nothing is
downloaded), split 75/25 with a fixed seed and standardised. The model: a
64-128-10 perceptron (ReLU, softmax cross-entropy, SGD with momentum), its
backward written out in numpy: each gradient goes into an array the caller
gives (the reducer's own views, in the demo), and the caller hears when each
one is final, so that its reduction can start during backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np


class Data(NamedTuple):
    """A fixed train/test split: standardised features, integer labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_data(seed: int = 0, test_fraction: float = 0.25) -> Data:
    """scikit-learn's 8x8 digits (shipped with it), split with a fixed seed and standardised."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                                        stratify=y)
    scaler = StandardScaler().fit(x_train)  # the training set's mean and deviation
    return Data(scaler.transform(x_train), y_train.astype(np.int64),
                scaler.transform(x_test), y_test.astype(np.int64))


def init_params(n_in: int, n_hidden: int, n_out: int, seed: int, dtype: Any) -> list[np.ndarray]:
    """He-initialised weights and zero biases: ``[w1, b1, w2, b2]``."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((n_in, n_hidden)) * np.sqrt(2.0 / n_in)
    w2 = rng.standard_normal((n_hidden, n_out)) * np.sqrt(1.0 / n_hidden)
    return [a.astype(dtype) for a in (w1, np.zeros(n_hidden), w2, np.zeros(n_out))]


def logits(params: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The network's output before the softmax."""
    w1, b1, w2, b2 = params
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


def accuracy(params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Share of ``x`` classified as ``y``."""
    return float(np.mean(np.argmax(logits(params, x.astype(params[0].dtype)), axis=1) == y))


def forward_backward(
    params: Sequence[np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    scale: float,
    grads: Sequence[np.ndarray],
    ready: Callable[[int], None] | None = None,
) -> float:
    """``scale`` times the summed cross-entropy of the rows of ``x``, and its gradient.

    Args:
        params: ``[w1, b1, w2, b2]``.
        x: a batch of inputs (rows), in the parameters' dtype.
        y: their labels.
        scale: factor on the summed loss (``1 / batch`` gives the batch mean).
        grads: arrays shaped like ``params``; the gradient is written into them.
        ready: called with ``i`` as soon as ``grads[i]`` is final (backward
            order: the last layer first), e.g. ``step.ready`` of an overlapped
            reduction.

    Returns:
        The scaled loss.
    """
    w1, b1, w2, b2 = params
    g_w1, g_b1, g_w2, g_b2 = grads
    rows = np.arange(x.shape[0])
    pre = x @ w1 + b1
    hidden = np.maximum(pre, 0)
    z = hidden @ w2 + b2
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    total = e.sum(axis=1, keepdims=True)
    loss = float(np.sum(np.log(total[:, 0]) - z[rows, y])) * scale
    d_z = e / total  # softmax
    d_z[rows, y] -= 1
    d_z *= scale
    np.matmul(hidden.T, d_z, out=g_w2)
    np.sum(d_z, axis=0, out=g_b2)
    if ready is not None:
        ready(3)
        ready(2)
    d_pre = d_z @ w2.T
    d_pre[pre <= 0] = 0
    np.matmul(x.T, d_pre, out=g_w1)
    np.sum(d_pre, axis=0, out=g_b1)
    if ready is not None:
        ready(1)
        ready(0)
    return loss


class Momentum:
    """SGD with momentum: ``v = momentum * v + g; p -= lr * v``."""

    def __init__(self, params: Sequence[np.ndarray], lr: float, momentum: float) -> None:
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.velocity = [np.zeros_like(p) for p in params]

    def step(self, grads: Sequence[np.ndarray]) -> None:
        """Apply one update in place."""
        for p, v, g in zip(self.params, self.velocity, grads, strict=True):
            v *= self.momentum
            v += g
            p -= self.lr * v

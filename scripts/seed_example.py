"""MindSpore's ``nn.DistributedGradReducer`` documentation example, in numpy.

A 16x10 all-ones weight, a MatMul network, an MSE loss and Momentum
(lr=0.1, momentum=0.9); a training wrapper computes the gradients, averages
them across the ranks with ``DistributedGradReducer`` and applies the
optimizer. Inputs are ones(16, 16), labels zeros(16, 10); like the original,
it prints the loss of the step, 256.0, on every rank::

    mpiexec -n 4 python scripts/seed_example.py
"""

from __future__ import annotations

import numpy as np

from mpi_gradreducer import DistributedGradReducer


class Net:
    """``output = x @ weight``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        self.weight = np.ones((in_features, out_features), dtype=np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weight


class WithMSELoss:
    """The network followed by a mean-squared-error loss, with its gradient."""

    def __init__(self, network: Net) -> None:
        self.network = network

    def trainable_params(self) -> list[np.ndarray]:
        return [self.network.weight]

    def __call__(self, x: np.ndarray, label: np.ndarray) -> np.float32:
        return np.mean((self.network(x) - label) ** 2)

    def grad(self, x: np.ndarray, label: np.ndarray, sens: float) -> list[np.ndarray]:
        d_out = sens * 2.0 * (self.network(x) - label) / label.size
        return [(x.T @ d_out).astype(np.float32)]


class Momentum:
    """``v = momentum * v + g; p -= lr * v``, as MindSpore's ``nn.Momentum``."""

    def __init__(self, parameters: list[np.ndarray], learning_rate: float, momentum: float) -> None:
        self.parameters = parameters
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.moments = [np.zeros_like(p) for p in parameters]

    def __call__(self, grads: list[np.ndarray]) -> None:
        for p, v, g in zip(self.parameters, self.moments, grads, strict=True):
            v *= self.momentum
            v += g
            p -= self.learning_rate * v


class TrainingWrapper:
    """Loss, gradients, gradient reduction across ranks, optimizer step."""

    def __init__(self, network: WithMSELoss, optimizer: Momentum, sens: float = 1.0) -> None:
        self.network = network
        self.optimizer = optimizer
        self.sens = sens
        self.grad_reducer = DistributedGradReducer(optimizer.parameters, mean=True)

    def __call__(self, x: np.ndarray, label: np.ndarray) -> np.float32:
        loss = self.network(x, label)
        grads = self.network.grad(x, label, self.sens)
        grads = self.grad_reducer(grads)
        self.optimizer(grads)
        return loss


def main() -> None:
    size, in_features, out_features = 16, 16, 10
    network = Net(in_features, out_features)
    net_with_loss = WithMSELoss(network)
    optimizer = Momentum(net_with_loss.trainable_params(), learning_rate=0.1, momentum=0.9)
    train_cell = TrainingWrapper(net_with_loss, optimizer)
    inputs = np.ones([size, in_features], dtype=np.float32)
    label = np.zeros([size, out_features], dtype=np.float32)
    loss = train_cell(inputs, label)
    print(float(loss))
    train_cell.grad_reducer.free()


if __name__ == "__main__":
    main()

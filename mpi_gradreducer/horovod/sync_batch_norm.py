"""Horovod's ``SyncBatchNorm``: batch normalization whose statistics are those of every rank's batch together.

In training, each channel's mean and variance are those of the samples of
every rank of the process set: one allreduce (Sum) of each rank's sums and
counts gives the mean, a second of the squared deviations from it gives the
variance (two passes, as accurate as a single rank's). Backward needs two
sums across the ranks as well (one allreduce): the input's gradient is that
of normalizing the whole batch; the weight's and bias's gradients are this
rank's share (summed, then averaged by ``DistributedOptimizer`` as any
gradient). In evaluation the running statistics are used, as
``torch.nn.BatchNorm*`` does. The collectives go through the engine, on CPU
and CUDA tensors alike; a rank in ``hvd.join()`` adds zeros (no samples).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .collectives import allreduce
from .ops import Sum
from .process_sets import global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization over every rank's batch (inputs of 2 or more dimensions, channels in dimension 1).

    Args:
        num_features: the number of channels.
        eps: added to the variance.
        momentum: of the running statistics (None: a cumulative average).
        affine: learn a weight and a bias per channel.
        track_running_stats: keep running statistics (used in evaluation).
        process_set: the ranks whose batches are normalized together (not
            Horovod's: it uses every rank).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: Any = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (batch, channels, ...), got {input.dim()}D "
                             "input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else float(self.momentum)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.running_mean is not None:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                    factor, self.process_set)


def _dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``v`` (one value per channel) shaped to broadcast against ``x``."""
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float, factor: float,
                process_set: Any) -> torch.Tensor:
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = _dims(x)
        channels = x.shape[1]
        local = torch.cat([x.sum(dims), torch.tensor([x.numel() // max(channels, 1)], dtype=x.dtype,
                                                     device=x.device)])
        total = allreduce(local, op=Sum, process_set=process_set)
        count = float(total[-1])
        if count <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel across the ranks when "
                             f"training, got input size {tuple(input.shape)} ({count:.0f} in all)")
        mean = total[:-1] / count
        centered = x - _per_channel(mean, x)
        var = allreduce(centered.square().sum(dims), op=Sum, process_set=process_set) / count
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_((var * count / (count - 1)).to(running_var.dtype), alpha=factor)
        xhat = centered * _per_channel(invstd, x)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight.to(x.dtype), x)
        if bias is not None:
            y = y + _per_channel(bias.to(x.dtype), x)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count, ctx.process_set, ctx.has_bias = count, process_set, bias is not None
        return y.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        g = grad.to(xhat.dtype)
        dims = _dims(xhat)
        dxhat = g * _per_channel(weight.to(xhat.dtype), xhat) if weight is not None else g
        sums = allreduce(torch.cat([dxhat.sum(dims), (dxhat * xhat).sum(dims)]), op=Sum,
                         process_set=ctx.process_set)
        channels = xhat.shape[1]
        mean_dxhat, mean_dxhat_xhat = sums[:channels] / ctx.count, sums[channels:] / ctx.count
        dx = _per_channel(invstd, xhat) * (dxhat - _per_channel(mean_dxhat, xhat) -
                                           xhat * _per_channel(mean_dxhat_xhat, xhat))
        dweight = (g * xhat).sum(dims).to(weight.dtype) if weight is not None else None
        dbias = g.sum(dims).to(weight.dtype if weight is not None else g.dtype) if ctx.has_bias else None
        return dx.to(grad.dtype), dweight, dbias, None, None, None, None, None

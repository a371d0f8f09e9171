"""Collectives as autograd functions: Horovod's backward functions, run as collectives themselves.

Each differentiable collective is ``differentiable(run, back, inputs)``:
``run()`` makes the outputs; when an input requires grad (and grad mode is
on), it runs inside a ``torch.autograd.Function`` whose backward calls
``back(*output_grads)``, which makes the inputs' gradients with collectives
of their own. Whether it is recorded changes nothing in what is sent: every
rank makes the same calls either way, so a rank whose input does not
require grad must still call backward when the others do (as in Horovod).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["differentiable"]


class _Collective(torch.autograd.Function):
    """A collective as an autograd function: ``run()`` makes the outputs, ``back(*grads)`` the inputs' gradients."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[], Any], back: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        ctx.back = back
        out = run()
        outs = out if isinstance(out, tuple) else (out,)
        ctx.mark_non_differentiable(*(o for o in outs if not (o.is_floating_point() or o.is_complex())))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *ctx.back(*grads))


def differentiable(run: Callable[[], Any], back: Callable[..., Any], inputs: Sequence[Any]) -> Any:
    """``run()``, recorded by autograd (``back`` computes the inputs' gradients, collectively) when it must be."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return _Collective.apply(run, back, *inputs)
    return run()

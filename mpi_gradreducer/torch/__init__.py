"""torch in three lines: a ``DistributedOptimizer`` that reduces gradients while backward runs.

Importing this package imports torch; only it and ``mpi_gradreducer.horovod`` do::

    from mpi_gradreducer.torch import DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state

    broadcast_parameters(model)                 # rank 0's parameters and buffers into every rank's
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    broadcast_optimizer_state(opt)              # rank 0's optimizer state into every rank's
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()         # each gradient is reduced as soon as autograd finishes it
        opt.step()                              # waits for the reduction, then steps

How it works. The wrapper builds a :class:`~mpi_gradreducer.DistributedGradReducer`
from the optimizer's parameters and keeps one gradient tensor per parameter
over the reducer's own fusion buffers (``allocate_grads``: buckets made of
them are reduced where they lie). A post-accumulate-grad hook on every
parameter moves torch's fresh gradient into that tensor (a copy, or nothing
when backward accumulated into it), makes it the parameter's ``.grad`` and
declares it ready (``ReductionStep.ready``): buckets are launched in plan
order while backward goes on, advanced as the reducer's ``progress`` says.
``step()`` declares the rest ready and waits.

Unused parameters need no graph traversal. The reducer gets one more
gradient, before the parameters: a small vector of flags, written at
``step()``, that rides in the last bucket. Each rank puts a non-zero value
for every parameter it has a gradient for, and in its own slot for each kind
of misuse it saw; the reduction itself tells every rank which parameters
some rank used (their ``.grad`` gets the average, zeros stood for the others)
and which rank misused what. A healthy step sends nothing more than the
gradients, and a rank in :meth:`DistributedOptimizer.join` takes part in it as
in any reduction (its flags are zeros).

The parts: ``optimizer`` (``DistributedOptimizer``), ``flags`` (the flags'
layout and the misuse they report), ``functions``
(``broadcast_parameters``, ``broadcast_optimizer_state``, ``init_gloo``,
``clip_grad_norm_``), ``optimizer_state`` (an optimizer's state sent from one rank)
and ``tensors`` (tensors compared across ranks, and viewed as bytes).
"""

from . import distributed
from .functions import broadcast_optimizer_state, broadcast_parameters, clip_grad_norm_, init_gloo
from .optimizer import DistributedOptimizer

distributed.register()  # torch.distributed's backend "mpi_gradreducer" and rendezvous "mpi://"

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters", "clip_grad_norm_",
           "init_gloo"]

"""horovod.tensorflow: not provided; importing this module raises ImportError naming what to use instead."""

raise ImportError(
    "mpi_gradreducer.horovod provides Horovod's torch API only (horovod.torch); horovod.tensorflow has no equivalent "
    "here. For tensorflow models, average the gradients with mpi_gradreducer.DistributedGradReducer over numpy (or "
    "cupy) arrays of them (README.rst), or use torch with mpi_gradreducer.horovod"
)

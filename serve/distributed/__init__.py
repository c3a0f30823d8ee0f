"""Tensor parallelism's process group: which rank this process is, and the collectives."""

from serve.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
)

__all__ = [
    "TensorParallelGroup",
    "destroy_tensor_parallel",
    "get_tp_group",
    "init_tensor_parallel",
]

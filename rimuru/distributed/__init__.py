"""Tensor parallelism: one process per device, weights sharded at load time, one memory decision.

See docs/tensor_parallel.md.
"""

from rimuru.distributed.comm import SINGLE, Communicator, Shard, SingleProcess, TorchDistributed
from rimuru.distributed.errors import TensorParallelError

__all__ = ["SINGLE", "Communicator", "Shard", "SingleProcess", "TensorParallelError", "TorchDistributed"]

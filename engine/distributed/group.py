"""The tensor-parallel group a model is built for: this process's rank, the group's size and its collectives.

A model reads the group it is built for from `current()` (set around model construction by `building_for`, per
thread), as vLLM's layers read get_tensor_model_parallel_world_size(); without one it is `SINGLE` (size 1), and the
layers are the plain torch modules. The group is a c10d process group object of its own (ProcessGroupGloo on CPU,
ProcessGroupNCCL on CUDA), not torch.distributed's global default group: a process may start and close several
engines, and nothing global is left behind.

Every collective is bounded: gloo's by the group's timeout (a peer that dies closes its sockets, which gloo reports
at once); NCCL's by the same timeout, which torch's NCCL watchdog enforces by tearing the communicator down
(TORCH_NCCL_ASYNC_ERROR_HANDLING's default), and workers.py aborts the group as soon as a rank's process ends. The
all-reduces inside captured CUDA graphs are plain NCCL collectives (capturable since NCCL 2.9): every rank
captures the same graphs in the same order and replays them in step.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# How long one collective may wait for the other ranks. A dead peer is noticed long before (gloo: its socket
# closes; workers.py's watchdog: its process ends); this bounds a peer that hangs.
COLLECTIVE_TIMEOUT_S = 120.0


class TensorParallelGroup:
    """rank and size of this process in its group; `pg` the c10d process group (None at size 1)."""

    def __init__(self, rank: int = 0, size: int = 1, pg=None) -> None:
        self.rank, self.size, self.pg = rank, size, pg

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x must be contiguous)."""
        if self.size > 1:
            self._live().allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dimension, rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._live().allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x from rank src into every rank's x (same shape and dtype everywhere)."""
        if self.size > 1:
            self._live().broadcast(x, src).wait()
        return x

    def _live(self):
        if self.pg is None:
            raise RuntimeError("the tensor-parallel group was aborted (a rank died or a collective failed)")
        return self.pg

    def abort(self) -> None:
        """Drop the group after a failure (a peer died): its connections are closed, nothing waits on them."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError:
                pass


SINGLE = TensorParallelGroup()
_building = threading.local()  # .group: the group models built on this thread are sharded for


def current() -> TensorParallelGroup:
    """The group the model being built on this thread is sharded for (SINGLE outside building_for)."""
    return getattr(_building, "group", SINGLE)


@contextmanager
def building_for(group: TensorParallelGroup) -> Iterator[None]:
    """Models constructed inside (on this thread) are sharded for `group`."""
    saved = current()
    _building.group = group
    try:
        yield
    finally:
        _building.group = saved


def create_store(world_size: int):
    """Rank 0's rendezvous store on a free loopback port (its .port is handed to the workers)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def connect_store(port: int, world_size: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                         timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def create_group(store, rank: int, size: int, device: torch.device) -> TensorParallelGroup:
    """The ranks' process group over `store`: gloo for CPU tensors, NCCL for CUDA ones (blocks until all joined)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    prefixed = dist.PrefixStore("kvgate-tp", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # per thread: the group may be made on a thread of its own (workers._join)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        # NCCL connects lazily: one collective now, so a rank that cannot join fails here and not in a step
        probe = torch.ones(1, device=device)
        pg.allreduce([probe]).wait()
        torch.cuda.synchronize(device)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    return TensorParallelGroup(rank, size, pg)

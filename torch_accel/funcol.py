"""accel kernels of torch's functional collectives (``torch.ops._c10d_functional``).

DTensor (``full_tensor()``, redistributions), ``torch.distributed._functional_collectives``
and compiled collectives run these ops. torch implements them once for every device, in
C++ (CompositeExplicitAutograd): each resolves the group by name and calls a method of it
from C++, such as ``_allgather_base``. accl's group is a Python ``ProcessGroup``
(torch_accel/distributed.py), and torch's Python trampoline forwards only some of those
C++ calls to Python (``allreduce``, ``broadcast``, ``alltoall_base`` ...); the others
reach the C++ base class, which looks for a C++ backend for the device and fails with "No
backend type associated with device type accel".

So the ops that call such a method get kernels of their own for accel tensors (the
PrivateUse1 key wins over CompositeExplicitAutograd), calling the group's Python methods.
Each returns its output at once and registers a Work with it, as torch's kernels do;
``wait_tensor`` waits for it (the Work completes once the result is on the device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

#: the kernels' registrations (a Library undoes them when it is collected)
_LIB: torch.library.Library | None = None


def _group(group_name: Any) -> dist.ProcessGroup:
    """The group a functional op names (by its registered name, or the group itself)."""
    if isinstance(group_name, str):
        return c10d._resolve_process_group(group_name)
    return group_name


def _reduce_op(name: str) -> Any:
    """``"sum"`` and the like, as the functional ops spell them, as a ``ReduceOp``."""
    return getattr(dist.ReduceOp, name.upper())


def _register(out: torch.Tensor, work: dist.Work) -> None:
    """Let ``wait_tensor(out)`` wait for ``work``: through a C++ Work made from the
    collective's future, which the registry may keep however long it likes (the Python
    Work object would have to outlive this call)."""
    c10d._register_work(out, c10d._create_work_from_future(work.get_future()))


def all_gather_into_tensor_out(input: torch.Tensor, group_size: int,  # noqa: A002
                               group_name: Any, *, out: torch.Tensor) -> torch.Tensor:
    _register(out, _group(group_name)._allgather_base(out, input.contiguous()))
    return out


def all_gather_into_tensor(input: torch.Tensor, group_size: int,  # noqa: A002
                           group_name: Any) -> torch.Tensor:
    out = input.new_empty((input.shape[0] * group_size, *input.shape[1:]))
    return all_gather_into_tensor_out(input, group_size, group_name, out=out)


def all_gather_into_tensor_coalesced(inputs: list[torch.Tensor], group_size: int,
                                     group_name: Any) -> list[torch.Tensor]:
    return [all_gather_into_tensor(t, group_size, group_name) for t in inputs]


def reduce_scatter_tensor_out(input: torch.Tensor, reduce_op: str,  # noqa: A002
                              group_size: int, group_name: Any, *,
                              out: torch.Tensor) -> torch.Tensor:
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _reduce_op(reduce_op)
    _register(out, _group(group_name)._reduce_scatter_base(out, input.contiguous(), opts))
    return out


def reduce_scatter_tensor(input: torch.Tensor, reduce_op: str, group_size: int,  # noqa: A002
                          group_name: Any) -> torch.Tensor:
    out = input.new_empty((input.shape[0] // group_size, *input.shape[1:]))
    return reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out=out)


def reduce_scatter_tensor_coalesced(inputs: list[torch.Tensor], reduce_op: str,
                                    group_size: int, group_name: Any) -> list[torch.Tensor]:
    return [reduce_scatter_tensor(t, reduce_op, group_size, group_name) for t in inputs]


def all_reduce_coalesced_(inputs: list[torch.Tensor], reduce_op: str,
                          group_name: Any) -> list[torch.Tensor]:
    group = _group(group_name)
    for t in inputs:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(reduce_op)
        _register(t, group.allreduce([t], opts))
    return inputs


def all_reduce_coalesced(inputs: list[torch.Tensor], reduce_op: str,
                         group_name: Any) -> list[torch.Tensor]:
    return all_reduce_coalesced_([t.clone(memory_format=torch.contiguous_format)
                                  for t in inputs], reduce_op, group_name)


#: op name -> its accel kernel: the ops whose C++ kernels call a group method torch's
#: Python trampoline does not forward (``_allgather_base``, ``_reduce_scatter_base``,
#: ``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``,
#: ``allreduce_coalesced``); ``all_reduce``, ``broadcast`` and ``all_to_all_single``
#: reach the group through forwarded methods and keep torch's kernels
KERNELS: dict[str, Callable[..., Any]] = {
    "all_gather_into_tensor": all_gather_into_tensor,
    "all_gather_into_tensor_out": all_gather_into_tensor_out,
    "all_gather_into_tensor_coalesced": all_gather_into_tensor_coalesced,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "reduce_scatter_tensor_out": reduce_scatter_tensor_out,
    "reduce_scatter_tensor_coalesced": reduce_scatter_tensor_coalesced,
    "all_reduce_coalesced": all_reduce_coalesced,
    "all_reduce_coalesced_": all_reduce_coalesced_,
}


def install() -> None:
    """Register the kernels for accel tensors (once)."""
    global _LIB
    if _LIB is None and dist.is_available():
        _LIB = torch.library.Library("_c10d_functional", "IMPL")
        for name, kernel in KERNELS.items():
            _LIB.impl(name, kernel, "PrivateUse1")


__all__ = ["KERNELS", "install"]

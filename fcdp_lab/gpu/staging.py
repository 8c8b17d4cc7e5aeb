"""Gloo on CUDA tensors for the GPU check's four ranks on one GPU: native where gloo has the collective, staged
through pinned host memory where it does not (used only by ``fcdp_lab/gpu/one_gpu.py``, never by the product).

Four processes on one GPU cannot use NCCL (one communicator per device), so the check runs DeepSpeed's real engine on
the gloo backend with CUDA tensors. torch's gloo backend has CUDA variants of some collectives and not of others;
:func:`probe` calls each collective DeepSpeed's ZeRO-3 and FCDP use once on a small CUDA tensor (every rank the same
calls, so a refusal is the same on every rank: gloo refuses an unsupported device before it communicates) and
:func:`install` replaces each refused one in ``torch.distributed`` (where ``deepspeed.comm``'s torch backend looks it
up at each call) by a staged call:

- the device is synchronized (whatever stream produced the inputs has finished), every CUDA tensor argument is
  copied into pinned host memory, the collective runs on the host copies synchronously, and the copies of its
  *output* (the first argument: ``all_reduce``/``broadcast``'s tensor, the gathered list or tensor, the reduced
  shard) are written back into their CUDA tensors. Only the output: an input may be a view of the output (DeepSpeed's
  in-place reduce-scatter reduces a shard of its own input), and writing the input's unreduced copy back after the
  output would overwrite the result (the first dry run did exactly that: the hierarchical gradient off by 10%);
- ``async_op=True`` gets a completed work: the staged call already finished, so ``wait()`` has nothing to wait for.

Slow and fully synchronous by design: the check proves values, streams and the allocator on a real device, not
overlap. ``force=True`` stages CPU tensors too (host copies made by ``clone``), so a CPU dry run exercises the
staging logic itself.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as tdist

#: The collectives DeepSpeed's ZeRO-3 and FCDP call through ``deepspeed.comm`` (its torch backend).
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "all_to_all_single")
#: The keyword of each collective's output (its first parameter), where a caller names it.
OUTPUT = {"all_reduce": "tensor", "broadcast": "tensor", "all_gather": "tensor_list",
          "all_gather_into_tensor": "output_tensor", "reduce_scatter_tensor": "output", "reduce_scatter": "output",
          "all_to_all_single": "output"}
_ORIGINAL = "_fcdp_staged_original"


class _Done:
    """The work of a staged call, already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _swap(value: Any, copies: dict) -> Any:
    if isinstance(value, torch.Tensor):
        return copies.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, copies) for v in value)
    return value


def staged(original: Callable, force: bool = False) -> Callable:
    """``original`` with every CUDA tensor argument (every tensor with ``force``) staged through host memory."""
    output_key = OUTPUT[original.__name__]
    signature = inspect.signature(original)

    def call(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in _tensors(list(args) + list(kwargs.values())) if force or t.is_cuda]
        if not tensors:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)  # async_op and the output by name, however they were passed
        args, kwargs = (), dict(bound.arguments)
        from torch.distributed import distributed_c10d
        if kwargs.get("group", None) in getattr(distributed_c10d._world, "pg_coalesce_state", {}) or \
                (kwargs.get("group") is None and distributed_c10d._world.pg_coalesce_state):
            raise RuntimeError(f"gpu check staging: {original.__name__} inside a coalescing manager would only be "
                               f"queued on the host copies; nothing in DeepSpeed 0.19.8's ZeRO-3 path does that")
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        copies = {}
        for t in tensors:
            if id(t) not in copies:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                host.copy_(t)
                copies[id(t)] = host
        asked_async = bool(kwargs.pop("async_op", False))
        result = original(*_swap(args, copies), **{k: _swap(v, copies) for k, v in kwargs.items()}, async_op=False)
        for t in _tensors(kwargs.get(output_key)):
            if id(t) in copies:
                t.copy_(copies[id(t)])
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        return _Done() if asked_async else result
    setattr(call, _ORIGINAL, original)
    return call


def probe(device: torch.device, world: int) -> dict[str, bool]:
    """Which of :data:`COLLECTIVES` gloo runs natively on ``device`` tensors (every rank calls each once)."""
    out = {}
    x = torch.ones(world * 4, device=device)
    trials = {
        "all_reduce": lambda: tdist.all_reduce(x.clone()),
        "broadcast": lambda: tdist.broadcast(x.clone(), src=0),
        "all_gather": lambda: tdist.all_gather([torch.empty(4, device=device) for _ in range(world)], x[:4].clone()),
        "all_gather_into_tensor": lambda: tdist.all_gather_into_tensor(torch.empty(world * 4, device=device),
                                                                       x[:4].clone()),
        "reduce_scatter_tensor": lambda: tdist.reduce_scatter_tensor(torch.empty(4, device=device), x.clone()),
        "reduce_scatter": lambda: tdist.reduce_scatter(torch.empty(4, device=device), list(x.clone().chunk(world))),
        "all_to_all_single": lambda: tdist.all_to_all_single(torch.empty_like(x), x.clone()),
    }
    for name in COLLECTIVES:
        try:
            trials[name]()
            out[name] = True
        except (RuntimeError, ValueError, NotImplementedError):
            out[name] = False
        tdist.barrier()
    return out


def install(native: dict[str, bool], force: bool = False) -> list[str]:
    """Stage every collective ``native`` says gloo lacks (all of them with ``force``); the names staged. Call it before
    ``deepspeed.init_distributed``: DeepSpeed's torch backend binds its all-gather and reduce-scatter functions there.
    Both namespaces are patched (``torch.distributed`` and ``distributed_c10d``, which DeepSpeed's coalesced
    all-gather calls into)."""
    from torch.distributed import distributed_c10d
    names = [n for n in COLLECTIVES if force or not native.get(n, False)]
    for name in names:
        fn = getattr(tdist, name)
        if not hasattr(fn, _ORIGINAL):
            wrapped = staged(fn, force=force)
            setattr(tdist, name, wrapped)
            if getattr(distributed_c10d, name, None) is fn:
                setattr(distributed_c10d, name, wrapped)
    return names

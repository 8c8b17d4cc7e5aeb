"""What every worker needs: the process group, the fcdp block, one plain-or-FCDP training run.

Workers run on every rank of a spawned gloo group (``conftest.run_ranks``) and return plain data
(losses, weights, stats) for the test process to compare.
"""
from __future__ import annotations

import torch

import deepspeed
from deepspeed import comm as dist

import fcdp_deepspeed
from fcdp_lab.harness import toy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def setup(ranks_per_node: int = 2) -> None:
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    fcdp_deepspeed.enable_comm_counting(ranks_per_node=ranks_per_node)


#: ZeRO-3's own gradient path: the ``auto`` defaults reorder gradient sums on 2 x 2 (docs/how-it-works.md),
#: so tests that compare with plain ZeRO-3 bit for bit pin these unless they name a gradient mode.
ZERO3_GRADS = {"grad_reduce": "flat", "grad_accumulation": "rank"}


def fcdp_block(ranks_per_node: int = 2, **extra) -> dict:
    pinned = {} if {"grad_reduce", "grad_accumulation"} & set(extra) else ZERO3_GRADS
    return {"enabled": True, "ranks_per_node": ranks_per_node, **pinned, **extra}


def run_scenario(sc: dict, fcdp: bool, ranks_per_node: int = 2) -> toy.RunResult:
    dtype = sc.get("dtype", "fp32")
    cfg = toy.ds_config(fcdp_block(ranks_per_node, **sc.get("fcdp", {})) if fcdp else None,
                        regime=sc.get("regime", "large"), grad_accum=sc.get("grad_accum", 1), dtype=dtype,
                        loss_scale_power=sc.get("loss_scale_power", 8),
                        **sc.get("zero", {}))
    engine = toy.build_engine(cfg, lora_rank=sc.get("lora_rank", 0), activation_checkpointing=sc.get("ckpt", False),
                              zero_init=sc.get("zero_init", False), layers=sc.get("layers", 4))
    res = toy.train(engine, sc.get("steps", 3), record_step_stats=True, record_phases=True, dtype=DTYPES[dtype])
    weights = toy.gather_weights(engine)  # collective: every rank gathers, rank 0 reports
    res.weights = weights if dist.get_rank() == 0 else {}
    res.extra["optimizer_class"] = type(engine.optimizer).__name__
    return res


def forward(engine, hidden: int) -> torch.Tensor:
    return toy.evaluate(engine, torch.randn(2, hidden, generator=torch.Generator().manual_seed(7)))


class LogCapture:
    """Collect FCDP's log records (warnings about budgets, degraded parameters)."""

    def __init__(self) -> None:
        import logging
        from deepspeed.utils import logger
        self.messages: list[str] = []
        self.levels: list[int] = []
        handler = logging.Handler()

        def emit(record) -> None:
            self.messages.append(record.getMessage())
            self.levels.append(record.levelno)

        handler.emit = emit  # type: ignore[assignment]
        handler.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.setLevel(min(logger.level or logging.INFO, logging.INFO))

    def fcdp(self, needle: str = "", min_level: int = 0) -> list[str]:
        return [m for m, level in zip(self.messages, self.levels)
                if m.startswith("fcdp:") and needle in m and level >= min_level]


class GroupMPU:
    """The part of a Megatron-style ``mpu`` DeepSpeed reads, over given tensor- and data-parallel groups (each a
    partition of the world). Every rank creates every group, in the same order: tensor-parallel, then
    data-parallel."""

    def __init__(self, tp_groups: list[list[int]], dp_groups: list[list[int]]) -> None:
        rank = dist.get_rank()
        self.tp_groups, self.dp_groups = tp_groups, dp_groups
        self._tp = self._dp = None
        for ranks in tp_groups:
            g = dist.new_group(ranks)
            if rank in ranks:
                self._tp, self._tp_ranks = g, ranks
        for ranks in dp_groups:
            g = dist.new_group(ranks)
            if rank in ranks:
                self._dp, self._dp_ranks = g, ranks

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self):
        return self._dp_ranks.index(dist.get_rank())

    def get_data_parallel_world_size(self):
        return len(self._dp_ranks)

    def get_data_parallel_group_ranks(self):
        return list(self._dp_ranks)

    def get_model_parallel_group(self):
        return self._tp

    def get_model_parallel_rank(self):
        return self._tp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self):
        return len(self._tp_ranks)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return self._tp_ranks[0]


def lab_variants() -> dict:
    """What this rank runs of the lab's broken variants (a worker of tests/test_forkserver.py): whether the run-ahead's
    invalidation is patched (``push.skip_invalidation``), the environment that named it, and the parent process."""
    import os
    from fcdp_deepspeed.runtime.runahead import RunAhead
    return {"patched": hasattr(RunAhead.cancel, "__wrapped__"), "named": os.environ.get("FCDP_LAB_BREAK", ""),
            "ppid": os.getppid()}

"""The DeepSpeed hook: a stage-3 optimizer subclass that owns the cache's invalidation events.

``deepspeed.initialize`` builds this class instead of ``DeepSpeedZeroOptimizer_Stage3`` once
:func:`fcdp_deepspeed.install` ran (the engine imports the class from its module at call time).
Without an enabled ``fcdp`` block it behaves exactly like its parent.

Invalidation events (every path that writes a parameter's bit16 value):

- ``_unflatten_partitioned_parameters``: the optimizer (or a checkpoint restore of the optimizer
  state) wrote new values into a sub-group's partitions -> those params are invalidated at once;
- ``invalidate_secondary_tensor`` (end of every applied step, ``_post_step``): everything the
  optimizer owns or that requires grad, and any param whose ``requires_grad`` flipped;
- ``checkpoint_event_epilogue`` (load/save checkpoint, 16-bit consolidation): everything, frozen
  params included (``load_checkpoint`` writes frozen partitions directly; hpZ misses that);
- ``partition(has_been_updated=True)`` (``GatheredParameters(modifier_rank=...)``): refreshed in
  place by the cache's partition hook (``runtime.attach._SecondaryHook``).
An overflow-skipped step returns before any of these: nothing changed, nothing is invalidated.
"""
from __future__ import annotations

import contextlib

from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from fcdp_deepspeed.config import check_ds_config_compatible, load_ds_config, parse_fcdp_config
from fcdp_deepspeed.runtime import FCDPRuntime
from fcdp_deepspeed.stats import LEDGER


class FCDPStage3(DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` plus a node-local parameter cache (when enabled)."""

    def __init__(self, module, init_optimizer, *args, **kwargs) -> None:
        ds_config = load_ds_config(kwargs.get("ds_config"))
        fcdp_config = parse_fcdp_config(ds_config)
        if fcdp_config.enabled:
            check_ds_config_compatible(ds_config)
        self.fcdp: FCDPRuntime | None = None  # set before super(): overridden hooks run during init
        super().__init__(module, init_optimizer, *args, **kwargs)
        # Plain engines report process-wide collective bytes since this point (see get_stats).
        self.fcdp_baseline = LEDGER.totals.copy()
        if fcdp_config.enabled:
            params = [p for group in self.fp16_groups for p in group]
            self.fcdp = FCDPRuntime(fcdp_config, ds_config, module, self.dp_process_group, params,
                                    param_names=self.param_names).activate()

    # Gradient reduction and the step issue collectives of this engine: attribute them to its stats.
    def _attributed(self):
        return LEDGER.attribute(self.fcdp.comm) if self.fcdp is not None else contextlib.nullcontext()

    def reduce_ready_partitions_and_remove_grads(self, param) -> None:
        with self._attributed():
            super().reduce_ready_partitions_and_remove_grads(param)

    def independent_gradient_partition_epilogue(self) -> None:
        with self._attributed():
            super().independent_gradient_partition_epilogue()

    def step(self, closure=None):
        with self._attributed():
            return super().step(closure)

    def _unflatten_partitioned_parameters(self, sub_group_id: int) -> None:
        super()._unflatten_partitioned_parameters(sub_group_id)
        if self.fcdp is not None:
            self.fcdp.invalidate_params(self.fp16_groups[sub_group_id], "optimizer_write")

    def invalidate_secondary_tensor(self) -> None:
        if self.fcdp is None:
            return super().invalidate_secondary_tensor()
        self.fcdp.invalidate_changed()

    def _post_step(self, timer_names) -> None:
        super()._post_step(timer_names)
        if self.fcdp is not None:
            self.fcdp.on_step_end()

    def checkpoint_event_epilogue(self) -> None:
        if self.fcdp is not None:
            self.fcdp.flush("checkpoint")
        super().checkpoint_event_epilogue()


class FCDPZeROOffload(DeepSpeedZeRoOffload):
    """The optimizer-less stage-3 engine (inference, reference models) with the node cache.

    Nothing trains these parameters, so after the first forward every fetch is served from the
    node cache. Checkpoint loads and ``GatheredParameters`` edits still invalidate/refresh.
    """

    def __init__(self, module, *args, **kwargs) -> None:
        ds_config = load_ds_config(kwargs.get("ds_config"))
        fcdp_config = parse_fcdp_config(ds_config)
        if fcdp_config.enabled:
            check_ds_config_compatible(ds_config)
        self.fcdp: FCDPRuntime | None = None
        super().__init__(module, *args, **kwargs)
        self.fcdp_baseline = LEDGER.totals.copy()
        if fcdp_config.enabled:
            first = next((p for p in module.parameters() if hasattr(p, "ds_process_group")), None)
            group = self.dp_process_group if self.dp_process_group is not None else getattr(first, "ds_process_group", None)
            self.fcdp = FCDPRuntime(fcdp_config, ds_config, module, group, []).activate()

    # DeepSpeedEngine calls these around load_checkpoint when the "optimizer" has them.
    def checkpoint_event_prologue(self) -> None:
        pass

    def checkpoint_event_epilogue(self) -> None:
        if self.fcdp is not None:
            self.fcdp.flush("checkpoint")

"""The DeepSpeed hook: stage-3 optimizer subclasses; FCDP's owns the cache's invalidation events.

``deepspeed.initialize`` builds :class:`CountedStage3` instead of ``DeepSpeedZeroOptimizer_Stage3``
once :func:`fcdp_deepspeed.install` ran (the engine imports the class from its module at call time);
its ``__new__`` builds :class:`FCDPStage3` when the config enables ``fcdp``, so only those jobs run
FCDP's overrides. The optimizer-less engine gets :class:`CountedZeROOffload` / :class:`FCDPZeROOffload`
the same way. Both plain classes only count the engine's collectives (``get_stats``).

Invalidation events (every path that writes a parameter's bit16 value):

- ``_unflatten_partitioned_parameters``: the optimizer (or a checkpoint restore of the optimizer
  state) wrote new values into a sub-group's partitions -> those params are invalidated at once;
- ``invalidate_secondary_tensor`` (end of every applied step, ``_post_step``): everything the
  optimizer owns or that requires grad, and any param whose ``requires_grad`` flipped;
- ``checkpoint_event_epilogue`` (load/save checkpoint, 16-bit consolidation): everything, frozen
  params included (``load_checkpoint`` writes frozen partitions directly; hpZ misses that); it also
  waits for every rank, so that ``latest`` is written only after every rank's checkpoint files;
- ``partition(has_been_updated=True)`` (``GatheredParameters(modifier_rank=...)``): refreshed in
  place by the cache's partition hook (``runtime.attach._SecondaryHook``).
An overflow-skipped step returns before any of these: nothing changed, nothing is invalidated.

``fcdp.param_compression``'s references (``runtime/compression_reference.py``) are optimizer state: ``state_dict``
adds them to each rank's optimizer state (the ``fcdp_compression`` envelope, ``compress/state.py``) and
``load_state_dict`` restores them (a checkpoint without them, or of another codec or layout, starts
them empty); ``_restore_from_bit16_weights`` drops them (``refresh_fp32_params``) or, inside a load (without
the optimizer states, module only), starts every part from nothing (``compress/state.py``). Optimizer steps
keep them; saves and 16-bit consolidation (inside checkpoint events) keep them, and a checkpoint event inside
an accumulation window keeps the window (node buffer, pending residuals), as DeepSpeed keeps its partial sums.

Gradients (``grad_reduce``/``grad_accumulation``, see ``grads/``): DeepSpeed's bucket reduction
``__avg_scatter_grads`` runs inside a ``grads.bucket`` block, so its ``reduce_scatter_coalesced`` call
goes to the engine's :class:`~fcdp_deepspeed.grads.GradReducer`; ``partition_grads`` applies the
reducer's copy/add/skip decision under node accumulation; the end of the boundary backward flushes
buffered window sums; ``_pre_step``/``zero_grad`` open a new accumulation window. The modes that run
are resolved once per engine (``plan.py``, logged by rank 0) when the topology is known, in ``_attach``;
the first bucket of the first window of more than one micro-step allocates the node buffer when the
accumulation steps changed after initialize.
"""
from __future__ import annotations

import enum

from deepspeed import comm as dist
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from fcdp_deepspeed import grads, layered
from fcdp_deepspeed.grads import compressed as compress_grads
from fcdp_deepspeed.grads.residual import move_residuals, reap_residuals
from fcdp_deepspeed.compress.state import CompressionState
from fcdp_deepspeed.config import ds_compat
from fcdp_deepspeed.config import FCDPConfigError, layered_problems
from fcdp_deepspeed.config import (check_ds_config_compatible, grad_accumulation_blockers, grad_path_blockers,
                                   load_ds_config, parse_fcdp_config)
from fcdp_deepspeed.engine import announce
from fcdp_deepspeed.engine.counting import count_plain_engine
from fcdp_deepspeed.engine.diloco_steps import DiLoCoSteps
from fcdp_deepspeed.engine.grad_steps import AVG_SCATTER as _AVG_SCATTER, GradSteps
from fcdp_deepspeed.machine import link
from fcdp_deepspeed.paths import PathChoice, Paths
from fcdp_deepspeed.reporting import timeline
from fcdp_deepspeed.reporting.stats import GRAD_FAMILY, LEDGER, CommCounters
from fcdp_deepspeed.runtime import FCDPRuntime
from fcdp_deepspeed.storage import freshness

_BUCKET = timeline.Phase.GRAD_BUCKET  # a gradient bucket's (or the window flush's) host time (timeline.py)
assert not ds_compat.missing_internals(), f"DeepSpeed's stage-3 internals moved: {ds_compat.missing_internals()}"


def _block_enabled(kwargs: dict) -> bool:
    """Whether the config DeepSpeed hands the stage-3 class (``ds_config=``) enables ``fcdp``."""
    return parse_fcdp_config(load_ds_config(kwargs.get("ds_config"))).enabled


def _without_inherited_hpz_group(kwargs: dict) -> dict:
    """The keyword arguments of a ``DeepSpeedZeRoOffload`` with ``zero_param_parallel_group`` dropped
    when the config enables ``fcdp``.

    [Note: DeepSpeed 0.19.8 hands an earlier hpZ engine's group to every later engine]
    ``groups._create_zero_param_parallel_group`` keeps the ZeRO++ hpZ group in a module global that no
    engine resets; ``DeepSpeedZeroOptimizer_Stage3.__init__`` (stage3.py:267) and
    ``DeepSpeedEngine._configure_zero_optimizer`` (engine.py:2717, optimizer-less engines) read it whatever
    the engine's own ``zero_hpz_partition_size`` and pass it on, and the ``zero.Init`` that partitions a
    model handed to ``deepspeed.initialize`` unpartitioned (parameter_offload.py:270) becomes an hpZ
    instance. An FCDP config cannot ask for hpZ (``check_ds_config_compatible``), so any group here is
    inherited: partition without one; ``runtime.attach`` points the instance at the node group afterwards.
    """
    return {**kwargs, "zero_param_parallel_group": None} if _block_enabled(kwargs) else kwargs


def _place_gradient_memory(reducer: "grads.GradReducer | None", promotion) -> None:
    """``grad_buffer_device: device``: at the cache's measured step the node buffer takes its share of the headroom,
    then the error-feedback residuals what the buffer left of its budget, before the cache takes the rest ([Note: the
    device buffer comes from a measured step] in ``grads/buffer.py``); what they emptied on the host is dropped at
    later step ends, once its copies completed."""
    if reducer is None or reducer.config.grad_buffer_device != "device":
        return
    planner, compressor = reducer.planner, reducer.comm.compressor

    def claim(headroom: int) -> int:
        moved = planner.promote(headroom)
        if compressor is not None and planner.device_budget is not None:
            moved += move_residuals(compressor.store, planner.device_budget - moved)
        return moved

    def reap() -> None:
        reducer.buffer.reap()
        if compressor is not None:
            reap_residuals(compressor.store)
    promotion.claims.append(claim)
    promotion.reapers.append(reap)


def _zero3_paths(engine, config, dp_group, module) -> PathChoice:
    """Choose the paths (``fcdp.link``, collective); on ZeRO-3's, make ``engine`` the plain counted engine it is then.

    [Note: ZeRO-3's paths are ZeRO-3's engine] Where the probe keeps ZeRO-3's paths, FCDP would only add host work
    (fetch wrappers, the cache's bookkeeping with nothing to keep): the engine stays DeepSpeed's optimizer counted
    as a plain one (``CountedStage3._attach``), bit for bit, with the choice in ``get_stats`` and the "on" line."""
    choice, topo = link.choose_for(config, dp_group, module)
    engine.fcdp_paths = choice
    if choice.paths is Paths.ZERO3:
        count_plain_engine(module, engine.fcdp_comm, config.ranks_per_node)
        comm = engine.fcdp_comm  # the layout the probe found, not the launcher's guess
        comm.node_of_rank, comm.layout_source, comm.follows_process = tuple(topo.node_of_rank), topo.source, False
        announce.announce_zero3_paths(topo, choice)
    return choice


class CountedStage3(DeepSpeedZeroOptimizer_Stage3):
    """What ``deepspeed.initialize`` builds for ZeRO-3 after :func:`~fcdp_deepspeed.install`:
    DeepSpeed's optimizer, unchanged except that this engine's collectives are counted for
    ``get_stats`` (parameter gathers, gradient reduction, the step) and its writes of partitions are stamped
    (``storage/freshness.py``: an FCDP engine over the same model checks its copies against them). With an enabled
    ``fcdp`` block, ``__new__`` builds :class:`FCDPStage3` instead, so jobs without the block never run FCDP's cache,
    gather or gradient code."""

    def __new__(cls, *args, **kwargs):
        if cls is CountedStage3 and _block_enabled(kwargs):
            cls = FCDPStage3  # a subclass: Python then runs FCDPStage3.__init__ with the same arguments
        return super().__new__(cls)

    def __init__(self, module, init_optimizer, *args, **kwargs) -> None:
        #: This engine's collectives from its creation on, with or without the cache (see get_stats).
        self.fcdp_comm = CommCounters()
        #: Host seconds per phase of inter-node work (``timeline.py``; ``get_stats``' ``timeline_*``).
        self.fcdp_clock = timeline.PhaseClock()
        super().__init__(module, init_optimizer, *args, **kwargs)
        freshness.watch_partitions(module.parameters())  # partition(has_been_updated=True) stamps its parameters
        self._attach(module, load_ds_config(kwargs.get("ds_config")))

    def _attach(self, module, ds_config: dict) -> None:
        """After DeepSpeed built the optimizer: attribute the parameters' gathers to this engine."""
        count_plain_engine(module, self.fcdp_comm, parse_fcdp_config(ds_config).ranks_per_node)

    # [Note: freshness by construction] (storage/freshness.py): every write of a partition is stamped here, by
    # every ZeRO-3 engine after install(), FCDP or plain, so a copy any engine holds is checked against it at use.
    def _fcdp_written(self, kind: freshness.Write, params=None) -> None:
        freshness.written(params if params is not None else (p for group in self.fp16_groups for p in group), kind)

    def _unflatten_partitioned_parameters(self, sub_group_id: int) -> None:
        super()._unflatten_partitioned_parameters(sub_group_id)
        self._fcdp_written(freshness.Write.OPTIMIZER, self.fp16_groups[sub_group_id])

    def _post_step(self, timer_names) -> None:
        super()._post_step(timer_names)
        self._fcdp_written(freshness.Write.OPTIMIZER)  # every owned partition, whichever path the step wrote it by

    def load_state_dict(self, state_dict_list, *args, **kwargs):
        out = super().load_state_dict(state_dict_list, *args, **kwargs)
        self._fcdp_written(freshness.Write.LOAD)
        return out

    def checkpoint_event_epilogue(self) -> None:
        # loads write frozen partitions too (through the module's state dict); saves take the same path
        self._fcdp_written(freshness.Write.LOAD, (p for p in self.module.parameters() if hasattr(p, "ds_id")))
        super().checkpoint_event_epilogue()

    # Gradient reduction and the step issue collectives of this engine: attribute them to its stats.
    def _attributed(self):
        return LEDGER.attribute(self.fcdp_comm)

    def _timed(self, phase: timeline.Phase):
        return timeline.waiting(phase, self.fcdp_clock)

    def reduce_ready_partitions_and_remove_grads(self, param) -> None:
        with self._attributed(), LEDGER.tagged(GRAD_FAMILY):
            super().reduce_ready_partitions_and_remove_grads(param)

    def independent_gradient_partition_epilogue(self) -> None:
        with self._attributed(), LEDGER.tagged(GRAD_FAMILY):
            super().independent_gradient_partition_epilogue()

    def step(self, closure=None):
        with self._attributed(), self._timed(timeline.Phase.OPTIMIZER_STEP):
            return super().step(closure)

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, *args, **kwargs):
        with self._timed(_BUCKET):
            return getattr(super(), _AVG_SCATTER)(params_to_reduce, *args, **kwargs)


class CompressionSteps:
    """``FCDPStage3``'s compression part (a mixin of helpers; no DeepSpeed method is overridden here): error-feedback
    residuals are committed when a step is applied and dropped otherwise ([Note: residual commit] in
    ``grads/residual.py``), and saved/loaded in the ``fcdp_compression`` envelope of the optimizer's state dict
    ([Note: the envelope] in ``compress/state.py``), with the parameter references and the events that drop them
    (``fcdp.param_compression``)."""

    fcdp: FCDPRuntime | None
    fcdp_state: CompressionState | None
    fcdp_grads: "grads.GradReducer | None"

    def _attach_compression(self, fcdp_config, trainable: list) -> None:
        """The envelope's parts: the runtime's parameter references, the gradient compressor's residuals."""
        self.fcdp_state = CompressionState()
        if self.fcdp.compression_state is not None:
            self.fcdp_state.register("params", self.fcdp.compression_state)
        compressor = compress_grads.attach_compressor(fcdp_config, self.fcdp_grad_plan, self.fcdp_grads, trainable,
                                                      self.communication_data_type, lambda: self.loss_scale)
        if compressor is not None:
            self.fcdp_state.register("grads", compress_grads.GradState(compressor))

    def _fcdp_compressor(self):
        return None if self.fcdp_grads is None else self.fcdp_grads.comm.compressor

    def _compression_discard(self, skipped: bool) -> None:
        """Gradients cleared without being applied (``skipped``: the overflow clean-up of a skipped step)."""
        compressor = self._fcdp_compressor()
        if compressor is not None:
            compressor.discard(skipped=skipped)

    def _compression_commit(self) -> None:
        """The step is applied: the residuals its gradients left are kept."""
        compressor = self._fcdp_compressor()
        if compressor is not None:
            compressor.commit(clip=self._fcdp_clip_coefficient())

    def _fcdp_clip_coefficient(self):
        """The factor this step's ``unscale_and_clip_grads`` applied beyond the loss scale, as a device tensor
        (``None`` without clipping): [Note: residuals and clipping] in ``grads/compressed.py``."""
        return compress_grads.clip_coefficient(getattr(self, "_global_grad_norm", None), self.clip_grad)


class Phase(enum.Enum):
    """Where an ``FCDPStage3`` is in DeepSpeed's cycle: what a ``zero_grad`` or a restore of the bit16 weights means
    depends on it."""

    #: Forward and backward micro-steps of an accumulation window.
    TRAINING = "training"
    #: From ``_pre_step`` to ``_post_step`` (or to the overflow clean-up of a skipped step): DeepSpeed's own
    #: ``zero_grad`` inside an applied step clears the gradients it is about to apply.
    STEPPING = "stepping"
    #: From ``checkpoint_event_prologue`` to the first ``_restore_from_bit16_weights`` or the epilogue: a restore now
    #: is a load without the optimizer state (``load_module_only`` restores twice: refresh_fp32_params, then the
    #: engine).
    CHECKPOINT = "checkpoint"
    #: Inside a checkpoint event, after its first restore.
    RESTORED = "restored"


class FCDPStage3(DiLoCoSteps, CompressionSteps, GradSteps, CountedStage3):
    """``DeepSpeedZeroOptimizer_Stage3`` plus a node-local parameter cache: the one class of the chain that overrides
    DeepSpeed's methods (``CountedStage3`` below it only counts and stamps writes). Each override calls the parts in
    the order it reads: parameters (``self.fcdp``, ``runtime/``), gradients (``GradSteps``, ``grads/``), compression
    (``CompressionSteps``), DiLoCo (``DiLoCoSteps``, ``diloco/``)."""

    def __init__(self, module, init_optimizer, *args, **kwargs) -> None:
        ds_config = load_ds_config(kwargs.get("ds_config"))
        fcdp_config = parse_fcdp_config(ds_config)
        if fcdp_config.enabled:
            check_ds_config_compatible(ds_config)
        self.fcdp: FCDPRuntime | None = None  # set before super(): overridden hooks run during init
        self.fcdp_grads: grads.GradReducer | None = None
        self.fcdp_grad_plan = None  # the resolved gradient modes (plan.GradPlan), set in _attach
        #: The compression state saved in this rank's optimizer state (``compress/state.py``), set in _attach.
        self.fcdp_state: CompressionState | None = None
        self.fcdp_phase = Phase.TRAINING
        #: ``fcdp.layered``: the model's layers run layered; installed before DeepSpeed hooks the model.
        self.fcdp_layered = None
        if fcdp_config.enabled and fcdp_config.layered is not None:
            # the accumulation DeepSpeed resolved (train_batch_size can imply it), not only the config's key
            resolved = {**ds_config, "gradient_accumulation_steps": kwargs.get("gradient_accumulation_steps", 1)}
            problems = layered_problems(fcdp_config.layered, resolved)
            if problems:
                raise FCDPConfigError(f"fcdp cannot run with this DeepSpeed config: {problems[0]}.")
            micro = ds_config.get("train_micro_batch_size_per_gpu")  # where the config states it (HF fills it in)
            self.fcdp_layered = layered.attach(module, fcdp_config.layered, micro if isinstance(micro, int) else None)
        super().__init__(module, init_optimizer, *args, **self._diloco_kwargs(fcdp_config, kwargs))
        if self.fcdp_layered is not None:
            announce.announce_layered(self.fcdp_layered)

    # -- construction -------------------------------------------------------------------------------
    def initialize_ds_offload(self, *args, **kwargs):
        offload = super().initialize_ds_offload(*args, **_without_inherited_hpz_group(kwargs))
        if self.fcdp_layered is not None:  # before create_reduce_and_remove_grad_hooks reads the leaf marks
            self.fcdp_layered.keep_parameter_gradients()
        self._diloco_repartition(kwargs["module"])
        return offload

    def _attach(self, module, ds_config: dict) -> None:
        fcdp_config = parse_fcdp_config(ds_config)
        if not fcdp_config.enabled or fcdp_config.diloco is not None:
            super()._attach(module, ds_config)  # disabled or DiLoCo: the plain engine's counting, no cache
            if self.fcdp_diloco_topology is not None:
                self._attach_diloco(fcdp_config)
            return
        choice = _zero3_paths(self, fcdp_config, self.dp_process_group, module)
        if choice.paths is Paths.ZERO3:
            return
        params = [p for group in self.fp16_groups for p in group]
        self.fcdp = FCDPRuntime(fcdp_config, ds_config, module, self.dp_process_group, params, clock=self.fcdp_clock,
                                param_names=ds_compat.param_names(self, module), comm=self.fcdp_comm,
                                paths=choice).activate()
        # [Note: the gradient plan needs the topology: explicit modes are refused only where they would run]
        self.fcdp_grad_plan, self.fcdp_grads = grads.build_reducer(
            fcdp_config, self.fcdp.topology, self.dp_process_group, [p for p in params if p.requires_grad],
            self.gradient_accumulation_dtype, ds_compat.boundary_reader(self),
            accumulation_steps=self.gradient_accumulation_steps, path_blockers=grad_path_blockers(ds_config),
            accumulation_blockers=grad_accumulation_blockers(ds_config), node_rss=self.fcdp.allocation.node_rss)
        self._cap_reduce_bucket(fcdp_config.grad_bucket_size, [p for p in params if p.requires_grad])
        announce.announce(self.fcdp, self.fcdp_grad_plan)
        self._attach_compression(fcdp_config, [p for p in params if p.requires_grad])
        _place_gradient_memory(self.fcdp_grads, self.fcdp.promotion)

    # -- the backward: gradients ----------------------------------------------------------------------
    def reduce_independent_p_g_buckets_and_remove_grads(self, param) -> None:
        super().reduce_independent_p_g_buckets_and_remove_grads(param)
        self._grads_after_gradient(param)

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, *args, **kwargs):
        return self._grads_reduce_bucket(params_to_reduce, *args, **kwargs)

    def partition_grads(self, params_to_release, grad_partitions):
        return self._grads_partition(params_to_release, grad_partitions)

    def independent_gradient_partition_epilogue(self) -> None:
        super().independent_gradient_partition_epilogue()
        self._grads_after_backward()

    # -- the step, top to bottom: step -> _pre_step -> (DeepSpeed's writes: _unflatten_partitioned_parameters)
    #    -> invalidate_secondary_tensor -> _post_step -> after the step; zero_grad between windows ----------------
    def step(self, closure=None):
        self._grads_drain_window()  # never step without the window's sums
        self._diloco_before_step()  # a warm-up step's gradients averaged over the nodes
        out = super().step(closure)  # counted; DeepSpeed's step calls the hooks below
        self._diloco_after_step()  # the outer step, when one is due
        return out

    def _pre_step(self) -> None:
        super()._pre_step()
        self.fcdp_phase = Phase.STEPPING
        if self.fcdp_grads is not None:
            self.fcdp_grads.new_window(discard=False)

    def _unflatten_partitioned_parameters(self, sub_group_id: int) -> None:
        super()._unflatten_partitioned_parameters(sub_group_id)  # written (and stamped, CountedStage3)
        if self.fcdp is not None:
            self.fcdp.invalidate_params(self.fp16_groups[sub_group_id], "optimizer_write")

    def invalidate_secondary_tensor(self) -> None:
        if self.fcdp is None:
            return super().invalidate_secondary_tensor()
        self.fcdp.invalidate_changed()

    def _post_step(self, timer_names) -> None:
        self._compression_commit()  # the step was applied: its residuals stay
        if self.fcdp_phase is Phase.STEPPING:  # (a load with a swapped optimizer runs _post_step too)
            self.fcdp_phase = Phase.TRAINING
        super()._post_step(timer_names)  # DeepSpeed's, then every owned partition stamped (CountedStage3)
        if self.fcdp is not None:
            self.fcdp.on_step_end()  # after the stamps: the run-ahead plans the next window from here

    def zero_grad(self, set_to_none=True) -> None:
        super().zero_grad(set_to_none)
        stepping = self.fcdp_phase is Phase.STEPPING
        if not (stepping and not self.overflow):  # DeepSpeed's own zero_grad inside an applied step keeps them
            self._compression_discard(skipped=stepping)
            if stepping:  # the overflow clean-up: a skipped step ends here
                self.fcdp_phase = Phase.TRAINING
        if self.fcdp_grads is not None:
            self.fcdp_grads.new_window(discard=True)

    # -- checkpoints ------------------------------------------------------------------------------------
    def checkpoint_event_prologue(self) -> None:
        super().checkpoint_event_prologue()
        self.fcdp_phase = Phase.CHECKPOINT  # only a load rewrites the weights in one (_restore_from_bit16_weights)
        if self.fcdp is not None:
            self.fcdp.checkpoint_event(inside=True)

    def state_dict(self):
        state = super().state_dict()
        return self.fcdp_state.save_into(state) if self.fcdp_state is not None else state

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False,
                        checkpoint_folder=None, load_serial=None, param_shapes=None):
        # this rank's own file (DeepSpeed deletes it from the list under load_serial); universal or without the
        # optimizer states: none of ours (every part starts from nothing: exact references, zero residuals)
        mine = None if checkpoint_folder or not load_optimizer_states else \
            state_dict_list[dist.get_rank(group=self.dp_process_group)]
        super().load_state_dict(state_dict_list, load_optimizer_states=load_optimizer_states,
                                load_from_fp32_weights=load_from_fp32_weights, checkpoint_folder=checkpoint_folder,
                                load_serial=load_serial, param_shapes=param_shapes)
        if self.fcdp_state is not None:
            self.fcdp_state.load_from(mine)  # collective (agreement), as the load itself

    def _restore_from_bit16_weights(self) -> None:
        super()._restore_from_bit16_weights()
        if self.fcdp_phase is Phase.CHECKPOINT and self.fcdp_state is not None:
            # a load without the optimizer state: [Note: weights rewritten without the optimizer state]
            self.fcdp_state.reset("weights restored")
            self.fcdp_phase = Phase.RESTORED
        elif self.fcdp is not None:  # refresh_fp32_params (weights edited): the next gathers cross exactly
            self.fcdp.weights_rewritten("weights restored")

    def checkpoint_event_epilogue(self) -> None:
        if self.fcdp is not None:
            self.fcdp.flush("checkpoint")
        self.fcdp_phase = Phase.TRAINING
        # the window's partial sums stay, as DeepSpeed's: [Note: a checkpoint inside a window] (grads/buffer.py)
        super().checkpoint_event_epilogue()  # every partition stamped (CountedStage3), then DeepSpeed's
        if self.fcdp is not None or self.fcdp_diloco is not None:
            # [Note: `latest` names a complete checkpoint] save_checkpoint calls this after the rank wrote its
            # files and before global rank 0 writes `latest`, with no collective in between (DeepSpeed 0.19.8,
            # engine.py save_checkpoint): a node killed while writing its optimizer states left `latest` naming
            # a checkpoint without them, and every restart failed to load it. Every rank's files first.
            dist.barrier()
        if self.fcdp is not None:
            self.fcdp.checkpoint_event(inside=False)


class CountedZeROOffload(DeepSpeedZeRoOffload):
    """The optimizer-less stage-3 engine (inference, reference models) after ``install()``: DeepSpeed's,
    with its parameter gathers counted; ``__new__`` builds :class:`FCDPZeROOffload` for enabled blocks."""

    def __new__(cls, *args, **kwargs):
        if cls is CountedZeROOffload and _block_enabled(kwargs):
            cls = FCDPZeROOffload
        return super().__new__(cls)

    def __init__(self, module, *args, **kwargs) -> None:
        self.fcdp_comm = CommCounters()
        self.fcdp_clock = timeline.PhaseClock()
        super().__init__(module, *args, **kwargs)
        freshness.watch_partitions(module.parameters())
        self._attach(module, load_ds_config(kwargs.get("ds_config")))

    def _attach(self, module, ds_config: dict) -> None:
        count_plain_engine(module, self.fcdp_comm, parse_fcdp_config(ds_config).ranks_per_node)


class FCDPZeROOffload(CountedZeROOffload):
    """The optimizer-less stage-3 engine (inference, reference models) with the node cache.

    Nothing trains these parameters, so after the first forward every fetch is served from the
    node cache. Checkpoint loads and ``GatheredParameters`` edits still invalidate/refresh.
    """

    def __init__(self, module, *args, **kwargs) -> None:
        ds_config = load_ds_config(kwargs.get("ds_config"))
        if parse_fcdp_config(ds_config).enabled:
            check_ds_config_compatible(ds_config)
        self.fcdp: FCDPRuntime | None = None
        super().__init__(module, *args, **_without_inherited_hpz_group(kwargs))

    def _attach(self, module, ds_config: dict) -> None:
        fcdp_config = parse_fcdp_config(ds_config)
        if not fcdp_config.enabled:
            return super()._attach(module, ds_config)
        first = next((p for p in module.parameters() if hasattr(p, "ds_process_group")), None)
        group = self.dp_process_group if self.dp_process_group is not None else getattr(first, "ds_process_group", None)
        choice = _zero3_paths(self, fcdp_config, group, module)
        if choice.paths is Paths.ZERO3:
            return
        self.fcdp = FCDPRuntime(fcdp_config, ds_config, module, group, [], comm=self.fcdp_comm,
                                clock=self.fcdp_clock, trains=False, paths=choice).activate()
        announce.announce(self.fcdp, None)

    # DeepSpeedEngine calls these around load_checkpoint when the "optimizer" has them.
    def checkpoint_event_prologue(self) -> None:
        pass

    def checkpoint_event_epilogue(self) -> None:
        freshness.written((p for p in self.module.parameters() if hasattr(p, "ds_id")), freshness.Write.LOAD)
        if self.fcdp is not None:
            self.fcdp.flush("checkpoint")

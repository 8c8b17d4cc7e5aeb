"""FCDP's part of one DeepSpeed engine: the hook, and what it drives.

- ``stage3.py``: the stage-3 optimizer subclasses (the only DeepSpeed hook) and ``CompressionSteps``;
  ``grad_steps.py``: ``GradSteps``, their gradient-path hooks (DeepSpeed's bucket reduction to the engine's
  ``GradReducer``); ``diloco_steps.py``: ``DiLoCoSteps``, the DiLoCo mixin of the same optimizer;
- ``config_check.py``: the ``DeepSpeedConfig`` subclass that refuses a block DeepSpeed would ignore;
- ``announce.py``: the one line that says FCDP is on; ``evaluation.py``: ``exact_gathers``;
  ``counting.py``: a plain engine's collectives attributed to it.

It drives the mechanisms below it (``runtime/``, ``grads/``, ``compress/``, ``diloco/``), which never
import it; only ``activation/`` does.
"""

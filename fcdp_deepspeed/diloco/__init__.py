"""DiLoCo (``fcdp.diloco``): inner steps within a node, an outer step across nodes every H steps.

- ``sync.py``: the outer synchronization; ``exchange.py``: the pseudo-gradient exchange (optionally
  compressed); ``outer.py``: the outer optimizer's state; ``layout.py``: the node-local layout;
  ``state.py``: the checkpoint part; ``files.py``: checkpoint files; ``fragments.py``: streaming DiLoCo's
  fragments (which slice of a shard syncs at which step).

The config block is ``config/diloco.py``; the optimizer mixin that drives this is ``engine/diloco_steps.py``.
"""

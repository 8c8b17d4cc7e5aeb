"""The machine as FCDP sees it: devices and streams, nodes and their process groups.

- ``device.py``: the device door, the one place FCDP issues host<->accelerator copies, streams, events
  and pinned allocations;
- ``topology.py``: node layout and the node / node-peer groups; ``comm_warmup.py``: those communicators
  warmed up at attach, and the memory their first use took;
- ``link.py``: the link probe, one fetch timed each way on those groups at build, agreed on every rank
  (``fcdp.link``; the rule it feeds is ``fcdp_deepspeed/paths.py``).
"""

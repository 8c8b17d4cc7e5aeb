"""``fcdp plan``: per-step inter-node bytes, memory and step-time bounds for a cluster, before running on it.

- ``planner.py``: the command and the ZeRO-3 / hpZ / FCDP model; ``compression.py``: the compressed hop's
  model; ``diloco.py``: the model of a ``fcdp.diloco`` config.
"""

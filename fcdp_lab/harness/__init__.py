"""Ranks and clusters on one machine: what every command and the tests run FCDP with.

- ``launch.py``: ``run_local``, a function on N local ranks (gloo), with a deadline; ``forkserver.py`` and
  ``_worker.py``: its fork server and rank entry point; ``script_rank.py``: a training script on a rank;
- ``cluster.py``: an emulated commodity cluster (network namespaces, shaped links);
- ``toy.py``: tiny models and a deterministic training loop.
"""

"""Tooling that runs beside a training job, never inside one.

The plugin core (``fcdp_deepspeed/*.py``, ``fcdp_deepspeed/runtime/``) never imports this package
(``tests/test_architecture.py`` checks it): a training process loads none of it.

- ``launch.py``, ``_worker.py``: run a function on N local gloo ranks (tests, demo, benchmark);
- ``cluster.py``: an emulated multi-node cluster (network namespaces, shaped uplinks);
- ``toy.py``: tiny models and a deterministic training loop;
- ``bench.py``, ``planner.py`` (with ``tools/plan/compression.py``, the compressed rows' model), ``demo.py``,
  ``doctor.py``: ``fcdp bench``, ``fcdp plan``, ``fcdp demo``, ``fcdp doctor``;
- ``fuzz/``: random event sequences against ZeRO-3 (a hypothesis state machine on a rank server), ``fcdp soak``;
- ``cli.py``: the ``fcdp`` command; ``args.py``: the argument checks every subcommand shares.
"""

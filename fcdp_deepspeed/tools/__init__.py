"""Tooling that runs beside a training job, never inside one.

The plugin core (every other room of the package) never imports this package (``tests/test_architecture.py``
checks it): a training process loads none of it. Grouped by command:

- ``cli.py``: the ``fcdp`` command; ``args.py``: the argument checks every command shares;
- ``doctor.py``, ``demo.py``, ``configs.py``: ``fcdp doctor``, ``fcdp demo``, ``fcdp configs``;
- ``harness/``: ranks and clusters on one machine (``run_local``, the fork server, the emulated cluster, toy
  models): what every command and the tests run FCDP with;
- ``bench/``: ``fcdp bench``; ``plan/``: ``fcdp plan``; ``converge/``: ``fcdp converge``; ``fuzz/``: ``fcdp soak``;
- ``reliability/``: the restart and resize sweep; ``gpu/``: the GPU check; ``megatron_compare.py``: the
  Megatron-DeepSpeed check's comparison.
"""

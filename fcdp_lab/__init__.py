"""The lab: everything that measures, emulates or breaks FCDP, kept out of the installed package.

The wheel holds the plugin (``fcdp_deepspeed``); this folder is the repository's bench, emulated cluster, convergence
runs, event-sequence machine, reliability sweep, GPU check, strict stream model and broken variants. Tests and
``scripts/`` import it; ``scripts/setup_env.sh`` puts the checkout on the venv's path (``fcdp_lab.pth``), so every
rank process of a test finds it. The package never imports the lab (``tests/test_architecture.py``).

- ``harness/``: ranks and clusters on one machine (``run_local``, the fork server, the emulated cluster, toy models);
- ``bench/`` (``python -m fcdp_lab.bench``), ``converge/`` (``python -m fcdp_lab.converge``), ``fuzz/``
  (``python -m fcdp_lab.fuzz.soak``), ``demo.py`` (``python -m fcdp_lab.demo``, what ``scripts/demo.sh`` runs);
- ``reliability/``: the restart and resize sweep; ``gpu/``: the GPU check; ``megatron_compare.py``: the
  Megatron-DeepSpeed check's comparison.
"""

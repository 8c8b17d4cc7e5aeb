"""The restart and resize sweep behind docs/reliability.md (``bash scripts/reliability.sh``).

- ``reliability.py``: the sweep and its table; ``killpoint.py``: holds a script's ranks at a step and
  phase; ``elastic.py``: torchrun agents on the emulated nodes, killed; ``resize.py``: universal
  conversion and resumes at another world size.
"""

"""The GPU check (``scripts/gpu_check.py``): what the CPU tests cannot see, in one command.

- ``check.py``: the command, one process per case; ``report.py``: result types and the summary;
- ``cases.py``, ``fake_pg.py``, ``sanitizer.py``, ``memory.py``: the cases; ``trace.py``: per-step
  numbers from a profiler trace.
"""

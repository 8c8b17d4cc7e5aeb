"""Where cached slices live: cache entries and their slot pool, placement, and what memory a budget may take.

- ``cache.py``: one entry per parameter (its state) and the pooled, pinned slot storage behind them;
- ``placement.py``: where each slice lives, a pure function of sizes, budgets and mode;
- ``memory.py``: host and device limits beyond ``psutil`` (cgroups, pinned rounding, margins), also
  for the gradient buffer and the compression residuals.
"""

"""What FCDP counts and reports: bytes by link class, per-engine counters, step timelines, DeepSpeed's monitor.

- ``stats.py``: the collective ledger (bytes by link class) and the per-engine counters;
- ``engine_stats.py``: one engine's counters as a dict (``get_stats``, the integrations' log entries);
- ``timeline.py``: host seconds per phase of inter-node work; ``monitor.py``: FCDP counters in
  DeepSpeed's monitor (csv / TensorBoard / wandb / comet).
"""

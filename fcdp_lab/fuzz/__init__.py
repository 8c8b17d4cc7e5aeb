"""Random event sequences against ZeRO-3: a stateful property test of the cache's invalidation.

One set of ranks (a *rank server*) runs every sequence; the process that drives it (pytest, the soak
script) generates and shrinks the sequences with hypothesis and sends them one event at a time:

- ``model.py``: the tiny model (an embedding, LoRA-able blocks) and its HF-style operations
  (``load_state_dict`` under ``GatheredParameters``, ``resize_token_embeddings``);
- ``engines.py``: the engines every sequence drives side by side (plain ZeRO-3 and FCDP configs) and how
  each is compared (bit for bit, within tolerance, or only rank lockstep);
- ``events.py``: the events, applied to every engine in turn (rank side);
- ``checks.py``: what is compared after every event (rank side, collective);
- ``server.py``: the rank-side command loop; ``driver.py``: the driver side (start, call, restart);
- ``machine.py``: the hypothesis state machine and one search (generate, shrink, report);
- ``soak.py``: ``python -m fcdp_lab soak``, hundreds of sequences and the figures table in ``docs/reliability.md``.
"""

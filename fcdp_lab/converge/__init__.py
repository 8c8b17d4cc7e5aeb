"""``python -m fcdp_lab converge`` (also ``python -m fcdp_lab.converge``): convergence with lossy compression.

- ``converge.py``: the runs; ``report.py``: their JSON, table and plot; ``reference.py``: a plain-PyTorch
  reference of a run; ``tinylm.py``: the model;
  ``textdata.py``: the text; ``model_hash.py``: bitwise fingerprints of a model on each rank.
"""

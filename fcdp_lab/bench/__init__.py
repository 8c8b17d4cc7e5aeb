"""``python -m fcdp_lab bench`` (also ``python -m fcdp_lab.bench``): ZeRO-3 vs hpZ vs FCDP on an emulated cluster.

- ``bench.py``: the engines, the runs and the tables; ``compression.py``: the compressed engines and
  their preset; ``diloco.py``: DiLoCo's throughput targets; ``timeline_plot.py``: a result's step timeline as a plot.
"""

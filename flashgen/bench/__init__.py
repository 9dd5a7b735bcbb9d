"""The maintained GPU benchmarks, runnable from an installed flashgen: ``flashgen bench decode|prefill|all``
(flashgen/bench/command.py) and the scripts in benchmarks/ run the same code.

- ``timing``: L2-flushed medians of CUDA-event timings, peers round-robin, the device's copy and matmul rates.
- ``decode``, ``prefill``: one benchmark each: its grid, its peers, ``measure(config, ...)`` -> a result dict
  (``rows`` of one measured call each), its markdown table, its plot, and the flashgen/peer ratios by shape.
- ``report``: what `flashgen bench` writes: the ratio table, the JSON and markdown of a run, the ratio plot.

Importing this package imports nothing heavy; the benchmark modules import torch.
"""

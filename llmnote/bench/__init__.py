"""Benchmarks: one harness (``measure``, ``sweep``), one results store
(``load``, ``save``), ceilings measured in the same run, and plots."""

from llmnote.bench.ceilings import copy_bandwidth, matmul_rate, measure_ceilings
from llmnote.bench.glue import glue
from llmnote.bench.harness import Skip, Timing, measure, sweep
from llmnote.bench.plot import plot_bench
from llmnote.bench.results import COLUMNS, available, ceiling, environment, hardware_label, load, save

__all__ = [
    "COLUMNS", "Skip", "Timing", "available", "ceiling", "copy_bandwidth", "environment", "glue",
    "hardware_label", "load", "matmul_rate", "measure", "measure_ceilings", "plot_bench",
    "save", "sweep",
]

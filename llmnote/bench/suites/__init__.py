"""Benchmark definitions, importable so that a notebook on a GPU can run the
same sweep live that ``benchmarks/<name>.py`` recorded. Each module has
``run(quick=False) -> DataFrame``; ``quick`` is the short version a notebook
runs (fewer sizes, no ``torch.compile``)."""

from llmnote.bench.suites import norms, softmax, vector_add

SUITES = {"norms": norms.run, "softmax": softmax.run, "vector_add": vector_add.run}

__all__ = ["SUITES"]

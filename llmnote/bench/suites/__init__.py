"""Benchmark definitions, importable so that a notebook on a GPU can run the
same sweep live that ``benchmarks/<name>.py`` recorded. Each module has
``run(quick=False) -> DataFrame``; ``quick`` is the short version a notebook
runs (fewer sizes, no ``torch.compile``)."""

from llmnote.bench.suites import (
    attention, cuda_elementwise, cuda_reduction, matmul, norms, rope, softmax, vector_add,
)
from llmnote.bench.suites import decode_latency, roofline
from llmnote.bench.suites import quant
from llmnote.bench.suites import gemv
from llmnote.bench.suites import engine
from llmnote.bench.suites import mla, moe, sampling, speculative
from llmnote.bench.suites import gluon

SUITES = {
    "attention": attention.run, "cuda_elementwise": cuda_elementwise.run, "cuda_reduction": cuda_reduction.run,
    "matmul": matmul.run, "norms": norms.run, "rope": rope.run, "softmax": softmax.run, "roofline": roofline.run, "decode_latency": decode_latency.run,
    "engine": engine.run, "quant": quant.run, "gemv": gemv.run, "vector_add": vector_add.run,
    "mla": mla.run, "moe": moe.run, "sampling": sampling.run, "speculative": speculative.run,
    "gluon": gluon.run}

__all__ = ["SUITES"]

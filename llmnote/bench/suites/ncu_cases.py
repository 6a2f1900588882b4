"""The Nsight Compute cases of the profiling suite (:mod:`llmnote.bench.suites.profiling`):
what each case builds and launches, the metrics asked of ``ncu``, and the small driver that
``ncu`` runs: ``python -m llmnote.bench.suites.ncu_cases --driver CASE`` builds the case's
inputs, calls its op ``warmup`` times (compiling and tuning it), then once more between
``cudaProfilerStart`` and ``Stop``, after printing the case's ideal bytes and FLOPs on a line
that :func:`case_info` reads back from ``ncu``'s output.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

TOTAL = 256 * 2**20  # bytes of each (M, N) tensor of the norm cases, as in the norms suite

STALLS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle",
          "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc",
          "no_instruction", "not_selected", "selected", "short_scoreboard", "sleeping",
          "tex_throttle", "wait")
CORE = {  # readable name -> ncu metric; units come from ncu (base units)
    "duration": "gpu__time_duration.sum",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
    "dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_throughput_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
    "registers_per_thread": "launch__registers_per_thread",
    "grid_size": "launch__grid_size",
    "block_size": "launch__block_size",
    "warp_cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
}
METRICS = {
    **CORE,
    "waves_per_sm": "launch__waves_per_multiprocessor",
    "l2_hit_rate_pct": "lts__t_sector_hit_rate.pct",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "local_load_sectors": "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum",
    "local_store_sectors": "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum",
    "ffma": "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum",
    "fadd": "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum",
    "fmul": "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum",
    "tensor_inst": "sm__inst_executed_pipe_tensor.sum",
    **{f"stall_{s}": f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS},
}


@dataclass(frozen=True)
class Case:
    kernel_regex: str
    build: Callable[[], tuple[Callable[[], object], float, float]]  # -> (fn, ideal bytes, FLOPs)
    what: str


def _norm_case(op: str, direction: str, n: int, dtype: torch.dtype):
    def build():
        from llmnote.bench.suites.norms import OPS, _rand, _task

        spec = OPS[op]
        es = torch.empty((), dtype=dtype).element_size()
        m = TOTAL // (n * es)
        dys = [_rand(m, n, dtype) for _ in range(spec.n_outputs)] if direction == "bwd" else []
        task = _task(spec.ours, spec.inputs(m, n, dtype), direction, dys)
        tensors = spec.fwd_tensors if direction == "fwd" else spec.bwd_tensors
        return task, float(tensors * m * n * es), 0.0
    return build


def _copy_case():
    x = torch.randn(TOTAL // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return (lambda: torch.neg(x, out=y)), float(2 * TOTAL), 0.0


def _flash_case(b: int = 4, h: int = 16, n: int = 4096, d: int = 128):
    def build():
        from llmnote.ops import flash_attention

        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        return (lambda: flash_attention(q, k, v)), float(4 * b * h * n * d * 2), float(4 * b * h * n * n * d)
    return build


def _w4_case(k: int, n: int, gluon: bool = False, repacked: bool = False, **switches):
    """W4A16 at batch 1; ``gluon``: the Gluon kernel, on codes repacked once outside the
    profiled call where ``repacked``, with its ``switches`` (``ahead``, ``float_codes``,
    ``overlap``, ``pairs``)."""
    def build():
        from llmnote.bench.suites.quant import GROUP, _w4_weights
        from llmnote.quant import kernels as K

        qw, s, z = _w4_weights(k, n, torch.device("cuda"))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        moved = qw.numel() * 4 + (s.numel() + z.numel()) * 2 + (k + n) * 2
        if not gluon:
            return (lambda: K.w4a16_linear(x, qw, s, z, GROUP)), float(moved), float(2 * k * n)
        from llmnote.ops.gluon import w4a16_linear
        from llmnote.ops.gluon.w4a16 import repack_w4a16

        kw = {**switches, "repacked": repack_w4a16(qw) if repacked else None}
        return (lambda: w4a16_linear(x, qw, s, z, GROUP, **kw)), float(moved), float(2 * k * n)
    return build


def _gluon_attention_case(b: int = 4, h: int = 16, n: int = 4096, d: int = 128):
    def build():
        from llmnote.ops.gluon import attention

        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        return (lambda: attention(q, k, v)), float(4 * b * h * n * d * 2), float(4 * b * h * n * n * d)
    return build


CASES: dict[str, Case] = {
    "copy": Case("elementwise", _copy_case, "torch.neg of 256 MiB bf16 (read + write: a copy's bytes)"),
    "rmsnorm-fwd": Case("_rmsnorm_fwd", _norm_case("rmsnorm", "fwd", 4096, torch.bfloat16),
                        "llmnote rmsnorm forward, N = 4096, 256 MiB bf16"),
    "rmsnorm-bwd": Case("_rmsnorm_bwd", _norm_case("rmsnorm", "bwd", 16384, torch.bfloat16),
                        "llmnote rmsnorm backward, N = 16384, bf16"),
    "layernorm-bwd": Case("_layernorm_bwd", _norm_case("layernorm", "bwd", 16384, torch.bfloat16),
                          "llmnote layernorm backward, N = 16384, bf16"),
    "layernorm-bwd-fp32": Case("_layernorm_bwd", _norm_case("layernorm", "bwd", 16384, torch.float32),
                               "llmnote layernorm backward, N = 16384, fp32"),
    "flash2-fwd": Case("_attn_fwd", _flash_case(), "FlashAttention-2 forward, B 4, H 16, N 4096, D 128, bf16"),
    "w4a16-b1": Case("_w4a16_", _w4_case(4096, 4096), "W4A16 GEMV at batch 1, K = N = 4096, g128"),
    "w4a16-b1-mlp": Case("_w4a16_", _w4_case(4096, 14336), "W4A16 GEMV at batch 1, K 4096, N 14336"),
    "gluon-w4a16-b1": Case("_w4a16_kernel", _w4_case(4096, 14336, gluon=True),
                           "Gluon W4A16 at batch 1, K 4096, N 14336, g128 (Hopper)"),
    "gluon-w4a16-b1-repacked": Case(
        "_w4a16_kernel", _w4_case(4096, 14336, gluon=True, repacked=True),
        "Gluon W4A16 at batch 1 on repacked codes, its defaults (codes decoded in 16-bit pairs), "
        "K 4096, N 14336 (Hopper)"),
    "gluon-w4a16-b1-ahead4": Case(
        "_w4a16_kernel", _w4_case(4096, 14336, gluon=True, repacked=True, ahead=4),
        "Gluon W4A16 at batch 1 on repacked codes, pairs, four K steps in flight, K 4096, "
        "N 14336 (Hopper)"),
    "gluon-w4a16-b1-single": Case(
        "_w4a16_kernel", _w4_case(4096, 14336, gluon=True, repacked=True, pairs=False),
        "Gluon W4A16 at batch 1 on repacked codes, one code at a time, K 4096, N 14336 (Hopper)"),
    "gluon-w4a16-b1-switched": Case(
        "_w4a16_kernel", _w4_case(4096, 14336, gluon=True, repacked=True, ahead=4, float_codes=True,
                                  overlap=True),
        "Gluon W4A16 at batch 1, repacked, ahead=4, float_codes, overlap, K 4096, N 14336 (Hopper)"),
    "gluon-fa3-fwd": Case("_attention_kernel", _gluon_attention_case(),
                          "Gluon FlashAttention-3 forward, B 4, H 16, N 4096, D 128, bf16 (Hopper)"),
}


CASE_LINE = "llmnote-case:"


def case_info(text: str) -> tuple[float, float]:
    """(ideal bytes, FLOPs) that a driver printed into ncu's output."""
    for ln in text.splitlines():
        if ln.startswith(CASE_LINE):
            d = json.loads(ln[len(CASE_LINE):])
            return float(d["ideal_bytes"]), float(d["flops"])
    return float("nan"), 0.0


def driver(case: str, warmup: int = 3) -> None:
    """Run ``case`` once between ``cudaProfilerStart`` and ``Stop``, after ``warmup`` calls."""
    if case not in CASES:
        raise ValueError(f"case must be one of {sorted(CASES)}, got {case!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("the ncu drivers need a CUDA GPU")
    fn, nbytes, flops = CASES[case].build()
    print(f"{CASE_LINE} " + json.dumps({"case": case, "ideal_bytes": nbytes, "flops": flops}))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Run one profiling case once for ncu.")
    ap.add_argument("--driver", required=True, choices=sorted(CASES))
    driver(ap.parse_args().driver)

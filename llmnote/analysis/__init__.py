"""Analysis tools: LLM arithmetic (parameters, FLOPs, memory) for any preset or
HF config; the roofline work extends this package."""

from llmnote.analysis.llm import (
    Flops,
    MemoryReport,
    activation_bytes,
    count_params,
    decode_flops,
    flops_per_token,
    kv_cache_bytes,
    memory_report,
    param_breakdown,
    prefill_flops,
    weight_bytes,
)
from llmnote.analysis.mla import DecodeCost, kv_cache_bytes_per_token, mla_decode_cost
from llmnote.analysis.hardware import Hardware, get_hardware, hardware_table, known_hardware
from llmnote.analysis.latency import (
    LatencyReport, analyze, batch_sweep, decode_step_time, layer_table, memory_plan,
)
from llmnote.analysis.roofline import (
    attainable, kernel_points, measured_ceilings, plot_roofline, roofline_time,
)

__all__ = [
    "Flops", "MemoryReport", "activation_bytes", "count_params", "decode_flops",
    "flops_per_token", "kv_cache_bytes", "memory_report", "param_breakdown", "prefill_flops",
    "weight_bytes", "DecodeCost", "kv_cache_bytes_per_token", "mla_decode_cost",
    "Hardware", "get_hardware", "hardware_table", "known_hardware",
    "LatencyReport", "analyze", "batch_sweep", "decode_step_time", "layer_table", "memory_plan",
    "attainable", "kernel_points", "measured_ceilings", "plot_roofline", "roofline_time",
]

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

__all__ = [
    "Flops", "MemoryReport", "activation_bytes", "count_params", "decode_flops",
    "flops_per_token", "kv_cache_bytes", "memory_report", "param_breakdown", "prefill_flops",
    "weight_bytes",
]

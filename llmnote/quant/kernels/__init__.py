"""Triton kernels for quantized linear layers, each with a plain-PyTorch ``_ref``.

* :mod:`.int8`: per-token int8 quantization of activations and the int8 GEMM with
  the dequantization fused into its epilogue (W8A8, SmoothQuant).
* W4A16 (AWQ, round-to-nearest int4): the format and its references in
  :mod:`.w4a16_ref`; the kernel to read first in :mod:`.w4a16_basic` (one tile
  walking K: unpack, dequantize, dot); the two-codes-per-shift decoding in
  :mod:`.w4_decode`; the production kernels in :mod:`.w4a16_gemv` (batch 1, FMA,
  with the fused prologues) and :mod:`.w4a16_mma` (tensor cores, swap AB), sharing
  :mod:`.w4a16_tiles`; their launch shapes and split-K in :mod:`.w4a16_configs`;
  the op that checks, tunes and launches in :mod:`.w4a16`.

Rounding: the kernels round half away from zero (``floor(|v| + 0.5)``); the
references do the same (``torch.round`` would round half to even).

Interpreter: int8 ``tl.dot`` is exact in Triton's interpreter (checked against an
int32 matmul); bf16 tiles are upcast to fp32 there (``UPCAST``), as in
:mod:`llmnote.ops.matmul`.
"""

from llmnote.quant.kernels.int8 import (
    ACT_DTYPES, _round_half_away, int8_gemm, int8_gemm_ref, quantize_per_token, quantize_per_token_ref,
)
from llmnote.quant.kernels.w4a16 import (
    ADD_RMSNORM, NONE, SWIGLU, TUNING, recorded_keys, set_config, tuning_candidates, w4a16_add_rmsnorm_linear,
    w4a16_linear, w4a16_swiglu_linear,
)
from llmnote.quant.kernels.w4a16_basic import w4a16_linear_basic
from llmnote.quant.kernels.w4a16_configs import (
    GEMV_MAX_M, LARGE_MIN_M, MAX_SPLIT, SPLIT_MAX_M, W4_GEMM_GPU, W4_GEMM_INTERPRETER, W4_GEMM_LARGE_GPU,
    W4_GEMV_GPU, W4_GEMV_INTERPRETER, GemvTile, MmaTile, RowTile, W4Config, default_split_k,
)
from llmnote.quant.kernels.w4a16_ref import (
    HALF_DTYPES, dequantize_int4_weight, w4a16_add_rmsnorm_linear_ref, w4a16_linear_ref, w4a16_swiglu_linear_ref,
)

__all__ = [
    "ACT_DTYPES", "ADD_RMSNORM", "GEMV_MAX_M", "HALF_DTYPES", "LARGE_MIN_M", "MAX_SPLIT", "NONE", "SPLIT_MAX_M",
    "SWIGLU", "TUNING", "W4_GEMM_GPU", "W4_GEMM_INTERPRETER", "W4_GEMM_LARGE_GPU", "W4_GEMV_GPU",
    "W4_GEMV_INTERPRETER", "GemvTile", "MmaTile", "RowTile", "W4Config", "default_split_k",
    "dequantize_int4_weight", "int8_gemm", "int8_gemm_ref", "quantize_per_token", "quantize_per_token_ref",
    "recorded_keys", "set_config", "tuning_candidates", "w4a16_add_rmsnorm_linear",
    "w4a16_add_rmsnorm_linear_ref", "w4a16_linear", "w4a16_linear_basic", "w4a16_linear_ref",
    "w4a16_swiglu_linear", "w4a16_swiglu_linear_ref",
]

"""llmnote's kernels: one op per file, each with ``<op>_ref`` in plain PyTorch
taking the same arguments, the Triton kernel(s) and a validating launcher."""

from llmnote.ops.attention import (
    decode_attention, decode_attention_ref, flash_attention, flash_attention_ref, flash_attention_v1,
    flash_attention_v1_ref, flash_attention_varlen, flash_attention_varlen_ref,
)
from llmnote.ops.fused_gemv import add_rmsnorm_gemv, add_rmsnorm_gemv_ref, swiglu_gemv, swiglu_gemv_ref
from llmnote.ops.gemv import GEMV_MAX_M, gemv, gemv_ref
from llmnote.ops.layernorm import layernorm, layernorm_ref
from llmnote.ops.matmul import matmul, matmul_ref
from llmnote.ops.moe import fused_moe, fused_moe_ref
from llmnote.ops.rope import rope, rope_ref
from llmnote.ops.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from llmnote.ops.softmax import softmax, softmax_ref
from llmnote.ops.swiglu import swiglu, swiglu_ref
from llmnote.ops.vector_add import vector_add, vector_add_ref

__all__ = [
    "decode_attention", "decode_attention_ref", "flash_attention", "flash_attention_ref",
    "flash_attention_v1", "flash_attention_v1_ref", "flash_attention_varlen", "flash_attention_varlen_ref",
    "GEMV_MAX_M", "add_rmsnorm_gemv", "add_rmsnorm_gemv_ref", "gemv", "gemv_ref", "swiglu_gemv",
    "swiglu_gemv_ref",
    "fused_moe", "fused_moe_ref",
    "add_rmsnorm", "add_rmsnorm_ref", "layernorm", "layernorm_ref", "matmul", "matmul_ref", "rmsnorm", "rmsnorm_ref", "rope", "rope_ref",
    "softmax", "softmax_ref", "swiglu", "swiglu_ref", "vector_add", "vector_add_ref",
]

"""Kernels written in Gluon, Triton's lower-level language, for Hopper GPUs.

Gluon makes the kernel state what Triton's compiler otherwise decides: the layout
of every tensor across threads and warps, shared-memory buffers, the TMA copies
and the mbarriers that say when they landed, the asynchronous tensor-core MMAs and
their waits. These ops run only compiled on a GPU (:func:`copy` sm_80+,
:func:`matmul`, :func:`w4a16_linear` and the warp-specialised :func:`attention`
sm_90); everywhere, :mod:`llmnote.ops.gluon.compile` compiles them
for sm_90 without a GPU so their PTX, registers and shared memory can be read. The
Triton ops in :mod:`llmnote.ops` stay the defaults, but for one: on a Hopper GPU
:func:`llmnote.ops.attention.mla_decode` runs the FlashMLA-style kernel of
:mod:`llmnote.ops.gluon.mla` (``mla_decode_gluon``) where its shapes allow.
"""

from llmnote.ops.gluon.attention import (
    attention, attention_fp8, attention_fp8_quantized, attention_ref, compile_attention,
)
from llmnote.ops.gluon.compile import Compiled, compile_kernel, tensordesc
from llmnote.ops.gluon.copy import compile_copy, copy, copy_ref
from llmnote.ops.gluon.matmul import compile_matmul, matmul, matmul_ref
from llmnote.ops.gluon.mla import compile_mla, mla_decode_gluon
from llmnote.ops.gluon.w4a16 import compile_w4a16, repack_w4a16, w4a16_linear, w4a16_linear_ref

__all__ = ["Compiled", "attention", "attention_fp8", "attention_fp8_quantized", "attention_ref",
           "compile_attention", "compile_copy", "compile_kernel", "compile_matmul", "compile_mla",
           "compile_w4a16", "copy", "copy_ref", "matmul", "matmul_ref", "mla_decode_gluon",
           "repack_w4a16", "tensordesc", "w4a16_linear", "w4a16_linear_ref"]

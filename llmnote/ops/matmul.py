"""Matrix multiplication on tensor cores: ``C = act(A @ B + bias)``.

``A`` is ``(M, K)`` (or ``(..., K)``), ``B`` is ``(K, N)``, both fp16 or bf16;
products are accumulated in fp32 and ``C`` is rounded once, to the inputs'
dtype: ``2 M N K`` floating-point operations, at least ``(M K + K N + M N)``
elements moved through device memory.

Tiling. A program computes one ``BLOCK_M x BLOCK_N`` tile of ``C``, walking
``K`` in steps of ``BLOCK_K``: each step loads an A slab and a B slab and
multiplies them on the tensor cores (``tl.dot``: ``mma`` on Ampere, ``wgmma``
on Hopper), for an arithmetic intensity of ``2 BLOCK_M BLOCK_N / ((BLOCK_M +
BLOCK_N) * element_size)`` FLOP per byte. Programs map to tiles in groups of
``GROUP_M`` tile-rows (``_tile_coords``, Triton's tutorial's "grouped" order),
so a wave of programs shares slabs through L2.

Kernels. ``_matmul_kernel`` is the textbook kernel: pointers, one tile per
program, any strides. ``_matmul_persistent_kernel`` launches one program per
SM and loops over tiles. ``_matmul_tma_kernel`` (Hopper, sm_90+) loads and
stores through TMA tensor descriptors, one tile per program or persistent.
All three are autotuned over the configs of :mod:`llmnote.ops.matmul_configs`
and share the fused epilogue (bias, ReLU / tanh-GELU / SiLU, in fp32); later
calls of a problem size launch the tuned config directly (``TUNING``).
Interpreter: bf16 tiles are upcast to fp32 (``UPCAST``; its bf16 dot is wrong).

Sources: Tillet et al. 2019 (Triton); Triton's tutorials 03 (matrix
multiplication) and 09 (persistent matmul); NVIDIA's CUTLASS documentation
(efficient GEMM: tiling, pipelining, swizzling); the H100 architecture
whitepaper (wgmma, TMA).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._tuning import TuneCache
from llmnote.ops._validate import check_same, check_tensor
from llmnote.ops.matmul_configs import (  # noqa: F401  (importable from here too)
    CONFIGS, GPU_CONFIGS, INTERPRETER_CONFIGS, _config, _num_sms, _set_block_shapes, _tile_coords, config_name,
    config_smem, program_tiles, prune_configs, select_configs,
)

try:  # host-side TMA descriptors: Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer kernels only
    TensorDescriptor = None

MATMUL_DTYPES = (torch.float16, torch.bfloat16)
ACTIVATIONS = ("relu", "gelu_tanh", "silu")


def matmul_ref(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """``act(a @ b + bias)`` in plain PyTorch, in the inputs' dtype.

    Called on fp32 inputs it is the fp32 reference the kernels are checked against.
    """
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    out = a @ b
    if bias is not None:
        out = out + bias
    if activation == "relu":
        out = torch.relu(out)
    elif activation == "gelu_tanh":
        out = F.gelu(out, approximate="tanh")
    elif activation == "silu":
        out = F.silu(out)
    return out


# Keys: N, K and M rounded up to a power of two, so that decode-like calls whose
# M changes every step (1, 2, 3, ... sequences) reuse a few tuned entries; plus the
# layout of B, and for the TMA kernel the variant (persistent or not).
_autotune = functools.partial(
    triton.autotune, configs=CONFIGS, prune_configs_by={"early_config_prune": prune_configs},
)
_POINTER_KEY = ["M_BUCKET", "N", "K", "stride_bn"]
_TMA_KEY = ["M_BUCKET", "N", "K", "PERSISTENT", "B_TRANS"]

# --------------------------------------------------------------------------------------------
# Shared pieces of the kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_offsets(tile_id, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``tile_id`` of C in grouped order: its rows and columns (``offs_m``, ``offs_n``)
    and the rows of A and columns of B it reads (``rows``, ``cols``). Rows and columns past
    the edge read row or column 0 instead of being masked: the loads stay unmasked along M
    and N, and the store drops those results."""
    pid_m, pid_n = _tile_coords(tile_id, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.max_contiguous(tl.multiple_of(tl.where(offs_m < M, offs_m, 0), BLOCK_M), BLOCK_M)
    cols = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < N, offs_n, 0), BLOCK_N), BLOCK_N)
    return offs_m, offs_n, rows, cols


@triton.jit
def _store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn):
    """Round the fp32 tile to C's dtype and store the part inside C (write BM x BN once)."""
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """Bias and activation on the fp32 accumulator (BLOCK_M, BLOCK_N), before rounding."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        inner = tl.minimum(tl.maximum(inner, -10.0), 10.0)  # tanh(10) is 1.0 in fp32; no exp overflow
        acc = 0.5 * acc * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))  # tanh(y) = 2 sigmoid(2y) - 1
    elif ACTIVATION == "silu":
        acc = acc * tl.sigmoid(acc)
    return acc


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@_autotune(key=_POINTER_KEY)
@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program computes one (BLOCK_M, BLOCK_N) tile of C = A @ B."""
    # rows and columns of C (rows of A, columns of B) of this tile; past the edge, 0
    offs_m, offs_n, rows, cols = _tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BM, BK)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn  # (BK, BN)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K  # the last step masks the K tail with zeros
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)  # read BM x BK
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)  # read BK x BN
        if UPCAST:  # interpreter only: its bf16 dot is wrong
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)  # 2 BM BN BK flops on the tensor cores, fp32 accumulator
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    acc = _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
    _store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)  # write BM x BN once


@_autotune(key=_POINTER_KEY)
@triton.jit
def _matmul_persistent_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr,
):
    """NUM_SMS programs; program p computes tiles p, p + NUM_SMS, p + 2 NUM_SMS, ..."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    offs_k = tl.arange(0, BLOCK_K)
    # flatten=True: the compiler pipelines the tile loop and the K loop as one,
    # so the next tile's first loads are issued while this tile finishes.
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        offs_m, offs_n, rows, cols = _tile_offsets(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            kk = k * BLOCK_K + offs_k
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + kk[None, :] * stride_ak
            b_ptrs = b_ptr + kk[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
            a = tl.load(a_ptrs, mask=kk[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=kk[:, None] < K, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        acc = _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
        _store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)


@_autotune(key=_TMA_KEY)
@triton.jit
def _matmul_tma_kernel(
    a_desc, b_desc, c_desc, bias_ptr, M, N, K, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, PERSISTENT: tl.constexpr, B_TRANS: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Tiles loaded and stored by the TMA copy engine through tensor descriptors.

    PERSISTENT: NUM_SMS programs loop over the tiles; otherwise one program per
    tile (the loop below then runs once). B_TRANS: b_desc describes B^T, an
    (N, K) row-major tensor such as an nn.Linear weight.
    """
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if PERSISTENT:
        step = NUM_SMS
    else:
        step = num_tiles
    for tile_id in tl.range(tl.program_id(0), num_tiles, step, flatten=PERSISTENT):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            off_k = k * BLOCK_K
            a = a_desc.load([off_m, off_k])  # (BM, BK); zeros past M and K
            if B_TRANS:
                b = b_desc.load([off_n, off_k]).T  # (BN, BK) tile of B^T, seen as (BK, BN)
            else:
                b = b_desc.load([off_k, off_n])  # (BK, BN)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))  # clipped to (M, N) by the engine


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


@functools.cache
def _tma_available() -> bool:
    """TMA descriptors: Triton has them and the GPU is Hopper or newer (or the interpreter)."""
    if TensorDescriptor is None:
        return False
    if device.interpreting():
        return True
    cap = device.capability()
    return device.on_gpu() and cap is not None and cap >= (9, 0)


def _tma_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """Whether TMA can describe 2-D ``a``, ``b`` and the ``(M, N)`` output; ``(True, "trans")``
    when ``b`` is the transpose of a row-major ``(N, K)`` tensor; ``(False, why)`` otherwise.

    A descriptor needs unit stride in the last dimension, 16-byte aligned other
    strides and a 16-byte aligned base address.
    """
    def ok(t: torch.Tensor) -> bool:
        es = t.element_size()
        return (t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0
                and min(t.shape) > 0)

    if not ok(a):
        return False, f"a (shape {tuple(a.shape)}, strides {a.stride()})"
    if (b.shape[1] * b.element_size()) % 16:
        return False, f"the output's rows (N = {b.shape[1]} elements is not a multiple of 16 bytes)"
    if ok(b):
        return True, ""  # B row-major
    if ok(b.t()):
        return True, "trans"
    return False, f"b (shape {tuple(b.shape)}, strides {b.stride()})"


def _validate(a, b, bias, activation) -> None:
    check_tensor("a", a, dtypes=MATMUL_DTYPES, min_ndim=2)
    check_tensor("b", b, dtypes=MATMUL_DTYPES, ndim=2)
    check_same(("a", "b"), a, b, what=("dtype", "device"))
    if a.shape[-1] != b.shape[0]:
        raise ValueError(
            f"inner dimensions must match: a is (..., K) with K = {a.shape[-1]} (shape "
            f"{tuple(a.shape)}), b is (K, N) with K = {b.shape[0]} (shape {tuple(b.shape)})"
        )
    if bias is not None:
        check_tensor("bias", bias, dtypes=MATMUL_DTYPES, ndim=1)
        check_same(("a", "bias"), a, bias, what=("dtype", "device"))
        if bias.shape[0] != b.shape[1]:
            raise ValueError(f"bias must have shape (N,) = ({b.shape[1]},), got {tuple(bias.shape)}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")


def _plan(a2: torch.Tensor, b: torch.Tensor, persistent: bool, tma: bool | None):
    """(kernel, use_tma, b_trans) for a launch; ``tma=None`` uses TMA where it can."""
    if tma is not None and not isinstance(tma, bool):
        raise TypeError(f"tma must be None, True or False, got {tma!r}")
    possible, why = _tma_layout(a2, b)
    if tma and not _tma_available():
        raise ValueError("tma=True needs Triton's TensorDescriptor and a GPU of compute capability "
                         f">= 9.0 (Hopper); this machine: {device.describe()}")
    if tma and not possible:
        raise ValueError(f"tma=True, but TMA cannot describe {why}: it needs stride 1 in the last "
                         "dimension, 16-byte aligned row strides and base address (use tma=None "
                         "to fall back to the pointer kernel)")
    use_tma = bool(possible) and (tma if tma is not None else (_tma_available() and not device.interpreting()))
    if use_tma:
        return _matmul_tma_kernel, True, why == "trans"
    return (_matmul_persistent_kernel if persistent else _matmul_kernel), False, False


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    persistent: bool = False,
    tma: bool | None = None,
) -> torch.Tensor:
    """``act(a @ b + bias)`` on tensor cores, fp32 accumulation, result in the inputs' dtype.

    ``a``: ``(..., K)``; ``b``: ``(K, N)``; ``bias``: ``(N,)`` or None; ``activation``:
    None, ``"relu"``, ``"gelu_tanh"`` or ``"silu"``. Any strides (a transposed weight
    ``w.t()`` too). ``persistent``: one program per SM looping over tiles. ``tma``:
    None uses TMA descriptors on Hopper GPUs when the layout allows, True
    requires them, False uses the pointer kernels. Returns a new contiguous
    tensor of shape ``(..., N)``.
    """
    _validate(a, b, bias, activation)
    if _use_reference(a.dtype):
        return matmul_ref(a, b, bias, activation)
    K, N = b.shape
    lead = a.shape[:-1]
    M = math.prod(lead)
    a2 = a.reshape(M, K)  # a view for 2-D a and for contiguous leading dims
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M > 0 and N > 0:
        _launch(a2, b, c, bias, activation, persistent, tma)
    return c.reshape(*lead, N)


@functools.cache
def _use_reference(dtype: torch.dtype) -> bool:
    """bf16 tensor cores need sm_80, fp16 ones sm_75 (decided once per dtype: it is per call cost)."""
    return device.use_reference("matmul", min_capability=(8, 0) if dtype == torch.bfloat16 else (7, 5))


# (kernel, persistent, B row-major, M bucket, N, K, dtype) -> the config the autotuner chose. Later
# calls with the same key launch the kernel directly: the autotuner's per-call dispatch
# costs tens of microseconds of Python, as much as a small product takes on the GPU.
TUNING = TuneCache("matmul")


def _tuned_key(kernel, persistent: bool, b: torch.Tensor, m: int, a_dtype) -> tuple:
    k, n = b.shape
    return (kernel, persistent, b.stride(1) == 1, triton.next_power_of_2(m), n, k, a_dtype)


def _launch(a2, b, c, bias, activation, persistent, tma, config: triton.Config | None = None):
    """Run the kernel ``_plan`` picks: through the autotuner the first time a key is seen,
    directly with its tuned config afterwards, or with ``config`` when one is given."""
    kernel, use_tma, b_trans = _plan(a2, b, persistent, tma)
    (M, K), N = a2.shape, b.shape[1]
    meta = dict(HAS_BIAS=bias is not None, ACTIVATION=activation or "none",
                UPCAST=device.interpreting() and a2.dtype == torch.bfloat16)
    key = _tuned_key(kernel, persistent, b, M, a2.dtype)
    tuning = config is None and TUNING.get(key) is None
    if not tuning:  # a known config: skip the autotuner
        config = config or TUNING.get(key)
        kernel = kernel.fn
        meta |= config.all_kwargs()
    bias_arg = bias if bias is not None else c  # never read when HAS_BIAS is False
    m_bucket = triton.next_power_of_2(M)
    num_sms = _num_sms(a2.device)

    def grid(m):
        tiles = triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"])
        return (min(num_sms, tiles) if persistent else tiles,)

    if use_tma:
        # Block shapes are placeholders while tuning: each config's pre-hook sets them.
        a_desc = TensorDescriptor(a2, list(a2.shape), list(a2.stride()), [1, 1])
        bt = b.t() if b_trans else b
        b_desc = TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [1, 1])
        c_desc = TensorDescriptor(c, list(c.shape), list(c.stride()), [1, 1])
        if not tuning:
            _set_block_shapes(dict(a_desc=a_desc, b_desc=b_desc, c_desc=c_desc, B_TRANS=b_trans, **meta))
        kernel[grid](a_desc, b_desc, c_desc, bias_arg, M, N, K, m_bucket,
                     NUM_SMS=num_sms, PERSISTENT=persistent, B_TRANS=b_trans, **meta)
    else:
        if persistent:
            meta["NUM_SMS"] = num_sms
        kernel[grid](a2, b, c, bias_arg, M, N, K, m_bucket, a2.stride(0), a2.stride(1), b.stride(0),
                     b.stride(1), c.stride(0), c.stride(1), **meta)
    if tuning:
        TUNING.set(key, kernel.best_config)


def matmul_with_config(a: torch.Tensor, b: torch.Tensor, config: triton.Config, *,
                       persistent: bool = False, tma: bool | None = None) -> torch.Tensor:
    """``a @ b`` (2-D) with one given config, no autotuning: for experiments such as
    timing ``GROUP_M = 1`` against the tuned order."""
    _validate(a, b, None, None)
    if a.ndim != 2:
        raise ValueError(f"a must be 2-D here, got shape {tuple(a.shape)}")
    c = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    if c.numel():
        _launch(a, b, c, None, None, persistent, tma, config)
    return c


def tuned(a: torch.Tensor, b: torch.Tensor, *, persistent: bool = False,
          tma: bool | None = None) -> triton.Config | None:
    """The config the autotuner chose for ``matmul(a, b, ...)`` on these shapes (None before
    the first such call)."""
    a2 = a.reshape(math.prod(a.shape[:-1]), b.shape[0])
    kernel = _plan(a2, b, persistent, tma)[0]
    return TUNING.get(_tuned_key(kernel, persistent, b, a2.shape[0], a.dtype))


def tuned_config(a: torch.Tensor, b: torch.Tensor, *, persistent: bool = False,
                 tma: bool | None = None) -> str:
    """:func:`tuned` as text, like ``"TMA 128x256x64 G8 w8 s3"``; empty before the first call."""
    cfg = tuned(a, b, persistent=persistent, tma=tma)
    if cfg is None:
        return ""
    use_tma = _plan(a.reshape(math.prod(a.shape[:-1]), b.shape[0]), b, persistent, tma)[1]
    return ("TMA " if use_tma else "") + ("persistent " if persistent else "") + config_name(cfg)

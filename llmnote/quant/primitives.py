"""Quantization primitives: scales, zero points, granularity, packing.

A *b*-bit integer grid has ``2**b`` levels. Quantizing a real tensor ``x`` maps
it onto that grid with a scale ``s`` (real units per integer step) and, for the
asymmetric scheme, a zero point ``z`` (the integer that stands for 0.0)::

    symmetric:   q = clamp(round(x / s), -qmax, qmax),   s = max|x| / qmax,          x^ = q s
    asymmetric:  q = clamp(round(x / s) + z, 0, 2**b-1), s = (max x - min x) / (2**b - 1),
                 z = round(-min x / s),                                               x^ = (q - z) s

(``qmax = 2**(b-1) - 1``: 127 for int8, 7 for int4; the symmetric grid drops
-128 so that it is symmetric around zero, as Jacob et al. 2018 and most LLM
kernels do). The *granularity* says which elements share one scale:

* ``"tensor"``: one scale for the whole tensor;
* ``"channel"``: one per row of a weight ``(N, K)`` (one per output channel);
* ``"token"``: one per row of an activation ``(..., K)`` (one per token) — the
  same computation as "channel", named for what the rows are;
* ``"group"``: one per ``group_size`` consecutive elements of a row (the last
  dim must be a multiple of ``group_size``).

Packing int4. Two 4-bit values fit in a byte and eight in an int32.
:func:`pack_int4` stores **eight unsigned 4-bit values (0..15) per int32 along
the first dimension**: a ``(K, N)`` tensor becomes ``(K // 8, N)`` with
``packed[j, n] = sum_i q[8 j + i, n] << (4 i)`` (value ``8 j + i`` in bits
``4 i .. 4 i + 3``). That is the layout the W4A16 kernel reads: along ``N``
consecutive words are consecutive columns (coalesced loads), and the eight
values of a word are eight consecutive ``k``. Signed int4 is stored with an
offset (``q + 8``) or, for the asymmetric scheme, as is (0..15).

fp8. ``torch.float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, max 448, no
infinities) and ``torch.float8_e5m2`` (max 57344) are floating-point formats
(Micikevicius et al. 2022): :func:`quantize_fp8` scales ``x`` so that its max
lands on the format's max and lets the cast round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmnote.ops._validate import _dtype_names

GRANULARITIES = ("tensor", "channel", "token", "group")
BITS = (2, 3, 4, 8)
FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
                   if d is not None)
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class QTensor:
    """A quantized tensor: integer codes, scale(s), zero point(s) and how they are laid out.

    ``q`` has the original shape (int8 storage for every bit width up to 8);
    ``scale`` and ``zero`` broadcast against ``q`` after :meth:`expand`
    (for "group", ``scale`` has shape ``(..., K // group_size)``).
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    granularity: str
    group_size: int | None
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


def check_tensor(name: str, t: object, *, dtypes=None, ndim: int | None = None,
                 min_ndim: int | None = None) -> torch.Tensor:
    """Type, dtype and rank checks with :mod:`llmnote.ops._validate`'s wording, on any device.

    Quantization math (and the kernels' references) runs wherever the tensor
    lives; only the Triton entry points require the kernel backend's device.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got "
                        f"{str(t.dtype).removeprefix('torch.')}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {t.ndim}-D with shape {tuple(t.shape)}")
    if min_ndim is not None and t.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    return t


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """The integer range ``(qmin, qmax)``: ``(-(2**(b-1) - 1), 2**(b-1) - 1)`` or ``(0, 2**b - 1)``."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if symmetric:
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def _grouped(x: torch.Tensor, granularity: str, group_size: int | None) -> torch.Tensor:
    """``x`` reshaped so that each set of elements sharing a scale is one row of the last dim."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        return x.reshape(1, -1)
    if granularity in ("channel", "token"):
        if x.ndim < 1:
            raise ValueError(f"granularity {granularity!r} needs at least 1-D x, got a 0-D tensor")
        return x.reshape(*x.shape[:-1], 1, x.shape[-1])
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"granularity 'group' needs a positive int group_size, got {group_size!r}")
    k = x.shape[-1]
    if k % group_size:
        raise ValueError(f"the last dimension of x ({k}, shape {tuple(x.shape)}) must be a multiple "
                         f"of group_size={group_size}")
    return x.reshape(*x.shape[:-1], k // group_size, group_size)


def quantize(x: torch.Tensor, bits: int = 8, *, symmetric: bool = True, granularity: str = "tensor",
             group_size: int | None = None, eps: float = 1e-8) -> QTensor:
    """Round-to-nearest quantization of a float tensor (see the module docstring).

    Scales are computed in fp32 from the data (min/max calibration); an all-zero
    group gets scale ``eps`` instead of 0. Returns a :class:`QTensor`.
    """
    check_tensor("x", x, dtypes=_FLOAT)
    qmin, qmax = qrange(bits, symmetric)
    g = _grouped(x.float(), granularity, group_size)
    if g.numel() == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")
    if symmetric:
        scale = (g.abs().amax(-1) / qmax).clamp_min(eps)  # (..., groups)
        q = torch.clamp(torch.round(g / scale[..., None]), qmin, qmax)
        zero = None
    else:
        lo = g.amin(-1).clamp_max(0.0)  # the grid must contain 0.0 exactly
        hi = g.amax(-1).clamp_min(0.0)
        scale = ((hi - lo) / (qmax - qmin)).clamp_min(eps)
        zero = torch.clamp(torch.round(-lo / scale), qmin, qmax)
        q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], qmin, qmax)
    shape_s = scale.shape if granularity == "group" else (
        () if granularity == "tensor" else x.shape[:-1])
    return QTensor(q.reshape(x.shape).to(torch.int8 if bits <= 7 or symmetric else torch.uint8),
                   scale.reshape(shape_s), None if zero is None else zero.reshape(shape_s),
                   bits, granularity, group_size, x.dtype)


def dequantize(qt: QTensor) -> torch.Tensor:
    """``(q - z) * s`` in fp32, cast back to the original dtype."""
    g = _grouped(qt.q.float(), qt.granularity, qt.group_size)
    s = qt.scale.reshape(g.shape[:-1])[..., None]
    z = 0.0 if qt.zero is None else qt.zero.reshape(g.shape[:-1])[..., None]
    return ((g - z) * s).reshape(qt.q.shape).to(qt.dtype)


def fake_quantize(x: torch.Tensor, bits: int = 8, **kwargs) -> torch.Tensor:
    """``dequantize(quantize(x, ...))``: x on the quantization grid, same dtype."""
    return dequantize(quantize(x, bits, **kwargs))


def quantization_error(x: torch.Tensor, bits: int = 8, **kwargs) -> dict[str, float]:
    """Round-trip errors: max abs, RMS, and SQNR in dB (``10 log10(sum x^2 / sum err^2)``)."""
    err = (fake_quantize(x, bits, **kwargs).float() - x.float())
    sig = float(x.float().pow(2).sum())
    noise = float(err.pow(2).sum())
    sqnr = float("inf") if noise == 0 else 10 * torch.log10(torch.tensor(sig / noise)).item()
    return {"max_abs": float(err.abs().max()), "rms": float(err.pow(2).mean().sqrt()), "sqnr_db": sqnr}


# ---------------------------------------------------------------- int4 packing
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit codes (0..15), shape ``(K, ...)`` with K % 8 == 0, into int32 ``(K // 8, ...)``.

    Value ``8 j + i`` goes to bits ``4 i .. 4 i + 3`` of word ``j``.
    """
    check_tensor("q", q, dtypes=(torch.int8, torch.uint8, torch.int32, torch.int64))
    if q.ndim < 1 or q.shape[0] % 8:
        raise ValueError(f"q's first dimension must be a multiple of 8 to pack eight int4 per int32, "
                         f"got shape {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"q must hold unsigned 4-bit codes in [0, 15], got values in "
                         f"[{int(q.min())}, {int(q.max())}]")
    q = q.to(torch.int64).reshape(q.shape[0] // 8, 8, *q.shape[1:])
    shifts = (4 * torch.arange(8, device=q.device)).reshape(1, 8, *([1] * (q.ndim - 2)))
    word = (q << shifts).sum(1)  # < 2**32: fits int64; reinterpret as int32 below
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 ``(K // 8, ...)`` -> uint8 codes ``(K, ...)``."""
    check_tensor("packed", packed, dtypes=(torch.int32,))
    shifts = (4 * torch.arange(8, device=packed.device)).reshape(1, 8, *([1] * (packed.ndim - 1)))
    q = (packed.to(torch.int64)[:, None] >> shifts) & 0xF
    return q.reshape(packed.shape[0] * 8, *packed.shape[1:]).to(torch.uint8)


def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """The other common layout: two unsigned 4-bit codes per uint8 along the last dim
    (even index in the low nibble). Shape ``(..., K)`` -> ``(..., K // 2)``."""
    check_tensor("q", q, dtypes=(torch.int8, torch.uint8, torch.int32, torch.int64))
    if q.shape[-1] % 2:
        raise ValueError(f"q's last dimension must be even, got shape {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4_pairs(packed: torch.Tensor) -> torch.Tensor:
    check_tensor("packed", packed, dtypes=(torch.uint8,))
    return torch.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


# ---------------------------------------------------------------- fp8
def quantize_fp8(x: torch.Tensor, dtype: torch.dtype | None = None,
                 granularity: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled cast to fp8: returns ``(x8, scale)`` with ``x ~ x8.float() * scale``.

    ``dtype``: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``;
    granularity "tensor" or "token"/"channel" (one scale per row).
    """
    check_tensor("x", x, dtypes=_FLOAT)
    if not FP8_DTYPES:
        raise RuntimeError("this torch has no float8 dtypes")
    dtype = dtype or FP8_DTYPES[0]
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if granularity not in ("tensor", "token", "channel"):
        raise ValueError(f"fp8 granularity must be 'tensor', 'token' or 'channel', got {granularity!r}")
    fmax = torch.finfo(dtype).max
    xf = x.float()
    amax = xf.abs().amax() if granularity == "tensor" else xf.abs().amax(-1, keepdim=True)
    scale = (amax / fmax).clamp_min(1e-12)
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (x8.float() * scale).to(dtype)


def representable_values(fmt: str) -> torch.Tensor:
    """Every finite value of a format, sorted: ``"int8"``, ``"int4"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``."""
    if fmt == "int8":
        return torch.arange(-128, 128, dtype=torch.float32)
    if fmt == "int4":
        return torch.arange(-8, 8, dtype=torch.float32)
    dt = getattr(torch, fmt, None)
    if dt not in FP8_DTYPES:
        raise ValueError(f"fmt must be 'int8', 'int4' or an fp8 dtype name this torch has, got {fmt!r}")
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
    return torch.unique(vals[torch.isfinite(vals)])

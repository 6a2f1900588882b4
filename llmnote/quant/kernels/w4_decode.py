"""Decoding 4-bit codes to fp32 without an int-to-float conversion.

A packed int32 word holds eight codes along K, code j in bits 4j .. 4j + 3.
Shift, mask and convert costs three instructions per weight, the conversion on
a slow pipe. The float format does it cheaper. An fp32 number whose exponent
bits are those of 1.0 (``0x3F800000``) and whose mantissa is m (23 bits) is
``1 + m / 2**23``: a code q in mantissa bits 19-22 makes it ``1 + q / 16``, in
bits 15-18 ``1 + q / 256``, exactly (the other mantissa bits are zero).

Codes 2p and 2p + 1 fill bits 8p .. 8p + 7, so ONE shift (left by 15 - 8p, or
right by 8p - 15) moves both to bits 15-22. Masking bits 15-18 (``NIBBLE =
0x78000``) keeps code 2p, masking bits 19-22 (``NIBBLE << 4``) code 2p + 1, and
OR-ing in the exponent of 1.0 gives::

    f_even = 1 + q_even / 256,        f_odd = 1 + q_odd / 16

(one shift per two codes, one AND and one OR per code). With the group's scale
s and zero point z, dequantizing is one multiply-add per weight::

    (q - z) s = 256 s f_even - (256 + z) s = 16 s f_odd - (16 + z) s

The batch-1 kernels sum ``x_j f_j`` over a word's codes instead: with the
exponent of 16.0 (``0x41800000``) on even codes, ``f_even = 16 + q / 16`` has
the step of ``f_odd``, and :func:`word_sum` removes the offsets once per word.
``NIBBLE`` reaches the kernels as an argument: in a register for the whole
loop, where an immediate would be re-created before each use.
"""

import triton
import triton.language as tl

NIBBLE = 0x78000  # bits 15-18


@triton.jit
def decode_pair(words, P: tl.constexpr, mask_lo, mask_hi, EVEN_SIXTEEN: tl.constexpr):
    """Codes 2P and 2P + 1 of every word as fp32 ``(f_even, f_odd)``: ``f_even = 1 + q / 256``
    (``16 + q / 16`` when EVEN_SIXTEEN), ``f_odd = 1 + q / 16``."""
    if 8 * P <= 15:
        sh = words << (15 - 8 * P)
    else:
        sh = words >> (8 * P - 15)
    if EVEN_SIXTEEN:
        f_even = ((sh & mask_lo) | 0x41800000).to(tl.float32, bitcast=True)
    else:
        f_even = ((sh & mask_lo) | 0x3F800000).to(tl.float32, bitcast=True)
    f_odd = ((sh & mask_hi) | 0x3F800000).to(tl.float32, bitcast=True)
    return f_even, f_odd


@triton.jit
def dequant_pair(words, P: tl.constexpr, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi):
    """Codes 2P and 2P + 1 dequantized: ``f w - c`` with ``w_lo = 256 s``, ``c_lo = (256 + z) s``,
    ``w_hi = 16 s``, ``c_hi = (16 + z) s`` (computed once per step by the caller)."""
    f_even, f_odd = decode_pair(words, P, mask_lo, mask_hi, False)
    return f_even * w_lo - c_lo, f_odd * w_hi - c_hi


@triton.jit
def word_sum(t, x_even, x_odd, s, z):
    """``sum_j x_j (q_j - z) s`` of a word from ``t = sum_j x_j f_j`` (even codes decoded with
    EVEN_SIXTEEN) and the sums of x over its even and odd codes (broadcast against ``t``):
    ``16 s (t - 16 x_even - x_odd) - z s (x_even + x_odd)``."""
    return (t - (16.0 * x_even + x_odd)) * (s * 16.0) - (x_even + x_odd) * (z * s)

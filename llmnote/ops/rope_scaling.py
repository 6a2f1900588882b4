"""RoPE's frequencies, and the context-extension schemes real checkpoints use.

RoPE (Su et al., 2021, "RoFormer") rotates pair ``i`` of every query and key head vector
(``i = 0 .. d/2 - 1`` for head dimension ``d``) by the angle ``position * inv_freq[i]``, with
``inv_freq[i] = theta ** (-2 i / d)`` (``theta = 10000`` in the paper), so pair 0 turns once every
2*pi tokens and the last pair takes about ``2*pi*theta`` tokens per turn (its *wavelength*). A
model trained on ``L0 = original_max_position_embeddings`` tokens has never seen the slow pairs
turn far; the schemes below change ``inv_freq`` so that longer contexts stay in the range it was
trained on:

* ``default``: ``inv_freq`` as above.
* ``linear``: position interpolation (Chen et al., 2023): every ``inv_freq`` divided by ``factor``,
  i.e. positions squeezed ``factor`` times.
* ``dynamic``: dynamic NTK-aware scaling (bloc97 and emozilla, 2023, as in Hugging Face
  transformers): no change up to ``L0`` tokens; past it, with ``L`` the current length, the base
  grows to ``theta * (factor*L/L0 - (factor-1)) ** (d/(d-2))``. ``L`` is ``max(position) + 1`` of
  the call, so ``inv_freq`` depends on it.
* ``llama3``: Llama 3.1's per-frequency rule: pairs whose wavelength is shorter than
  ``L0/high_freq_factor`` are kept, longer than ``L0/low_freq_factor`` are divided by ``factor``,
  and in between blended linearly in ``L0/wavelength``.
* ``yarn``: YaRN (Peng et al., 2023), "NTK-by-parts": a pair making more than ``beta_fast`` turns
  in ``L0`` tokens is kept, fewer than ``beta_slow`` is divided by ``factor``, with a linear ramp
  over the pair index in between; and cos and sin are multiplied by ``attention_factor`` (default
  ``0.1*ln(factor) + 1``), which sharpens the attention softmax.

These follow the definitions Hugging Face transformers uses for the same config fields
(``rope_scaling`` / ``rope_parameters`` in ``config.json``), so a checkpoint's numbers come out the
same; the tests compare against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# Keys of an HF rope dict that each type reads; anything else is an error.
_HF_KEYS: dict[str, set[str]] = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"},
}
_HF_IGNORED = {"rope_type", "type", "rope_theta"}  # read elsewhere


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling scheme (see the module docstring); hashable, so caches can key on it.

    ``original_max_position_embeddings`` is ``L0``: the training context for
    ``llama3`` and ``yarn``, and the length past which ``dynamic`` starts to scale.
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: from factor (and mscale)
    mscale: float | None = None  # yarn (DeepSeek-style attention factor)
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole pairs

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE scaling type {self.rope_type!r}; supported: "
                f"{', '.join(ROPE_TYPES)}"
            )
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.rope_type in ("dynamic", "llama3", "yarn"):
            l0 = self.original_max_position_embeddings
            if not (isinstance(l0, int) and l0 > 0):
                raise ValueError(
                    f"RoPE scaling {self.rope_type!r} needs original_max_position_embeddings "
                    f"(a positive int), got {l0!r}"
                )
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int) -> RopeScaling:
        """From an HF ``rope_scaling`` (or v5 ``rope_parameters``) dict.

        Raises ``ValueError`` naming an unknown type or a key this type does not read.
        """
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r} in config.json; supported: "
                f"{', '.join(ROPE_TYPES)}"
            )
        prf = rope.get("partial_rotary_factor", 1.0)
        if prf not in (1, 1.0, None):
            raise ValueError(f"unsupported partial_rotary_factor {prf!r} in config.json (only 1.0)")
        unknown = set(rope) - _HF_KEYS[rope_type] - _HF_IGNORED - {"partial_rotary_factor"}
        if unknown:
            raise ValueError(
                f"unsupported rope_scaling field(s) {sorted(unknown)} for rope type {rope_type!r}"
            )
        kw = {k: rope[k] for k in _HF_KEYS[rope_type] if rope.get(k) is not None}
        if rope_type == "dynamic":  # HF scales past max_position_embeddings itself
            kw["original_max_position_embeddings"] = max_position_embeddings
        elif rope_type in ("llama3", "yarn"):
            kw.setdefault("original_max_position_embeddings", max_position_embeddings)
        if rope_type == "yarn" and "factor" not in kw:
            kw["factor"] = max_position_embeddings / kw["original_max_position_embeddings"]
        names = {f.name for f in fields(cls)}
        return cls(rope_type=rope_type, **{k: v for k, v in kw.items() if k in names})


def as_rope_scaling(scaling: RopeScaling | dict | None) -> RopeScaling | None:
    """``None`` or type ``"default"`` give ``None`` (plain RoPE); a dict holds
    :class:`RopeScaling`'s fields (``"type"`` is read as ``"rope_type"``)."""
    if scaling is None or isinstance(scaling, RopeScaling):
        return None if scaling is None or scaling.rope_type == "default" else scaling
    if isinstance(scaling, dict):
        kw = dict(scaling)
        if "type" in kw:
            kw.setdefault("rope_type", kw.pop("type"))
        unknown = set(kw) - {f.name for f in fields(RopeScaling)}
        if unknown:
            raise ValueError(f"unknown RoPE scaling field(s) {sorted(unknown)}")
        return as_rope_scaling(RopeScaling(**kw))
    raise TypeError(f"scaling must be a RopeScaling, a dict or None, got {type(scaling).__name__}")


def attention_factor(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by: 1 except for YaRN."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        f = scaling.factor
        return mscale(f, scaling.mscale) / mscale(f, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def rope_inv_freq(
    head_dim: int,
    theta: float = 10000.0,
    scaling: RopeScaling | dict | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """``inv_freq``, shape ``(head_dim // 2,)``, fp32 on the CPU (math in fp64).

    ``seq_len`` (the current length, ``max(position) + 1``) is read only by ``dynamic``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if not theta > 0:
        raise ValueError(f"theta must be > 0, got {theta}")
    s = as_rope_scaling(scaling)
    d = head_dim
    pair = torch.arange(0, d // 2, dtype=torch.float64)  # i = 0 .. d/2 - 1
    if s is not None and s.rope_type == "dynamic":
        l0 = s.original_max_position_embeddings
        length = max(seq_len or 0, l0)
        theta = theta * ((s.factor * length / l0) - (s.factor - 1)) ** (d / (d - 2))
    inv_freq = theta ** (-2 * pair / d)
    if s is None or s.rope_type == "dynamic":
        return inv_freq.float()
    if s.rope_type == "linear":
        return (inv_freq / s.factor).float()
    l0 = s.original_max_position_embeddings
    if s.rope_type == "llama3":
        wavelen = 2 * math.pi / inv_freq
        turns = l0 / wavelen  # turns of each pair over the training context
        blend = ((turns - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
        # blend 1: high frequency, kept; blend 0: low frequency, divided by factor
        return (blend * inv_freq + (1 - blend) * inv_freq / s.factor).float()
    # yarn: the pair index at which a pair makes `turns` turns in l0 tokens
    def pair_with_turns(turns: float) -> float:
        return d * math.log(l0 / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_with_turns(s.beta_fast), pair_with_turns(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001  # avoid dividing by zero
    ramp = ((pair - lo) / (hi - lo)).clamp(0, 1)  # 0: keep (extrapolate), 1: interpolate
    return ((1 - ramp) * inv_freq + ramp * inv_freq / s.factor).float()


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float = 10000.0,
    scaling: RopeScaling | dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, pair) angle: fp32, ``(*positions.shape, head_dim // 2)``.

    The angle is ``float32(position) * inv_freq`` in fp32, as the kernel computes it.
    """
    s = as_rope_scaling(scaling)
    seq_len = int(positions.max()) + 1 if (s is not None and s.rope_type == "dynamic"
                                            and positions.numel()) else None
    inv_freq = rope_inv_freq(head_dim, theta, s, seq_len).to(positions.device)
    angle = positions.float()[..., None] * inv_freq  # (..., d/2)
    a = attention_factor(s)
    return torch.cos(angle) * a, torch.sin(angle) * a

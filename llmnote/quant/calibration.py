"""Activation statistics of the linear layers, collected with forward hooks.

Calibration data is a few sequences of token ids run through the model in
full precision; a hook on each ``nn.Linear`` sees its input ``X`` (tokens x
in_features) and records, per input channel ``j``, ``max_t |X_tj|`` (what
SmoothQuant needs), ``mean_t |X_tj|`` (what AWQ needs) and, optionally, a
random sample of input rows (AWQ's scale search measures output error on it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ChannelStats:
    """Per-input-channel statistics of one linear layer's input."""

    absmax: torch.Tensor
    abssum: torch.Tensor
    tokens: int = 0
    sample: list[torch.Tensor] = field(default_factory=list)

    @property
    def absmean(self) -> torch.Tensor:
        return self.abssum / max(self.tokens, 1)

    def sample_rows(self) -> torch.Tensor:
        return torch.cat(self.sample) if self.sample else torch.empty(0, self.absmax.numel())


def calibration_batches(calibration) -> list[torch.Tensor]:
    """Normalise calibration data to a list of ``(B, S)`` int64 tensors; empty -> ValueError.

    Accepts a ``(B, S)`` or 1-D tensor of ids, or an iterable of them.
    """
    if calibration is None:
        raise ValueError("calibration must be token ids (a (B, S) tensor or a list of them), got None")
    items = [calibration] if isinstance(calibration, torch.Tensor) else list(calibration)
    out = []
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"calibration[{i}] must be an integer torch.Tensor of token ids, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.ndim == 1:
            t = t[None]
        if t.ndim != 2:
            raise ValueError(f"calibration[{i}] must be 1-D or (batch, seq), got shape {tuple(t.shape)}")
        if t.numel():
            out.append(t.long())
    if not out:
        raise ValueError("calibration data is empty: give at least one sequence of token ids")
    return out


@torch.no_grad()
def collect_stats(model: nn.Module, calibration, names: Iterable[str] | None = None,
                  sample_tokens: int = 0, seed: int = 0) -> dict[str, ChannelStats]:
    """Run the calibration ids through ``model`` and return ``{linear name: ChannelStats}``.

    ``names``: which ``nn.Linear`` modules (default: all but ``lm_head``);
    ``sample_tokens``: keep up to this many random input rows per layer.
    """
    batches = calibration_batches(calibration)
    mods = dict(model.named_modules())
    names = [n for n, m in mods.items() if isinstance(m, nn.Linear) and not n.endswith("lm_head")] \
        if names is None else list(names)
    stats: dict[str, ChannelStats] = {}
    gen = torch.Generator().manual_seed(seed)
    total = sum(b.numel() for b in batches)

    def hook(name):
        def fn(module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            st = stats.get(name)
            if st is None:
                st = stats[name] = ChannelStats(torch.zeros(x.shape[1], device=x.device),
                                                torch.zeros(x.shape[1], device=x.device))
            st.absmax = torch.maximum(st.absmax, x.abs().amax(0))
            st.abssum += x.abs().sum(0)
            st.tokens += x.shape[0]
            if sample_tokens:
                k = max(1, round(sample_tokens * x.shape[0] / total))
                idx = torch.randperm(x.shape[0], generator=gen)[:k]
                st.sample.append(x[idx.to(x.device)].cpu())
        return fn

    handles = []
    for n in names:
        if n not in mods or not isinstance(mods[n], nn.Linear):
            raise ValueError(f"{n!r} is not an nn.Linear of the model")
        handles.append(mods[n].register_forward_pre_hook(hook(n)))
    try:
        dev = next(model.parameters()).device
        for b in batches:
            model(b.to(dev))
    finally:
        for h in handles:
            h.remove()
    return stats


def layer_groups(model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """``(prev op name, prev op, [linear names])``: the linears that read one op's output.

    For each decoder layer of an llmnote Llama: the attention input norm feeds
    q/k/v, the MLP input norm feeds gate/up, and ``up_proj`` scales the input of
    ``down_proj`` (``silu(gate) * up`` is linear in ``up``'s output).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"model must be an llmnote Llama (model.model.layers), got {type(model).__name__}")
    groups = []
    for i, layer in enumerate(layers):
        p = f"model.layers.{i}"
        groups.append((f"{p}.input_layernorm", layer.input_layernorm,
                       [f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj"]))
        groups.append((f"{p}.post_attention_layernorm", layer.post_attention_layernorm,
                       [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]))
        groups.append((f"{p}.mlp.up_proj", layer.mlp.up_proj, [f"{p}.mlp.down_proj"]))
    return groups


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Divide the previous op's output channel j by ``s_j`` and multiply each linear's
    input column j by ``s_j``: ``(x / s) (W diag(s))^T = x W^T`` exactly in real arithmetic.

    ``prev``: an RMSNorm (its ``weight``) or an ``nn.Linear`` (its output rows and bias).
    """
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.to(prev.weight.dtype)[:, None])
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    elif hasattr(prev, "weight") and prev.weight.ndim == 1:
        prev.weight.div_(s.to(prev.weight.dtype))
    else:
        raise TypeError(f"cannot fold scales into {type(prev).__name__}")
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight.dtype)[None, :])

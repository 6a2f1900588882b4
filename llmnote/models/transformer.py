"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Read top to bottom: attention, the feed-forward block, positional encodings,
masks, then the encoder and decoder layers and the whole model. Shapes use
B batch, S source length, T target length, d = d_model, h heads, d_k = d / h.

As in the paper (section 3): each sub-layer is wrapped post-norm,
``LayerNorm(x + Dropout(sublayer(x)))``; embeddings are multiplied by sqrt(d)
and added to sinusoidal encodings; the decoder's self-attention is causal and
its second attention reads the encoder's output ("cross-attention").
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn


def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_k)) v (equation 1). Returns (output, attention weights).

    q: (..., Tq, d_k), k: (..., Tk, d_k), v: (..., Tk, d_v); mask broadcasts to
    (..., Tq, Tk), True where attending is allowed.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)  # each row sums to 1
    return weights @ v, weights  # (..., Tq, d_v), (..., Tq, Tk)


class MultiHeadAttention(nn.Module):
    """h attention heads in parallel on learned projections, concatenated (section 3.2.2).

    The weights of the last call are kept in ``self.weights`` (B, h, Tq, Tk) for plots.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.h, self.d_k = n_heads, d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.weights: torch.Tensor | None = None

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, h, T, d_k)
        return x.view(x.shape[0], x.shape[1], self.h, self.d_k).transpose(1, 2)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q = self._split(self.w_q(query))  # (B, h, Tq, d_k)
        k = self._split(self.w_k(key))  # (B, h, Tk, d_k)
        v = self._split(self.w_v(value))  # (B, h, Tk, d_k)
        out, weights = scaled_dot_product_attention(q, k, v, mask)  # (B, h, Tq, d_k)
        self.weights = weights.detach()
        out = self.dropout(out.transpose(1, 2).reshape(query.shape[0], query.shape[1], -1))
        return self.w_o(out)  # (B, Tq, d)


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, the same at every position (section 3.3)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        return self.w_2(self.dropout(F.relu(self.w_1(x))))


def sinusoidal_encoding(max_len: int, d_model: int) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...) (section 3.5).

    Returns (max_len, d_model), fp32. Each pair (2i, 2i+1) is a point on a circle
    turning with position at its own frequency, so PE[pos + k] is a fixed
    rotation of PE[pos]: the seed of RoPE.
    """
    if d_model % 2:
        raise ValueError(f"d_model must be even, got {d_model}")
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d/2,)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq)
    return pe.float()


class PositionalEncoding(nn.Module):
    """Adds the sinusoidal table to token embeddings, then dropout."""

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.1) -> None:
        super().__init__()
        self.register_buffer("pe", sinusoidal_encoding(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        if x.shape[1] > self.pe.shape[0]:
            raise ValueError(f"sequence length {x.shape[1]} exceeds max_len {self.pe.shape[0]}")
        return self.dropout(x + self.pe[: x.shape[1]])


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, T) ids -> (B, 1, 1, T) bool: True at real tokens, False at padding keys."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(t: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(1, 1, T, T) bool, lower triangular: position i may attend to positions <= i."""
    return torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))[None, None]


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each as LayerNorm(x + Dropout(sublayer(x)))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:  # (B, S, d)
        x = self.norm1(x + self.dropout(self.self_attn(x, x, x, src_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, then FFN."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model) for _ in range(3))
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, y: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, tgt_mask: torch.Tensor
    ) -> torch.Tensor:  # y: (B, T, d), memory: (B, S, d)
        y = self.norm1(y + self.dropout(self.self_attn(y, y, y, tgt_mask)))
        y = self.norm2(y + self.dropout(self.cross_attn(y, memory, memory, src_mask)))
        return self.norm3(y + self.dropout(self.ffn(y)))


class Transformer(nn.Module):
    """Encoder-decoder: ``forward(src, tgt_in)`` -> logits (B, T, tgt_vocab).

    The paper's base model is ``Transformer(V, V, d_model=512, n_heads=8,
    n_layers=6, d_ff=2048, dropout=0.1)``. Padding (``pad_id``) is masked in
    every attention that reads it as a key.
    """

    def __init__(
        self, src_vocab: int, tgt_vocab: int, d_model: int = 512, n_heads: int = 8,
        n_layers: int = 6, d_ff: int = 2048, dropout: float = 0.1, max_len: int = 5000,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        self.d_model, self.pad_id = d_model, pad_id
        self.src_embed = nn.Embedding(src_vocab, d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model)
        self.pos = PositionalEncoding(d_model, max_len, dropout)
        layer_args = (d_model, n_heads, d_ff, dropout)
        self.encoder = nn.ModuleList(EncoderLayer(*layer_args) for _ in range(n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(*layer_args) for _ in range(n_layers))
        self.out = nn.Linear(d_model, tgt_vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def _embed(self, emb: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        if ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"token ids must be a (batch, length) int tensor, got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        return self.pos(emb(ids) * math.sqrt(self.d_model))  # (B, T, d)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S) -> (memory (B, S, d), src_mask (B, 1, 1, S))."""
        src_mask = padding_mask(src, self.pad_id)
        x = self._embed(self.src_embed, src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return x, src_mask

    def decode(
        self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor
    ) -> torch.Tensor:
        """tgt_in (B, T) -> logits (B, T, tgt_vocab); position t sees tgt_in[:, :t+1] only."""
        t = tgt_in.shape[1]
        tgt_mask = padding_mask(tgt_in, self.pad_id) & causal_mask(t, tgt_in.device)  # (B, 1, T, T)
        y = self._embed(self.tgt_embed, tgt_in)
        for layer in self.decoder:
            y = layer(y, memory, src_mask, tgt_mask)
        return self.out(y)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)

    @torch.no_grad()
    def greedy_decode(self, src: torch.Tensor, bos_id: int, max_len: int) -> torch.Tensor:
        """Generate ``max_len`` tokens after ``bos_id``, one at a time; returns (B, max_len)."""
        memory, src_mask = self.encode(src)
        ys = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        for _ in range(max_len):
            nxt = self.decode(ys, memory, src_mask)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            ys = torch.cat([ys, nxt], dim=1)
        return ys[:, 1:]


def to_torch_transformer(model: Transformer) -> nn.Transformer:
    """PyTorch's own ``nn.Transformer`` holding a copy of ``model``'s layer weights: an
    outside reference for the encoder and decoder stacks (embeddings, positional
    encodings and the output projection stay with ``model``).

    ``nn.Transformer`` packs q, k, v into one ``in_proj_weight`` (3d, d) and ends
    each stack with an extra LayerNorm; the paper's post-norm stacks have none, so
    those two norms are removed. Call it with ``batch_first`` tensors and
    ``True``-means-blocked masks (the opposite of this module's convention).
    """
    first = model.encoder[0]
    with warnings.catch_warnings():  # its nested-tensor fast path is switched off below
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        tr = nn.Transformer(
            model.d_model, first.self_attn.h, len(model.encoder), len(model.decoder),
            first.ffn.w_1.out_features, dropout=0.0, batch_first=True,
            layer_norm_eps=first.norm1.eps,
        )
    tr.encoder.norm = tr.decoder.norm = None  # post-norm: no norm after the last layer
    tr.encoder.enable_nested_tensor = tr.encoder.use_nested_tensor = False  # keep padded rows

    def copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
        theirs.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
        theirs.out_proj.load_state_dict(ours.w_o.state_dict())

    with torch.no_grad():
        for ours, theirs in [*zip(model.encoder, tr.encoder.layers),
                             *zip(model.decoder, tr.decoder.layers)]:
            copy_attention(ours.self_attn, theirs.self_attn)
            if isinstance(ours, DecoderLayer):
                copy_attention(ours.cross_attn, theirs.multihead_attn)
                theirs.norm3.load_state_dict(ours.norm3.state_dict())
            theirs.linear1.load_state_dict(ours.ffn.w_1.state_dict())
            theirs.linear2.load_state_dict(ours.ffn.w_2.state_dict())
            theirs.norm1.load_state_dict(ours.norm1.state_dict())
            theirs.norm2.load_state_dict(ours.norm2.state_dict())
    return tr.eval()


def toy_batch(
    batch_size: int, seq_len: int, vocab_size: int, task: str = "copy",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of the copy or reverse task: ``(src, tgt_in, tgt_out)``.

    Ids 0 and 1 are reserved (0 padding, 1 beginning-of-sequence); content tokens
    are drawn from ``2 .. vocab_size - 1``. ``tgt_in`` is BOS + target without its
    last token (teacher forcing), ``tgt_out`` the target itself; all (B, seq_len).
    """
    if task not in ("copy", "reverse"):
        raise ValueError(f"task must be 'copy' or 'reverse', got {task!r}")
    src = torch.randint(2, vocab_size, (batch_size, seq_len), generator=generator)
    tgt = src if task == "copy" else src.flip(1)
    tgt_in = torch.cat([torch.ones(batch_size, 1, dtype=torch.long), tgt[:, :-1]], dim=1)
    return src, tgt_in, tgt

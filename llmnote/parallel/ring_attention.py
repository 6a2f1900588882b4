"""Ring attention (context parallelism): attention over a sequence split across ranks.

The sequence of ``N`` tokens is cut into ``p`` contiguous chunks, rank ``r``
holding the queries, keys and values of chunk ``r``. Attention needs every query
against every key, so the key/value chunks travel round a ring: at step ``t`` rank
``r`` holds the K/V of chunk ``(r - t) mod p``, attends its queries to it, and
passes it on to rank ``r + 1`` while receiving the next from rank ``r - 1``
(point-to-point ``isend``/``irecv``, posted *before* the step's attention so that
the transfer overlaps the compute). After ``p`` steps every query has seen every
key, and no rank ever held more than two K/V chunks (Liu et al., 2023).

Each step gives a partial output ``o_t`` normalised over its own keys and the
log-sum-exp ``lse_t`` of its scores; :func:`merge_partials` combines two of them
exactly, the online-softmax rescaling FlashAttention applies per key block:
``o = (e^(lse_a - m) o_a + e^(lse_b - m) o_b) / (e^(lse_a - m) + e^(lse_b - m))``.

Causal attention: chunk ``j < r`` lies wholly in the past of chunk ``r`` (no
mask), ``j = r`` is the diagonal (the causal mask), ``j > r`` is skipped, yet
still forwarded. Rank ``p - 1`` computes ``p`` blocks and rank 0 one: the
imbalance that striped or zig-zag chunk orders remove (Brandon et al., 2023).

Overlap: a step moves ``2 n_k h_kv d`` elements per rank and computes
``4 n_q n_k h d`` flops; with ``n = N/p`` the ratio grows with ``n``, so past a
chunk length set by the link's bandwidth against the GPU's flop rate the
transfer hides entirely behind the attention (the chapter works it out).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from llmnote.ops.attention.reference import flash_attention_ref


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention partials over disjoint key sets -> the partial over their union.

    ``out_*`` ``(..., n, d)`` each normalised over its keys, ``lse_*`` ``(..., n)`` the
    natural log-sum-exp of its scores (``-inf``: no key, the output then ignored).
    Returns ``(out fp32, lse fp32)``; rows with no key in either stay ``(0, -inf)``."""
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both empty: weights 0, not NaN
    wa, wb = torch.exp(la - m), torch.exp(lb - m)  # (..., n)
    den = wa + wb
    safe = torch.where(den == 0, torch.ones_like(den), den)
    out = (wa[..., None] * out_a.float() + wb[..., None] * out_b.float()) / safe[..., None]
    return out, m + torch.log(den)


def chunk_sizes(n: int, parts: int) -> list[int]:
    """``n`` tokens cut into ``parts`` contiguous chunks, the first ``n % parts`` one longer."""
    if parts < 1 or n < parts:
        raise ValueError(f"cannot cut {n} tokens into {parts} non-empty chunks")
    return [n // parts + (i < n % parts) for i in range(parts)]


def _local_attention(q, k, v, causal, scale):
    if q.is_cuda:
        from llmnote.ops import flash_attention

        return flash_attention(q, k, v, causal=causal, sm_scale=scale, return_lse=True)
    return flash_attention_ref(q, k, v, causal=causal, sm_scale=scale, return_lse=True)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   sm_scale: float | None = None, group: dist.ProcessGroup | None = None,
                   stats: dict | None = None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence of the group.

    ``q (batch, heads, n_r, d)``, ``k, v (batch, kv_heads, n_r, d)``: rank ``r``'s chunk,
    chunks in rank order (lengths may differ by rank: :func:`chunk_sizes`). Returns
    ``(batch, heads, n_r, d)`` in ``q``'s dtype. Local attention: llmnote's
    FlashAttention on a GPU, the PyTorch reference on the CPU. ``stats``, if given,
    gets ``compute_s`` (attention and merges) and ``wait_s`` (time blocked on the ring
    after the compute: the transfer not hidden), summed over the steps.
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be (batch, heads, n, d) and k, v (batch, kv_heads, n, d) with "
                         f"the same batch, n and d; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")
    p, r = dist.get_world_size(group), dist.get_rank(group)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    # every rank's chunk length, so that each knows the size of what it receives
    n_local = torch.tensor([q.shape[2]], dtype=torch.long, device=q.device)
    lens = [torch.zeros_like(n_local) for _ in range(p)]
    dist.all_gather(lens, n_local, group=group)
    lens = [int(x.item()) for x in lens]
    nxt = dist.get_global_rank(group, (r + 1) % p) if group is not None else (r + 1) % p
    prv = dist.get_global_rank(group, (r - 1) % p) if group is not None else (r - 1) % p
    kv = torch.stack([k, v]).contiguous()  # (2, B, Hkv, n, d): one message per step
    out = lse = None
    compute_s = wait_s = 0.0
    for t in range(p):
        j = (r - t) % p  # the chunk this rank holds at step t
        reqs = []
        if t < p - 1:  # post the next transfer first: it runs while we attend
            incoming = kv.new_empty((2, *k.shape[:2], lens[(j - 1) % p], k.shape[3]))
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group),
                                           dist.P2POp(dist.irecv, incoming, prv, group)])
        t0 = time.perf_counter()
        if not causal or j <= r:
            o_t, lse_t = _local_attention(q, kv[0], kv[1], causal and j == r, scale)
            out, lse = (o_t.float(), lse_t.float()) if out is None else \
                merge_partials(out, lse, o_t, lse_t)
        if stats is not None and q.is_cuda:
            torch.cuda.synchronize(q.device)
        t1 = time.perf_counter()
        for req in reqs:
            req.wait()
        if stats is not None and q.is_cuda:
            torch.cuda.synchronize(q.device)
        compute_s += t1 - t0
        wait_s += time.perf_counter() - t1
        if reqs:
            kv = incoming
    if stats is not None:
        stats["compute_s"] = stats.get("compute_s", 0.0) + compute_s
        stats["wait_s"] = stats.get("wait_s", 0.0) + wait_s
    return out.to(q.dtype)


def ring_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       sm_scale: float | None = None) -> torch.Tensor:
    """The same attention on one device over the whole sequence (what the ring must equal)."""
    return flash_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)

"""Functions that :func:`llmnote.parallel.launch` runs on every rank.

They live in a module (not in the notebook) because spawned processes import
them by name. Each receives ``(rank, world_size, ...)`` and the full weights of
the reference (as a config and a ``state_dict``), takes its own shard, runs, and
returns plain tensors and numbers.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from llmnote.models.config import LlamaConfig
from llmnote.models.llama import DecoderLayer, Llama, reference_ops
from llmnote.parallel.tensor_parallel import Comm, shard_decoder_layer, shard_llama


def _layer(cfg: LlamaConfig, state: dict, layer_idx: int) -> DecoderLayer:
    layer = DecoderLayer(cfg, layer_idx, reference_ops())
    layer.load_state_dict(state)
    return layer.to(next(iter(state.values())).dtype)


@torch.no_grad()
def block_forward(rank: int, world_size: int, cfg: LlamaConfig, state: dict, layer_idx: int,
                  x: torch.Tensor, positions: torch.Tensor, reduce: bool = True) -> dict:
    """One tensor-parallel decoder block on ``x`` (B, S, hidden): this rank's output
    and what its all-reduces moved. ``reduce=False`` leaves out the all-reduce."""
    comm = Comm(reduce=reduce)
    block = shard_decoder_layer(_layer(cfg, state, layer_idx), cfg, rank, world_size, comm)
    y = block(x, positions, None)
    return {"out": y, "calls": comm.calls, "payload_bytes": comm.payload_bytes,
            "wire_bytes_per_rank": comm.wire_bytes_per_rank,
            "local_params": sum(p.numel() for p in block.parameters())}


@torch.no_grad()
def generate(rank: int, world_size: int, cfg: LlamaConfig, state: dict, input_ids: torch.Tensor,
             max_new_tokens: int) -> dict:
    """Greedy decoding with every block tensor-parallel: the tokens, the all-reduce
    tally, and the tokens processed (prompt + decode steps) and wall time."""
    model = Llama(cfg)
    model.load_state_dict(state)
    comm = Comm()
    shard_llama(model, rank, world_size, comm)
    dist.barrier()
    t0 = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens)
    seconds = time.perf_counter() - t0
    b = input_ids.shape[0]
    tokens = b * out.shape[1]  # run through the model: the prompt, then one step per new token
    return {"tokens": out, "calls": comm.calls, "payload_bytes": comm.payload_bytes,
            "wire_bytes_per_rank": comm.wire_bytes_per_rank, "tokens_processed": tokens,
            "seconds": seconds, "head_rows": model.lm_head.weight.shape[0]}


def all_reduce_times(rank: int, world_size: int, sizes: list[int], repeats: int = 5) -> list[float]:
    """Seconds of one fp32 all-reduce of each size (elements) over this group: the
    fastest of ``repeats`` (on a shared CPU, slower runs measure the OS scheduler)."""
    out = []
    for n in sizes:
        t = torch.ones(n)
        dist.all_reduce(t)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append(min(times))
    return out


def block_forward_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """:func:`block_forward` on several cases (keyword dicts) in one launch."""
    return [block_forward(rank, world_size, **case) for case in cases]


class RankFailure(ValueError):
    """What :func:`fail_in_rank` raises."""


def fail_in_rank(rank: int, world_size: int, failing_rank: int, kind: str = "error") -> int:
    """Rank ``failing_rank`` fails (``kind``: ``"error"`` raises :class:`RankFailure`,
    ``"interrupt"`` raises ``KeyboardInterrupt``) while the others wait in an all-reduce
    that it never joins: how :func:`~llmnote.parallel.launch` reports a failing rank."""
    if rank == failing_rank:
        time.sleep(0.2)  # let the peers enter the collective first
        if kind == "interrupt":
            raise KeyboardInterrupt
        raise RankFailure(f"rank {rank} failed on purpose")
    t = torch.ones(4)
    dist.all_reduce(t)  # never completes: the failing rank does not join it
    return rank


@torch.no_grad()
def ring_attention_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Ring attention on each case (``q, k, v`` of the whole sequence, ``causal``): this
    rank takes its chunk, runs :func:`~llmnote.parallel.ring_attention.ring_attention`
    and returns its rows of the output and the compute/wait seconds."""
    from llmnote.parallel.ring_attention import chunk_sizes, ring_attention

    dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = []
    for c in cases:
        sizes = chunk_sizes(c["q"].shape[2], world_size)
        start = sum(sizes[:rank])
        q, k, v = (c[x].narrow(2, start, sizes[rank]).to(dev) for x in ("q", "k", "v"))
        stats: dict = {}
        o = ring_attention(q, k, v, causal=c["causal"], stats=stats)
        out.append({"out": o.cpu(), "start": start, **stats})
    return out


@torch.no_grad()
def sharded_logits(rank: int, world_size: int, cfg: LlamaConfig, state: dict,
                   ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits of ``ids`` through the engine's shard of the model
    (:func:`~llmnote.engine.tp_worker.shard_for_engine`) in ``dtype``, on GPU ``rank``
    under NCCL (the CPU under gloo); returned on the CPU in fp32."""
    from llmnote.engine.tp_worker import shard_for_engine

    dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = Llama(cfg)
    model.load_state_dict(state)
    model = model.to(device=dev, dtype=dtype).eval()
    shard_for_engine(model, rank, world_size, Comm())
    return model(ids.to(dev)).float().cpu()


@torch.no_grad()
def one_shot_against_nccl(rank: int, world_size: int, numels: list[int],
                          dtype: torch.dtype = torch.bfloat16, calls: int = 50) -> dict:
    """:meth:`Comm.all_reduce` with the one-shot path on (GPU ranks) against NCCL's
    all-reduce of the same tensors: ``calls`` back-to-back reductions of fresh values per
    size (the buffers' reuse), then the same inside a CUDA graph, replayed twice. Returns
    why the path could not be set up, or the largest difference of each part."""
    dev = torch.device("cuda", rank)
    comm = Comm()
    why = comm.use_one_shot(dev, dtype=dtype)
    if why is not None:
        return {"why": why}
    g = torch.Generator(device=dev).manual_seed(rank)
    eager = 0.0
    for n in numels:
        for _ in range(calls):
            x = torch.randn(n, device=dev, generator=g).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            eager = max(eager, float((comm.all_reduce(x) - want).abs().max()))
    xs = [torch.randn(n, device=dev, generator=g).to(dtype) for n in numels]
    keep = [x.clone() for x in xs]
    graph = torch.cuda.CUDAGraph()
    for x in xs:  # warm-up outside the capture, as CUDA graphs want
        comm.all_reduce(x)
    for x, k in zip(xs, keep):
        x.copy_(k)
    torch.cuda.synchronize(dev)
    with torch.cuda.graph(graph):
        for x in xs:
            comm.all_reduce(x)
    graphed = 0.0
    for _ in range(2):
        for x, k in zip(xs, keep):
            x.copy_(k)
        graph.replay()
        torch.cuda.synchronize(dev)
        for x, k in zip(xs, keep):
            want = k.clone()
            dist.all_reduce(want)
            graphed = max(graphed, float((x - want).abs().max()))
    return {"why": None, "eager": eager, "graph": graphed, "one_shot_calls": comm.one_shot_calls}


@torch.no_grad()
def fused_norm_against_reference(rank: int, world_size: int, shapes: list[tuple[int, int]],
                                 dtype: torch.dtype = torch.bfloat16, calls: int = 20) -> dict:
    """:meth:`Comm.all_reduce_add_rmsnorm` with the fused kernel on (GPU ranks) against
    :func:`~llmnote.parallel.all_reduce_norm.all_reduce_add_rmsnorm_ref` (NCCL's all-reduce,
    then the plain add and norm) on the same fresh inputs: ``calls`` back-to-back calls per
    ``(rows, hidden)`` shape (the buffers' and flags' reuse), then inside a CUDA graph
    replayed twice. Returns why the kernel could not be set up, or per part the largest
    difference of ``y`` from the reference over ``eps * max(|got|, |want|)`` elementwise
    (each is the fp32 norm rounded once to ``dtype``, so within one unit in the last
    place of each other, which ``eps`` times the larger bounds: at most 1), whether
    ``h`` came out bit-equal, and this rank's outputs of the last call (for the ranks
    to be compared)."""
    from llmnote.parallel.all_reduce_norm import all_reduce_add_rmsnorm_ref

    dev = torch.device("cuda", rank)
    comm = Comm()
    why = comm.use_fused_norm(dev, dtype=dtype)
    if why is not None:
        return {"why": why}
    ref = Comm()
    g = torch.Generator(device=dev).manual_seed(rank)
    shared = torch.Generator(device=dev).manual_seed(1234)  # the same on every rank
    tiny = torch.finfo(dtype).eps

    def ulps(got, want):
        g, w = got.float(), want.float()
        unit = (tiny * torch.maximum(g.abs(), w.abs())).clamp(min=torch.finfo(dtype).tiny)
        return float(((g - w).abs() / unit).max())

    def inputs(t, n):
        x = torch.randn(t, n, device=dev, generator=g).to(dtype)  # this rank's partial
        res = torch.randn(t, n, device=dev, generator=shared).to(dtype)
        w = (1 + 0.1 * torch.randn(n, device=dev, generator=shared)).to(dtype)
        return x, res, w

    out = {"why": None, "eager": 0.0, "graph": 0.0, "h_equal": True}
    last = None
    for t, n in shapes:
        for _ in range(calls):
            x, res, w = inputs(t, n)
            want_y, want_h = all_reduce_add_rmsnorm_ref(x.clone(), res, w, 1e-5, ref)
            y, h = comm.all_reduce_add_rmsnorm(x, res, w, 1e-5)
            out["eager"] = max(out["eager"], ulps(y, want_y))
            out["h_equal"] &= bool(torch.equal(h, want_h))
            last = (y.float().cpu(), h.float().cpu())
    cases = [inputs(t, n) for t, n in shapes]
    for x, res, w in cases:  # warm-up outside the capture
        comm.all_reduce_add_rmsnorm(x, res, w, 1e-5)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [comm.all_reduce_add_rmsnorm(x, res, w, 1e-5) for x, res, w in cases]
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize(dev)
        for (x, res, w), (y, h) in zip(cases, outs):
            want_y, want_h = all_reduce_add_rmsnorm_ref(x.clone(), res, w, 1e-5, ref)
            out["graph"] = max(out["graph"], ulps(y, want_y))
            out["h_equal"] &= bool(torch.equal(h, want_h))
    out["fused_calls"] = comm.fused_norm.calls
    out["last"] = last
    return out


def fused_norm_peer_missing(rank: int, world_size: int, timeout_s: float) -> dict:
    """Rank 0 calls :meth:`Comm.all_reduce_add_rmsnorm` (fused kernel, which waits at most
    ``timeout_s`` for its peers) and the other ranks never do: rank 0's kernel must trap,
    which raises a CUDA error here, instead of spinning for ever. Returns why the kernel
    could not be set up, or, where no error came, that none did."""
    dev = torch.device("cuda", rank)
    comm = Comm()
    why = comm.use_fused_norm(dev, dtype=torch.bfloat16, timeout_s=timeout_s)
    if why is not None or rank != 0:
        return {"why": why, "error": None}
    x = torch.ones(1, 256, device=dev, dtype=torch.bfloat16)
    comm.all_reduce_add_rmsnorm(x, x.clone(), torch.ones_like(x[0]), 1e-6)
    torch.cuda.synchronize(dev)  # the trap surfaces here
    return {"why": None, "error": None}


def fused_norm_interpreted_rank(rank: int, data: list, barrier, queue, calls: int) -> None:
    """One of two CPU processes running the fused all-reduce kernel in Triton's
    interpreter at the same time, over buffers in shared memory (``data``: both ranks'
    tensors, shared, filled with ``EMPTY``; each process maps them at its own addresses):
    ``calls`` calls of varying rows and widths, the same inputs on both ranks, a random
    pause before half of them so that the ranks drift apart. Puts ``(rank, all h bit-equal to the
    reference and every call completed, largest |y - reference| over its bound)`` on
    ``queue``; the bound per element, as in the kernel's single-process tests: ``(eps +
    (hidden / 2 + 5) u) max(|y|, |reference|)``, fp32's eps and u = 2^-24."""
    import random

    from llmnote.ops.rmsnorm import add_rmsnorm_ref
    from llmnote.parallel.all_reduce_norm import AllReduceNorm

    fused = AllReduceNorm(rank, 2, data[rank], [d.data_ptr() for d in data])
    pause = random.Random(rank)
    barrier.wait()
    ok, worst = True, 0.0
    for i in range(calls):
        g = torch.Generator().manual_seed(i)
        rows, hidden = 1 + i % 3, 32 + 8 * (i % 4)
        x = [torch.randn(rows, hidden, generator=g) for _ in range(2)]
        res, w = torch.randn(rows, hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)
        if pause.random() < 0.5:
            time.sleep(pause.random() * 0.003)
        y, h = fused(x[rank].clone(), res, w, 1e-5)
        want_y, want_h = add_rmsnorm_ref(x[0] + x[1], res, w, 1e-5)
        ok &= bool(torch.equal(h, want_h)) and int(fused.count[:rows].min()) > 0
        big = torch.maximum(y.abs(), want_y.abs()).clamp(min=torch.finfo(y.dtype).tiny)
        bound = (2.0**-23 + (hidden / 2 + 5) * 2.0**-24) * big
        worst = max(worst, float(((y - want_y).abs() / bound).max()))
    queue.put((rank, ok, worst))

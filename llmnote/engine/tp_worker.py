"""The ranks of the engine over several processes (``LLM(..., tensor_parallel_size=N)``).

Each rank is a spawned process (one GPU over NCCL, or gloo on the CPU). It loads the
model, keeps its shard (:func:`shard_for_engine`: q/k/v and gate/up split by output
columns, o and down by input rows, whole heads per rank; the KV cache then holds
only this rank's kv heads) and builds an ordinary
:class:`~llmnote.engine.model_runner.ModelRunner` on it, CUDA graphs and multi-step
decoding included. Then it runs what the driver (:mod:`llmnote.engine.tp_driver`)
sends: a step, a multi-step run to queue, a run's tokens to read. The wire format
is lean: per sequence only the tokens the rank has not seen yet, its position, its
block table; the rank keeps a mirror :class:`~llmnote.engine.sequence.Sequence` per
request. Rank 0 answers; a rank that raises sends its exception and exits.

Each rank loads the whole model before keeping its shard, so the peak memory of a
rank at start-up is the whole model (a checkpoint sharded on read would avoid it).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from llmnote.engine.config import EngineConfig
from llmnote.engine.scheduler import ScheduledBatch
from llmnote.engine.sequence import Sequence
from llmnote.models.config import LlamaConfig
from llmnote.models.llama import Llama, LlamaOps
from llmnote.parallel.tensor_parallel import (
    Comm, kv_shard, local_config, shard_llama,
)


# ---------------------------------------------------------------- sharding
def check_tp_shapes(cfg: LlamaConfig, world_size: int) -> None:
    """``ValueError`` naming the field when ``world_size`` ranks cannot hold whole heads."""
    for field in ("num_attention_heads", "intermediate_size"):
        if getattr(cfg, field) % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {field} "
                             f"({getattr(cfg, field)})")
    try:
        kv_shard(cfg.num_key_value_heads, 0, world_size)
    except ValueError:
        raise ValueError(f"tensor_parallel_size={world_size} and the model's num_key_value_heads "
                         f"({cfg.num_key_value_heads}): one must divide the other") from None


def shard_for_engine(model: Llama, rank: int, world_size: int, comm: Comm) -> Llama:
    """Rank ``rank``'s shard of ``model`` in the form the engine's runner fuses: the
    column-parallel projections become plain ``nn.Linear`` of the local rows (so q/k/v
    and gate/up fuse into one GEMM each), o and down stay row-parallel (they all-reduce),
    and ``model.config`` becomes the local shapes (heads, kv heads, intermediate size
    divided), which size the rank's KV cache. In place; returns ``model``."""
    dev = next(model.parameters()).device
    with torch.device(dev):  # the new blocks are made where the weights live
        shard_llama(model, rank, world_size, comm)
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                              (layer.mlp, ("gate_proj", "up_proj"))):
            for name in names:
                col = getattr(parent, name)
                lin = nn.Linear(col.weight.shape[1], col.weight.shape[0], bias=col.bias is not None,
                                device="meta")
                lin.weight = col.weight
                lin.bias = col.bias
                setattr(parent, name, lin)
    model.config = local_config(model.config, world_size)
    return model


# ---------------------------------------------------------------- the worker process
def _error_record(rank: int, e: BaseException) -> dict:
    rec = {"rank": rank, "time": time.time(), "type": type(e).__name__, "message": str(e),
           "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))}
    try:  # the exception itself, when it survives pickling
        blob = pickle.dumps(e)
        pickle.loads(blob)
        rec["exception"] = blob
    except Exception:  # noqa: BLE001 - reported as text
        rec["exception"] = None
    return rec


def random_model(cfg: LlamaConfig, device=None, dtype: torch.dtype | None = None,
                 seed: int = 0, ops: LlamaOps | None = None) -> Llama:
    """A Llama of shape ``cfg`` with random weights (normal, std 0.02; norms 1) made
    directly in ``dtype`` on ``device`` (defaults: the fast path), so the peak memory is
    the model's own, not the fp32 model a plain ``Llama(cfg)`` would make first: a 32-layer
    Llama-3-70B shape is 59 GB in bf16, 118 GB in fp32. Same ``seed``, same weights on
    every device of a kind (each rank of a benchmark builds the same model)."""
    from llmnote.device import placement
    from llmnote.models.llama import RMSNorm

    dev, dt = placement(device, dtype, cpu_dtype=torch.float32)
    with torch.device("meta"):
        m = Llama(cfg, ops=ops)
    m = m.to(dtype=dt).to_empty(device=dev)
    m.tie_weights()
    torch.manual_seed(seed)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                mod.weight.normal_(0, 0.02)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.zero_()
            if isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)
    return m.eval()


def _load_source(source: tuple, dtype, device, ops, seed):
    """The whole model on this rank's device: (Llama, tokenizer, eos ids)."""
    from llmnote.engine.llm import _load

    kind, what = source
    if kind == "config":  # random weights of this shape
        return random_model(what, device, dtype, seed, ops), None, []
    if kind == "state":  # a Llama the driver was given, saved to a file
        blob = torch.load(what, weights_only=False, mmap=True)
        m = Llama(blob["config"], ops=blob["ops"])
        m.load_state_dict(blob["state"])
        m.eval()
        return _load(m, blob["dtype"] if dtype is None else dtype, device, ops, seed)
    return _load(what, dtype, device, ops, seed)


def rank_main(rank: int, world_size: int, port: int, backend: str, conn, source: tuple,
            config: EngineConfig, dtype, ops: LlamaOps | None) -> None:
    """One rank: load, shard, build a runner, then run the batches the driver sends."""
    code = 0
    try:
        if backend == "nccl":
            # NVLink multicast (NVLS) off unless asked for: on a shared host it can take
            # GPUs out of service, and a tensor-parallel pair gains little from it
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            dev = torch.device("cuda", rank)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on the loopback device
        timeout = timedelta(seconds=config.distributed_timeout_s)
        kw = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timeout, **kw)
        model, tok, eos = _load_source(source, dtype, dev, ops, config.seed)
        full = model.config
        check_tp_shapes(full, world_size)
        comm = Comm()
        shard_for_engine(model, rank, world_size, comm)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the whole layers just dropped
        runner = _runner(model, config, dev)
        if rank == 0:
            conn.send(("ready", {"config": full, "tokenizer": tok, "eos": eos,
                                 "num_blocks": runner.num_blocks,
                                 "decode_steps": runner.decode_steps,
                                 "max_model_len": runner.max_model_len,
                                 "backend": runner.backend, "graphs": runner.use_graphs}))
        else:
            conn.send(("ready", None))
        seqs: dict[int, Sequence] = {}
        runs: dict = {}  # multi-step runs launched and not yet collected, by the driver's id
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "close":
                break
            if kind == "collect":  # a multi-step run's tokens, per step
                out = runner.collect(runs.pop(msg[1]))
                if rank == 0:
                    conn.send(("collect", msg[2], out))
                continue
            released, items = msg[1], msg[2]
            for sid in released:
                seqs.pop(sid, None)
                runner.release(sid)
            batch = ScheduledBatch([(_mirror(seqs, item), item[2]) for item in items])
            if kind == "launch":  # queue a multi-step run; nothing waits for the GPU here
                _, _, _, steps, prev, rid = msg
                runs[rid] = runner.launch_steps(batch, steps, prev=runs.get(prev))
                continue
            sampled = runner.run(batch)
            comm.reset()
            if rank == 0:
                conn.send(("step", msg[3], sampled))
        runner.close()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure goes to the driver
        try:
            conn.send(("error", _error_record(rank, e)))
        except Exception:  # noqa: BLE001 - the driver is gone
            pass
        code = 1
    conn.close()
    os._exit(code)  # skip the interpreter's teardown (and any collective a peer still waits in)


def _runner(model: Llama, config: EngineConfig, dev: torch.device):
    """This rank's ModelRunner; every rank gets the same number of KV blocks (the fewest
    any rank can hold) and no batch-1 GEMV path (it folds o_proj into attention, which
    would skip the all-reduce)."""
    from llmnote.engine.kv_cache import choose_num_blocks
    from llmnote.engine.model_runner import ModelRunner

    p = next(model.parameters())
    max_len = min(config.max_model_len or 10**12, model.config.max_position_embeddings)
    n = choose_num_blocks(model, config, p.dtype, dev, max_len)
    t = torch.tensor([n], dtype=torch.long, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)  # also the first collective: NCCL sets up here
    return ModelRunner(model, config.replace(num_blocks=int(t.item()), gemv=False,
                                             tensor_parallel_size=1))


def _mirror(seqs: dict[int, Sequence], item: tuple) -> Sequence:
    """Bring this rank's copy of a sequence up to date with one wire item."""
    sid, start, _, new_tokens, params, table = item
    s = seqs.get(sid)
    if s is None:
        s = seqs[sid] = Sequence(sid, new_tokens, params)
    else:
        s.token_ids.extend(new_tokens)
    s.num_computed, s.block_table = start, table
    return s

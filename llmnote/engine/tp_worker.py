"""The ranks of the engine over several processes (``LLM(..., tensor_parallel_size=N)``).

Each rank is a spawned process (one GPU over NCCL, or gloo on the CPU). It builds only
its shard of the model (:func:`build_shard`, with the rules of
:func:`~llmnote.parallel.shard_spec`: q/k/v and gate/up split by output features, o and
down by input features, whole heads per rank; the KV cache then holds only this rank's
kv heads). The shard is made on the meta device and filled tensor by tensor: from a
checkpoint folder (or the safetensors file the driver writes of a model it was given)
the rank reads only its slices; random weights (a preset, a config) are drawn one layer
at a time and cut, so they equal the one-process model's. Start-up memory is the shard
plus one tensor's slice (a checkpoint) or one fp32 layer or embedding-sized matrix
(random weights), never the whole model. On it the rank builds an ordinary
:class:`~llmnote.engine.model_runner.ModelRunner`, CUDA graphs and multi-step
decoding included. Then it runs what the driver (:mod:`llmnote.engine.tp_driver`)
sends: a step, a multi-step run to queue, a run's tokens to read, the start and end of
a profile (:meth:`~llmnote.engine.tp_driver.TPRunner.profile`). The wire format
is lean: per sequence only the tokens the rank has not seen yet, its position, its
block table; the rank keeps a mirror :class:`~llmnote.engine.sequence.Sequence` per
request. Rank 0 answers; a rank that raises sends its exception and exits.
"""

from __future__ import annotations

import json
import os
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from llmnote.engine.config import EngineConfig
from llmnote.engine.scheduler import ScheduledBatch
from llmnote.engine.sequence import Sequence
from llmnote.models.config import LlamaConfig
from llmnote.models.llama import DecoderLayer, Llama, LlamaOps, RMSNorm, reference_ops
from llmnote.models.loader import CheckpointError
from llmnote.parallel.tensor_parallel import (
    Comm, RowParallelLinear, VocabParallelLinear, kv_shard, local_config, shard, shard_spec,
    vocab_parallel,
)


# ---------------------------------------------------------------- sharding
# read(name, spec) -> the tensor ``name`` of the whole model, cut as ``spec`` says (see
# llmnote.parallel.shard_spec; None: whole), on the rank's device in its dtype
Reader = Callable[[str, tuple[int, int, int] | None], torch.Tensor]


def _check_dense(cfg: object, what: str) -> None:
    if not isinstance(cfg, LlamaConfig):
        raise ValueError(f"{what} serves Llama-family models; this model's config is a "
                         f"{type(cfg).__name__}")
    if cfg.num_experts:
        raise ValueError(f"{what} serves dense models; this one is a mixture of experts "
                         f"(num_experts={cfg.num_experts}): run it in one process")


def check_tp_shapes(cfg: LlamaConfig, world_size: int) -> None:
    """``ValueError`` naming the field when ``world_size`` ranks cannot hold whole heads."""
    _check_dense(cfg, f"tensor parallelism (tensor_parallel_size={world_size})")
    for field in ("num_attention_heads", "intermediate_size"):
        if getattr(cfg, field) % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {field} "
                             f"({getattr(cfg, field)})")
    try:
        kv_shard(cfg.num_key_value_heads, 0, world_size)
    except ValueError:
        raise ValueError(f"tensor_parallel_size={world_size} and the model's num_key_value_heads "
                         f"({cfg.num_key_value_heads}): one must divide the other") from None


def build_shard(cfg: LlamaConfig, rank: int, world_size: int, comm: Comm | None, read: Reader,
                ops: LlamaOps | None = None) -> Llama:
    """Rank ``rank``'s shard of a model of shape ``cfg``, in the form the engine's runner
    fuses: q/k/v and gate/up plain ``nn.Linear`` of the local rows (so each group fuses
    into one GEMM), o and down :class:`~llmnote.parallel.RowParallelLinear` (they
    all-reduce over ``comm``), the output head a
    :class:`~llmnote.parallel.VocabParallelLinear` where the vocabulary splits evenly
    (it gathers the logits over ``comm``), and ``config`` the local shapes (heads, kv heads,
    intermediate size divided), which size the rank's KV cache. Built on the meta device,
    then filled tensor by tensor in state-dict order with ``read(name, spec)``, ``spec``
    from :func:`~llmnote.parallel.shard_spec` (the one statement of the sharding rules):
    the rank never holds more than its shard plus what ``read`` holds at once.
    ``comm=None`` (one rank only): o and down stay ``nn.Linear``, the whole model."""
    check_tp_shapes(cfg, world_size)
    if comm is None and world_size != 1:
        raise ValueError(f"comm=None builds the whole model (world_size=1), got {world_size}")
    loc = local_config(cfg, world_size)
    with torch.device("meta"):  # shapes only: no memory, no random init
        m = Llama(loc, ops=ops)
        for layer in m.model.layers if comm is not None else ():
            for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
                lin = getattr(parent, name)  # (out, in / world_size): the row-parallel shape
                setattr(parent, name, RowParallelLinear(lin.weight, lin.bias, comm))
        if comm is not None and vocab_parallel(cfg, world_size):  # the head's rows split
            m.lm_head = VocabParallelLinear(
                torch.empty(cfg.vocab_size // world_size, cfg.hidden_size), comm)
    tied = cfg.tie_word_embeddings
    state = {}
    for name, p in m.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        t = read(name, shard_spec(name, cfg, rank, world_size))
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"tensor {name}: rank {rank} of {world_size} got a slice of "
                                  f"shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        state[name] = t
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    m.load_state_dict(state, strict=True, assign=True)
    m.tie_weights()  # assign=True replaced the shared Parameter by two
    return m.eval()


def shard_for_engine(model: Llama, rank: int, world_size: int, comm: Comm) -> Llama:
    """Rank ``rank``'s shard (:func:`build_shard`) cut out of a loaded ``model``, in
    place: its decoder, output head and config become the shard's; returns ``model``."""
    state = model.state_dict()

    def read(name: str, spec: tuple[int, int, int] | None) -> torch.Tensor:
        t = state[name].detach()
        return t if spec is None else shard(t, *spec, name=name)

    out = build_shard(model.config, rank, world_size, comm, read, model.ops)
    model.model, model.lm_head, model.config = out.model, out.lm_head, out.config
    return model


# ---------------------------------------------------------------- where the weights come from
class RandomWeights:
    """The weights ``Llama(cfg)`` holds after ``torch.manual_seed(seed)`` on ``device``
    (its ``nn.Linear`` initialisations drawn while it is built, then normal(0, 0.02) for
    every linear and embedding weight, zero biases, unit norms), cast to ``dtype``, made
    one group at a time in the order ``Llama`` draws them: the embedding, each decoder
    layer, the final norm, the output head. :meth:`read` is a :data:`Reader`: slicing a
    shard out of whole random tensors (a seeded stream cannot be entered midway), it
    holds one fp32 group at most beside the shard: a layer, or a vocabulary-by-hidden
    matrix (the embedding, the output head). Read in state-dict order."""

    def __init__(self, cfg: LlamaConfig, device: torch.device, dtype: torch.dtype,
                 seed: int) -> None:
        _check_dense(cfg, "random weights")
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        torch.manual_seed(seed)
        with torch.device(self.device), torch.no_grad():  # the draws of Llama's construction
            for i in range(cfg.num_hidden_layers):
                DecoderLayer(cfg, i, reference_ops())
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rng = self._get_rng()
        self.group, self.tensors = -1, {}

    def _get_rng(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_rng(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _group_of(self, name: str) -> int:
        if name.startswith("model.embed_tokens."):
            return 0
        if name.startswith("model.layers."):
            return 1 + int(name.split(".")[2])
        return self.cfg.num_hidden_layers + (1 if name.startswith("model.norm.") else 2)

    def _make(self, g: int) -> dict[str, torch.Tensor]:
        cfg, n = self.cfg, self.cfg.num_hidden_layers
        with torch.device("meta"):
            if g == 0:
                mod, prefix = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
                    cfg.vocab_size, cfg.hidden_size)), "model.embed_tokens."
            elif g <= n:
                mod, prefix = DecoderLayer(cfg, g - 1, reference_ops()), f"model.layers.{g - 1}."
            elif g == n + 1:
                mod, prefix = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, reference_ops()), \
                    "model.norm."
            else:
                mod, prefix = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False), "lm_head."
        mod = mod.to_empty(device=self.device)
        self._set_rng(self._rng)
        with torch.no_grad():
            for m in mod.modules():
                if isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)
            mod.apply(Llama._init_weights)
        self._rng = self._get_rng()
        return {prefix + k: v for k, v in mod.state_dict().items()}

    def read(self, name: str, spec: tuple[int, int, int] | None) -> torch.Tensor:
        g = self._group_of(name)
        if g < self.group:
            raise RuntimeError(f"RandomWeights: {name} asked for after a later group; read "
                               "tensors in state-dict order")
        while self.group < g:  # groups skipped (a tied head) are drawn all the same
            self.group += 1
            self.tensors = {}  # one group at a time
            self.tensors = self._make(self.group)
        t = self.tensors[name]
        if spec is not None:
            dim, index, parts = spec
            t = t.narrow(dim, index * (t.shape[dim] // parts), t.shape[dim] // parts)
        return t.to(dtype=self.dtype, memory_format=torch.contiguous_format, copy=True)


def random_model(cfg: LlamaConfig, device=None, dtype: torch.dtype | None = None,
                 seed: int = 0, ops: LlamaOps | None = None) -> Llama:
    """A Llama of shape ``cfg`` with the random weights ``Llama(cfg)`` makes after
    ``torch.manual_seed(seed)`` (normal, std 0.02; norms 1), in ``dtype`` on ``device``
    (defaults: the fast path), made one layer at a time (:class:`RandomWeights`), so the
    peak memory is the model's own plus one fp32 layer (or the fp32 output head), not the
    fp32 model a plain ``Llama(cfg)`` would make first: a 32-layer Llama-3-70B shape is
    59 GB in bf16, 118 GB in fp32. Same ``seed``, same weights on every device of a kind
    (each rank of a benchmark builds the same model)."""
    from llmnote.device import placement

    dev, dt = placement(device, dtype, cpu_dtype=torch.float32)
    return build_shard(cfg, 0, 1, None, RandomWeights(cfg, dev, dt, seed).read, ops)


def _checkpoint_shard(folder: Path, cfg: LlamaConfig, rank: int, world_size: int, comm: Comm,
                      device: torch.device, dtype: torch.dtype | None, ops: LlamaOps | None,
                      check_finite: bool) -> tuple[Llama, int]:
    """This rank's shard read from the safetensors files of ``folder`` (their names and
    whole shapes checked against ``cfg`` first, as :func:`load_pretrained` checks them):
    ``(model, bytes read)``. ``dtype=None``: the checkpoint's (the loader's rule)."""
    from llmnote.models.loader import (
        SliceReader, _check_finite, check_checkpoint, stored_shapes, weight_files,
    )

    files = weight_files(folder)
    expected = check_checkpoint(cfg, stored_shapes(files), folder).state_dict().keys()
    with SliceReader(files) as reader:
        dt = dtype or reader.first_dtype(set(expected))

        def read(name: str, spec: tuple[int, int, int] | None) -> torch.Tensor:
            raw = reader.read(name, *(spec or ()))
            t = raw.to(device=device, dtype=dt, memory_format=torch.contiguous_format, copy=True)
            if check_finite:
                _check_finite(t, raw, files[name], name)
            return t

        model = build_shard(cfg, rank, world_size, comm, read, ops)
        if cfg.tie_word_embeddings and "lm_head.weight" in files:  # a copy kept: the same?
            if not torch.equal(read("lm_head.weight", None), model.lm_head.weight):
                raise CheckpointError(f"{folder / 'config.json'}: tie_word_embeddings is true "
                                      "but lm_head.weight differs from model.embed_tokens.weight")
        return model, reader.bytes_read


def _tokenizer_and_eos(folder: Path) -> tuple[object | None, list[int]]:
    tok = None
    if (folder / "tokenizer.json").is_file():
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    return tok, [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def load_shard(source: tuple, rank: int, world_size: int, comm: Comm, device: torch.device,
               dtype: torch.dtype | None, ops: LlamaOps | None, seed: int) -> tuple:
    """This rank's shard of the model ``source`` names: ``(Llama, whole config, tokenizer or
    None, eos ids, bytes read from files or None)``. ``source``: ``("config", cfg)`` random
    weights of that shape; ``("weights", {...})`` the safetensors file the driver wrote of a
    Llama it was given (its config, ops and dtype beside it); ``("name", str)``
    ``"shakespeare"``, a checkpoint folder or a preset (random weights). Checkpoints are
    read slice by slice, random weights made layer by layer."""
    from llmnote.device import placement
    from llmnote.engine.loading import load_model
    from llmnote.models.hf_config import read_config
    from llmnote.models.presets import PRESETS

    kind, what = source
    if kind == "weights":  # a Llama the driver was given, written to one safetensors file
        dev, dt = placement(device, dtype or what["dtype"])
        model, nbytes = _checkpoint_shard(Path(what["folder"]), what["config"], rank,
                                          world_size, comm, dev, dt,
                                          ops if ops is not None else what["ops"], False)
        return model, what["config"], None, [], nbytes
    if kind == "name" and what == "shakespeare":  # the book's model (its files checked by
        from llmnote.models.shakespeare import (  # the driver): fp32 on the CPU by default
            EOS_TOKEN, check_vocab, checkpoint_dir, load_tokenizer,
        )

        folder = checkpoint_dir()
        cfg = read_config(folder)
        tok = load_tokenizer(folder)
        check_vocab(tok, cfg.vocab_size)
        dev, dt = placement(device, dtype, cpu_dtype=torch.float32)
        model, nbytes = _checkpoint_shard(folder, cfg, rank, world_size, comm, dev, dt, ops,
                                          False)
        return model, cfg, tok, [tok.token_to_id(EOS_TOKEN)], nbytes
    if kind == "name" and Path(what).is_dir():  # a checkpoint folder
        folder = Path(what)
        cfg = read_config(folder)
        check_tp_shapes(cfg, world_size)
        dev, dt = placement(device, dtype)
        # a checkpoint's weights are checked for NaN and inf on the way in
        model, nbytes = _checkpoint_shard(folder, cfg, rank, world_size, comm, dev, dt, ops,
                                          True)
        return (model, cfg) + _tokenizer_and_eos(folder) + (nbytes,)
    if kind == "config" or what in PRESETS:  # random weights
        cfg = what if kind == "config" else PRESETS[what]
        dev, dt = placement(device, dtype, cpu_dtype=torch.float32)
        return (build_shard(cfg, rank, world_size, comm, RandomWeights(cfg, dev, dt, seed).read,
                            ops), cfg, None, [], None)
    load_model(what, dtype, device, ops, seed)  # not a model: its error
    raise ValueError(f"model {what!r} cannot be served with tensor parallelism")


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


def rank_main(rank: int, world_size: int, port: int, backend: str, conn, source: tuple,
            config: EngineConfig, dtype, ops: LlamaOps | None) -> None:
    """One rank: load, shard, build a runner, then run the batches the driver sends."""
    code = 0
    try:
        if backend == "nccl":
            # NVLink multicast (NVLS) off unless asked for: on a shared host it can take
            # GPUs out of service, and a tensor-parallel pair gains little from it
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # Comm._symmetric_empty
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
        comm = Comm()
        model, full, tok, eos, nbytes = load_shard(source, rank, world_size, comm, dev, dtype,
                                                   ops, config.seed)
        one_shot = "off (one_shot_all_reduce=False)"
        if backend == "nccl" and config.one_shot_all_reduce:
            why = comm.use_one_shot(dev, dtype=next(model.parameters()).dtype)
            one_shot = "on" if why is None else f"off: {why}"
        fused = "off (fused_all_reduce=False)"
        if backend == "nccl" and config.fused_all_reduce:
            why = comm.use_fused_norm(dev, dtype=next(model.parameters()).dtype,
                                      timeout_s=config.distributed_timeout_s)
            fused = "on" if why is None else f"off: {why}"
        load = {"weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "bytes_read": nbytes,
                "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                else None}
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # what loading held beside the shard
        runner = _runner(model, config, dev)
        info = {"load": load, "one_shot_all_reduce": one_shot, "fused_all_reduce": fused}
        if rank == 0:
            info.update({"config": full, "tokenizer": tok, "eos": eos,
                         "num_blocks": runner.num_blocks, "decode_steps": runner.decode_steps,
                         "max_model_len": runner.max_model_len, "backend": runner.backend,
                         "graphs": runner.use_graphs})
        conn.send(("ready", info))
        seqs: dict[int, Sequence] = {}
        runs: dict = {}  # multi-step runs launched and not yet collected, by the driver's id
        prof = None  # a torch.profiler session between ("profile", True) and ("profile", False)
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "close":
                break
            if kind == "profile":  # every rank answers: a start once started, a stop with
                from llmnote.bench.profiling import start_trace, stop_trace  # its trace

                if msg[1]:
                    prof = prof or start_trace(cuda=dev.type == "cuda")
                    conn.send(("profile", msg[2], None))
                else:
                    conn.send(("profile", msg[2], None if prof is None else stop_trace(prof)))
                    prof = None
                continue
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
    runner = ModelRunner(model, config.replace(num_blocks=int(t.item()), gemv=False,
                                               tensor_parallel_size=1))
    # no parallel compile of the first step: its compile-only forward would run the
    # all-reduces too, and a rank whose compile-only pass stopped early would leave its
    # peers waiting in one; each kernel compiles at its first launch instead
    runner._cold = False
    return runner


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

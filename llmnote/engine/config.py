"""The engine's settings, one frozen dataclass (``EngineConfig``).

Build one with keyword arguments and pass it to the engine; ``replace`` returns a changed copy.
Every field is checked in ``__post_init__`` (``ValueError``).

* **KV cache**: ``num_blocks`` blocks of ``block_size`` token slots per layer. ``num_blocks=None``
  sizes it on a GPU from ``gpu_memory_utilization`` (in (0, 1]) of the memory free after the
  weights load; on the CPU it is ``cpu_num_blocks``. ``block_size=None`` lets the engine choose
  for its model: :data:`DEFAULT_BLOCK_SIZE`, but 64 for a latent-attention model whose decode
  the Gluon kernel takes (a Hopper GPU, bf16/fp16, DeepSeek's widths:
  :func:`llmnote.ops.attention.mla_decode.preferred_page`), as vLLM does for FlashMLA.
* **Work per step**: at most ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens
  (prefill chunks plus one per decoding sequence). Without chunked prefill a prompt must fit the
  budget in one step, so the budget must be at least ``max_model_len``.
* **CUDA graphs** (``cuda_graphs``): ``None`` captures the decode step when the model is on a CUDA
  GPU, else runs eagerly; ``True`` is refused (``ValueError`` at build) off one; ``False``: always
  eager. A mixture of experts run by the reference ``fused_moe_ref`` (``ops=reference_ops()``)
  waits for the GPU, so it cannot be captured: ``None`` then runs eagerly, ``True`` is refused.
  Graphs exist for batch 1, 2, 4, 8, ... below ``max_num_seqs`` and for it; a ``B``-sequence
  step replays the smallest graph of at least ``B``, padded rows writing to a scratch block.
* **Multi-step decoding** (``decode_steps``): when every running sequence decodes and none waits,
  up to ``decode_steps`` steps run back to back on the device, tokens read by the host once at the
  end (vLLM's multi-step scheduling); tokens after a sequence's stop are dropped. ``None``: 8 with
  CUDA graphs, else 1 (off). ``async_scheduling`` also queues the next run before reading the one
  in flight, so the GPU never waits for the host; the tokens are the same either way (tested).
* ``tune_graph`` (GPU, batch-1 GEMV path, off by default) times the captured batch-1 graph once per
  GEMV tile candidate and keeps the fastest: seconds at start-up (once per process and model shape)
  for a few per cent of batch-1 decode time. ``dependent_launches``: programmatic dependent launch
  between the graph's kernels (Hopper and later, :mod:`llmnote.ops._pdl`), ignored where
  unsupported.
* **Tensor parallelism** (``tensor_parallel_size > 1``): sharded over worker processes
  (:mod:`llmnote.engine.tp_driver`) over ``distributed_backend`` (``None``: NCCL, one GPU per rank,
  when CUDA is available and the engine is not asked for the CPU, else gloo); a step longer than
  ``distributed_timeout_s`` stops the engine with ``TimeoutError``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmnote.engine._check import check_int


GRAPH_DECODE_STEPS = 8  # decode_steps=None with CUDA graphs
DEFAULT_BLOCK_SIZE = 16  # block_size=None, but for a latent cache the Gluon MLA kernel reads
# gemv=None: the bf16 batch-1 GEMV path for models of at most this hidden size. Its fused
# prologues make every program re-read the whole input rows; measured on the H100 that
# pays for Qwen3-0.6B (hidden 1024) and costs for Llama-3-8B (hidden 4096, 6.6 -> 7.2 ms
# per batch-1 step), see ModelRunner._gemv_ready. An int4 model takes its fused path
# only with gemv=True (it measured slower at both sizes, see ModelRunner._w4_ready).
GEMV_MAX_HIDDEN = 2048


@dataclass(frozen=True)
class EngineConfig:
    block_size: int | None = None  # None: chosen for the model (LLM), else DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None  # None: from GPU memory, or cpu_num_blocks on the CPU
    cpu_num_blocks: int = 256
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str | None = None  # "reference" | "flash" | "paged"; None: see
    # model_runner.default_backend (paged on a GPU where its shapes allow, else flash)
    seed: int = 0  # the generator of requests that carry no seed of their own
    cuda_graphs: bool | None = None  # None: on where the model is on a CUDA GPU and capturable
    decode_steps: int | None = None  # None: 8 with CUDA graphs, else 1
    async_scheduling: bool = True  # queue the next decode run before reading this one
    dependent_launches: bool = True  # PDL between the graph's kernels (Hopper+; llmnote.ops._pdl)
    gemv: bool | None = None  # batch-1 steps with the norms folded into the GEMVs; None: bf16
    # models of hidden <= GEMV_MAX_HIDDEN (int4 models only with True)
    tune_graph: bool = False  # GEMV tiles of the batch-1 decode graph chosen by timing that graph
    tensor_parallel_size: int = 1  # > 1: sharded over worker processes (engine.tp_driver)
    distributed_backend: str | None = None  # "nccl" | "gloo"; None: nccl on GPUs, else gloo
    distributed_timeout_s: float = 600.0  # the longest a tensor-parallel step (or start) may take
    one_shot_all_reduce: bool = True  # NCCL ranks: small all-reduces by symmetric memory (Comm)
    fused_all_reduce: bool = True  # NCCL ranks: all-reduce + residual add + norm, one kernel

    def __post_init__(self) -> None:
        for name in ("cpu_num_blocks", "max_num_batched_tokens", "max_num_seqs"):
            check_int(name, getattr(self, name), min_value=1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, min_value=1)
        if self.distributed_backend not in (None, "nccl", "gloo"):
            raise ValueError("distributed_backend must be None, 'nccl' or 'gloo', got "
                             f"{self.distributed_backend!r}")
        if not (isinstance(self.distributed_timeout_s, (int, float))
                and not isinstance(self.distributed_timeout_s, bool)
                and self.distributed_timeout_s > 0):
            raise ValueError("distributed_timeout_s must be a number > 0, got "
                             f"{self.distributed_timeout_s!r}")
        for name in ("block_size", "num_blocks", "max_model_len", "decode_steps"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), min_value=1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must lie in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if not (self.gemv is None or isinstance(self.gemv, bool)):
            raise ValueError(f"gemv must be None, True or False, got {self.gemv!r}")
        if not isinstance(self.one_shot_all_reduce, bool):
            raise ValueError("one_shot_all_reduce must be True or False, got "
                             f"{self.one_shot_all_reduce!r}")
        if not isinstance(self.fused_all_reduce, bool):
            raise ValueError("fused_all_reduce must be True or False, got "
                             f"{self.fused_all_reduce!r}")
        if not isinstance(self.tune_graph, bool):
            raise ValueError(f"tune_graph must be True or False, got {self.tune_graph!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if not isinstance(self.dependent_launches, bool):
            raise ValueError(f"dependent_launches must be True or False, got {self.dependent_launches!r}")
        if not (self.cuda_graphs is None or isinstance(self.cuda_graphs, bool)):
            raise ValueError(f"cuda_graphs must be None, True or False, got {self.cuda_graphs!r}")
        if self.attention_backend not in (None, "reference", "flash", "paged"):
            raise ValueError("attention_backend must be None, 'reference', 'flash' or 'paged', got "
                             f"{self.attention_backend!r}")

    def replace(self, **changes: object) -> EngineConfig:
        return replace(self, **changes)

    def with_block_size(self, page: int | None = None) -> EngineConfig:
        """This config with ``block_size`` chosen where it is None: ``page`` (what the model's
        attention kernel prefers) or else :data:`DEFAULT_BLOCK_SIZE`."""
        if self.block_size is not None:
            return self
        return self.replace(block_size=page or DEFAULT_BLOCK_SIZE)

"""llmnote's small serving engine (Part V): a paged KV cache with prefix caching,
continuous batching with chunked prefill and preemption, on llmnote's Llama.

One concept per module, as in nano-vllm: :mod:`config`, :mod:`sampling_params`,
:mod:`sequence`, :mod:`block_manager` and :mod:`scheduler` (plain Python),
:mod:`attention` (paged attention: the PyTorch reference, the gather +
FlashAttention-2 varlen path, and the Triton kernel of :mod:`paged_kernel`),
:mod:`sampler` and :mod:`model_runner` (torch), :mod:`speculative` (draft model and
prompt lookup speculation), :mod:`llm` (the entry point)::

    from llmnote.engine import LLM, SamplingParams
    llm = LLM("shakespeare")
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0.8, max_tokens=40))
"""

from llmnote.engine.block_manager import BlockManager, NoFreeBlocks
from llmnote.engine.config import EngineConfig
from llmnote.engine.llm import LLM, RequestOutput, StreamEvent
from llmnote.engine.sampling_params import SamplingParams
from llmnote.engine.scheduler import ScheduledBatch, Scheduler
from llmnote.engine.sequence import Sequence, Status
from llmnote.engine.speculative import SpeculativeConfig

__all__ = [
    "LLM", "BlockManager", "EngineConfig", "NoFreeBlocks", "RequestOutput", "SamplingParams",
    "ScheduledBatch", "Scheduler", "Sequence", "SpeculativeConfig", "Status", "StreamEvent",
]

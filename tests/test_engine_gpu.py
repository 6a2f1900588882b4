"""The engine on a GPU as a reader meets it: the defaults are the fast path, engines fit
a T4's 15 GiB one after the other, and close() gives the memory back."""

import pytest
import torch

from llmnote import device
from llmnote.engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not device.on_gpu(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
T4_BYTES = 15 * 2**30


@pytest.fixture
def t4_cap():
    """This process may use 15 GiB of the GPU, as on a T4 (restored afterwards)."""
    total = torch.cuda.get_device_properties(0).total_memory
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old = get(0) if get is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(old, T4_BYTES / total), 0)
    yield
    torch.cuda.set_per_process_memory_fraction(old, 0)


def test_defaults_are_the_fast_path():
    llm = LLM("shakespeare")
    p = next(llm.model.parameters())
    assert p.is_cuda and p.dtype == device.default_dtype()
    assert llm.model.ops.for_device(p.device).name.startswith("kernels")
    assert llm.runner.use_graphs and llm.runner.use_gemv and llm.runner.backend == "paged"
    assert not llm.runner.graphs  # captured when a step of that size first runs
    out = llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and sorted(llm.runner.graphs) == [1]
    assert llm.runner.num_graph_steps > 0
    llm.close()


def test_five_engines_one_after_the_other_fit_a_t4(t4_cap):
    for i in range(5):
        if i % 2:  # dropped without close(): the next engine frees it before sizing its cache
            llm = LLM("qwen3-0.6b", max_model_len=2048)
            out = llm.generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)[0]
            del llm
        else:
            with LLM("qwen3-0.6b", max_model_len=2048) as llm:
                out = llm.generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)[0]
        assert len(out.token_ids) == 8
        assert torch.cuda.max_memory_allocated() <= T4_BYTES


def test_close_gives_the_memory_back(t4_cap):
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    # cuBLAS's workspaces (32 MiB each on Hopper) live in PyTorch's allocator once a matmul
    # has run on a stream: PyTorch's, kept for the process, not the engine's
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    before = torch.cuda.memory_allocated()
    llm = LLM("shakespeare", max_model_len=512)
    llm.generate([[1, 2, 3]] * 3, GREEDY, use_tqdm=False)
    held = torch.cuda.memory_allocated() - before
    assert held > 0  # the model, the cache, the graphs
    llm.close()
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    assert torch.cuda.memory_allocated() - before < 0.02 * held
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)


def test_a_cache_that_cannot_hold_one_sequence_is_refused():
    with pytest.raises(ValueError, match="gpu_memory_utilization=1e-06.*max_model_len=512"):
        LLM("shakespeare", max_model_len=512, gpu_memory_utilization=1e-6)

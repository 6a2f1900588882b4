"""Tune the README's engines on this GPU and ship the choices with the package.

    python tools/ship_tuning.py                        # qwen3-0.6b and shakespeare
    python tools/ship_tuning.py --models qwen3-0.6b

On a cold start an engine compiles and times every candidate tile of each GEMV, W4A16
and MoE launch shape it meets (:class:`llmnote.ops._tuning.TuneCache`). This runs each
model's engine with the defaults (so that it meets the shapes a reader's engine meets:
batch 1 and the batched CUDA graphs), then writes every cache's choices to
``llmnote/data/tuned/<gpu>.json``: keys new to the file are added, the ones already
there kept (``--replace``: overwritten). On a GPU of that name the caches take
those choices without timing; commit the file.

The batch-1 GEMV tiles a kernel wins timed alone are not always the graph's best:
for Qwen3-0.6B on the H100 they decoded at 1158 tok/s against 1312 with the set
now in the file, which was measured end to end and written by hand
(``benchmarks/logs/prefix_caching.md``). That is why a run keeps the entries
already in the file: with ``--replace``, compare the engine's batch-1 decode
before committing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def merged(old: dict, new: dict, replace: bool = False) -> dict:
    """Per cache, the file's entries ``old`` and this run's ``new`` (both ``{cache: {key:
    config}}``): a key in both keeps the file's config unless ``replace``. Sorted by key;
    caches with no entry dropped."""
    out = {}
    for name in {*old, *new}:
        a, b = old.get(name, {}), new.get(name, {})
        entries = {**a, **b} if replace else {**b, **a}
        if entries:
            out[name] = dict(sorted(entries.items()))
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "shakespeare"])
    parser.add_argument("--replace", action="store_true",
                        help="overwrite the choices already in the file (default: keep them)")
    args = parser.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("tools/ship_tuning.py: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    import llmnote.ops.gemv  # noqa: F401  (each module makes its cache)
    import llmnote.ops.moe  # noqa: F401
    import llmnote.quant.kernels.w4a16  # noqa: F401
    from llmnote.engine import LLM, SamplingParams
    from llmnote.ops._tuning import CACHES, gpu_file

    for cache in CACHES.values():
        cache.preload({})  # time every candidate: not the choices shipped before
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for name in args.models:
        with LLM(name) as llm:
            for batch in (1, 3, 8):
                llm.generate([[1 + i, 2, 3, 4] for i in range(batch)], params, use_tqdm=False)
    gpu = torch.cuda.get_device_name()
    path = gpu_file(gpu)
    before = json.loads(path.read_text()) if path.is_file() else {}
    old, models = before.get("caches", {}), sorted({*before.get("models", []), *args.models})
    caches = merged(old, {n: c.export() for n, c in CACHES.items()}, args.replace)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                                "models": models, "caches": caches}, indent=1) + "\n")
    print(f"{path.relative_to(ROOT)}: " + ", ".join(f"{n} {len(e)} keys" for n, e in caches.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

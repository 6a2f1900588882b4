"""Start-up of an engine as a notebook meets it (the ``startup`` part of the engine
benchmark, :mod:`llmnote.bench.suites.engine`): ``LLM(...)`` built in a fresh process once
CUDA is up, then its first request, on an empty and on a filled Triton kernel cache.
"""

from __future__ import annotations

import numpy as np

from llmnote.bench.harness import Timing, rows_for
from llmnote.bench.results import environment

_STARTUP = """
import json, sys, time
t0 = time.perf_counter()
import torch
from llmnote.engine import LLM, SamplingParams
if torch.cuda.is_available():  # the CUDA context, as a notebook's setup cell makes it
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
t1 = time.perf_counter()
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
t2 = time.perf_counter()
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
llm.generate([list(range(1, 17))], params, use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps(dict(import_and_cuda=t1 - t0, build=t2 - t1, first_request=t3 - t2)))
"""


def startup_rows(model_name: str, repeats: int = 3, bench: str = "engine") -> list[dict]:
    """Start-up of an engine as a notebook meets it, each in a fresh process once CUDA is up:
    ``LLM(...)`` built, then its first request (16 prompt tokens, 8 new) served, which
    compiles and captures what that request needs. ``cold``: Triton's kernel cache empty
    (a new Colab runtime), ``repeats`` processes each on a new cache; ``warm``: the cache
    the first cold run filled (a second run), ``repeats`` processes. The row is the median
    process (its parts; p20/p80 over the processes): one process varied by a second and
    more from run to run on the H100 machine."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    def start(cache: str) -> dict:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        r = subprocess.run([sys.executable, "-c", _STARTUP, model, json.dumps(kw)],
                           capture_output=True, text=True, env=env, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        t = json.loads(r.stdout.strip().splitlines()[-1])
        return {**t, "total": t["build"] + t["first_request"]}

    rows: list[dict] = []
    engines = [("shakespeare", "shakespeare", {}), (model_name, model_name, {"max_model_len": 4096})]
    with tempfile.TemporaryDirectory() as cache:
        for label, model, kw in engines:
            try:
                runs = {"cold": [start(os.path.join(cache, f"{label}-{i}")) for i in range(repeats)]}
                runs["warm"] = [start(os.path.join(cache, f"{label}-0")) for _ in range(repeats)]
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"startup {label}: failed: {e}")
                continue
            for state, ts in runs.items():
                ts = sorted(ts, key=lambda t: t["total"])
                t = ts[len(ts) // 2]
                totals = np.array([u["total"] for u in ts])
                print(f"startup {label} ({state} Triton cache, median of {len(ts)}): "
                      f"{t['total']:.2f} s = build {t['build']:.2f} + first request "
                      f"{t['first_request']:.2f} (import + CUDA context "
                      f"{t['import_and_cuda']:.2f} s before it); every run: "
                      + ", ".join(f"{x:.2f}" for x in totals))
                p20, p80 = (float(np.percentile(totals, q)) * 1e3 for q in (20, 80))
                rows += rows_for(bench, "llmnote", "workload", f"startup-{label}-{state}",
                                 Timing(t["total"] * 1e3, p20, p80),
                                 {"startup": ("s", lambda x, ms: ms / 1e3),  # (p20/p80 too)
                                  **{k: ("s", (lambda x, ms, v=t[k]: v))  # the median run's
                                     for k in ("build", "first_request", "import_and_cuda")}},
                                 {"model": label, "triton_cache": state, "runs": len(ts)},
                                 environment())
    return rows

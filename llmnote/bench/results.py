"""The results store: one CSV per benchmark in ``llmnote/data/results/``.

Shipped as package data, so a notebook on Colab or in CI can plot the recorded
GPU results. Every row names the hardware and software that produced it
(``gpu_name, capability, torch, triton, llmnote_sha, date``).
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import subprocess
from pathlib import Path

import pandas as pd
import torch

from llmnote import device

COLUMNS = [
    "bench", "provider", "x_name", "x_value", "metric", "unit", "p50", "p20", "p80",
    "gpu_name", "capability", "torch", "triton", "llmnote_sha", "date",
]

RESULTS_DIR = Path(__file__).resolve().parent.parent / "data" / "results"


@functools.cache
def _git_sha() -> str:
    """The commit of the code that ran: ``LLMNOTE_SHA`` when set (a copy of the working tree
    whose ``.git`` is not the commit's, e.g. a remote GPU machine), else ``git rev-parse``."""
    import llmnote

    if os.environ.get("LLMNOTE_SHA"):
        return os.environ["LLMNOTE_SHA"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=10", "HEAD"], cwd=Path(__file__).parent,
            capture_output=True, text=True, timeout=5,
        )
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                cwd=Path(llmnote.__file__).parent, capture_output=True, text=True, timeout=5,
            ).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"v{llmnote.__version__}"


def environment() -> dict[str, str]:
    """The hardware/software columns of a result row, read off this machine."""
    cap = device.capability()
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    return {
        "gpu_name": device.gpu_name(),
        "capability": f"{cap[0]}.{cap[1]}" if cap else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "llmnote_sha": _git_sha(),
        "date": _dt.date.today().isoformat(),
    }


def available() -> list[str]:
    """Names of the recorded benchmarks shipped with the package."""
    return sorted(p.stem for p in RESULTS_DIR.glob("*.csv"))


def load(bench: str) -> pd.DataFrame:
    """The recorded results of ``bench`` (a DataFrame with :data:`COLUMNS` first)."""
    path = RESULTS_DIR / f"{bench}.csv"
    if not path.exists():
        raise FileNotFoundError(
            f"no recorded results for bench {bench!r} in {RESULTS_DIR}; recorded: {available()}"
        )
    return pd.read_csv(path)


def save(df: pd.DataFrame, bench: str, out_dir: str | Path | None = None) -> Path:
    """Write ``df`` to ``<out_dir or the package results dir>/<bench>.csv``."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"df is missing the result columns {missing}")
    if df.empty:
        raise ValueError(f"df has no rows: nothing to record for bench {bench!r}")
    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{bench}.csv"
    cols = COLUMNS + [c for c in df.columns if c not in COLUMNS]
    df[cols].to_csv(path, index=False, float_format="%.6g")
    return path


def hardware_label(df: pd.DataFrame) -> str:
    """``"NVIDIA H100 80GB HBM3 (sm_90), torch 2.11.0, triton 3.6.0, 2026-11-21"``."""
    if df.empty:
        return "no results"
    parts = []
    for (gpu, cap, tv, trv, date), _ in df.groupby(
        ["gpu_name", "capability", "torch", "triton", "date"], sort=False
    ):
        where = gpu if cap == "cpu" else f"{gpu} (sm_{str(cap).replace('.', '')})"
        parts.append(f"{where}, torch {tv}, triton {trv}, {date}")
    return "; ".join(parts)


def ceiling(df: pd.DataFrame, provider: str = "copy", metric: str | None = None) -> float | None:
    """The median of a ceiling row recorded in the same run (None when absent)."""
    rows = df[(df["bench"] == "ceiling") & (df["provider"] == provider)]
    if metric is not None:
        rows = rows[rows["metric"] == metric]
    else:
        rows = rows[rows["metric"] != "time"]
    return float(rows["p50"].max()) if len(rows) else None


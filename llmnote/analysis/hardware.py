"""Peak rates of common GPUs, read from ``llmnote/data/hardware.csv``.

Every row names its source (datasheet or whitepaper title and URL). All
FLOP/s figures are *dense*: where a datasheet quotes 2:4 structured-sparsity
rates (marked with an asterisk in NVIDIA's tables), they are halved and the
row says so (``sparse_halved``). A blank cell means the GPU has no tensor-core
path for that dtype (T4: no BF16/TF32/FP8; Ampere: no FP8).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

HARDWARE_CSV = Path(__file__).resolve().parent.parent / "data" / "hardware.csv"

# dtype name -> column of the table
_RATE_COLUMNS = {"fp32": "fp32_tflops", "tf32": "tf32_tflops", "bf16": "bf16_tflops",
                 "fp16": "fp16_tflops", "fp8": "fp8_tflops", "int8": "int8_tops"}
DTYPES = tuple(_RATE_COLUMNS)


def hardware_table() -> pd.DataFrame:
    """The whole table (one row per GPU, dense peaks in TFLOP/s or TOP/s, GB/s, GB, MB)."""
    return pd.read_csv(HARDWARE_CSV)


def known_hardware() -> list[str]:
    return list(hardware_table()["name"])


@dataclass(frozen=True)
class Hardware:
    """One GPU: dense peak rates (FLOP/s), bandwidth (B/s), memory and L2 (bytes)."""

    name: str
    peak_flops: dict[str, float]  # dtype -> FLOP/s (OP/s for int8); only dtypes it has
    bandwidth: float  # bytes/s
    memory: float  # bytes (the datasheet's "GB" read as GiB, 2**30, as the parts carry)
    l2: float  # bytes
    sms: int
    source: str
    url: str
    note: str = ""

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; ``ValueError`` when this GPU has no such path."""
        dtype = _norm_dtype(dtype)
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no {dtype} peak in the table; it has: "
                             f"{', '.join(self.peak_flops)}")
        return self.peak_flops[dtype]

    def ridge(self, dtype: str = "bf16") -> float:
        """Ridge point (FLOP/byte): the arithmetic intensity where memory and compute times meet."""
        return self.peak(dtype) / self.bandwidth


def _norm_dtype(dtype) -> str:
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}
    if isinstance(dtype, torch.dtype):
        if dtype not in names:
            raise ValueError(f"dtype {dtype} has no peak-rate column; known: {', '.join(DTYPES)}")
        return names[dtype]
    d = str(dtype).lower().replace("float32", "fp32").replace("bfloat16", "bf16")
    d = d.replace("float16", "fp16").replace("float8", "fp8")
    if d not in _RATE_COLUMNS:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    return d


def _key(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


def get_hardware(name: str | Hardware) -> Hardware:
    """A GPU by table name or alias (case, spaces and dashes ignored: ``"h100 sxm"``,
    ``"NVIDIA H100 80GB HBM3"``). ``KeyError`` lists the known names."""
    if isinstance(name, Hardware):
        return name
    table = hardware_table()
    want = _key(str(name))
    for _, row in table.iterrows():
        aliases = [row["name"]] + (str(row["aliases"]).split(";") if pd.notna(row["aliases"]) else [])
        if want in {_key(a) for a in aliases}:
            peaks = {d: float(row[c]) * 1e12 for d, c in _RATE_COLUMNS.items() if pd.notna(row[c])}
            return Hardware(
                name=row["name"], peak_flops=peaks, bandwidth=float(row["mem_bw_gbs"]) * 1e9,
                memory=float(row["mem_gb"]) * 2**30, l2=float(row["l2_mb"]) * 2**20,
                sms=int(row["sms"]), source=row["source"], url=row["url"],
                note=row["note"] if pd.notna(row["note"]) else "",
            )
    raise KeyError(f"unknown hardware {name!r}; known: {', '.join(table['name'])}")

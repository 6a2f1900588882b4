"""The speed report of a GPU assignment: the student's kernel against the
reference kernel and the measured copy ceiling, timed with llmnote's one bench
harness (:mod:`llmnote.bench`). GPU only: the interpreter's timings say nothing
about a kernel's speed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

from llmnote import device
from llmnote.bench import ceilings, harness, results


def speed_report(name: str, student: Callable[..., Any], reference: Callable[..., Any],
                 make_args: Callable[[Any], tuple], bytes_moved: Callable[[Any], float],
                 sizes: list[Any], x_name: str = "size") -> pd.DataFrame | None:
    """Bandwidth (GB/s) of ``student(*make_args(x))`` and ``reference(*make_args(x))`` at each
    size, printed with the copy ceiling; ``None`` (and a note) without a GPU."""
    if not device.on_gpu():
        print(f"speed report for {name}: skipped, it needs a CUDA GPU "
              f"(this machine: {device.backend()}). Correctness is checked above.")
        return None

    try:
        student(*make_args(next(iter(sizes))))
    except NotImplementedError:
        print(f"speed report for {name}: skipped, your function is not implemented yet")
        return None
    except Exception as e:  # noqa: BLE001
        print(f"speed report for {name}: skipped, your function raised {type(e).__name__}: {e}")
        return None

    def provider(fn):
        def factory(x):
            args = make_args(x)
            return lambda: fn(*args)
        return factory

    metrics = {"bandwidth": ("GB/s", lambda x, ms: bytes_moved(x) / (ms * 1e-3) / 1e9)}
    df = harness.sweep(name, x_name, sizes, {"student": provider(student),
                                             "reference": provider(reference)},
                       metrics, progress=False)
    df = pd.concat([df, ceilings.copy_bandwidth()], ignore_index=True)
    peak = results.ceiling(df)
    bw = df[(df["metric"] == "bandwidth") & (df["bench"] == name)]
    table = bw.pivot_table(index="x_value", columns="provider", values="p50")
    if peak:
        table["copy ceiling"] = peak
        table["student / ceiling"] = table["student"] / peak
    table["student / reference"] = table["student"] / table["reference"]
    print(f"speed report for {name} (GB/s, median), {results.hardware_label(df)}")
    print(table.round(3).to_string())
    return df

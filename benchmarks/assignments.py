"""Record the assignments on a GPU: `python benchmarks/assignments.py --out DIR`.

Runs every instructor assignment's solution outside Jupyter (the notebooks'
own code, through llmnote.grading.notebooks), then all of its checks, hidden
ones included, compiled on the GPU (not the interpreter), then its speed report
(llmnote.grading.speed_report: the solution against llmnote's kernel and the
copy ceiling, timed with llmnote.bench). Writes `<DIR>/assignments.csv`
through llmnote.bench.results.save, after each step, so an interrupted run
keeps what it finished. On a GPU the checks of all assignments run at once in
worker processes (compiling the kernels is most of their time); the speed
reports are then timed one at a time. See llmnote.grading.record for the rows.
"""

from __future__ import annotations

import argparse
import sys
import time

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402

from llmnote import device  # noqa: E402
from llmnote.bench.results import save  # noqa: E402
from llmnote.grading import ASSIGNMENTS  # noqa: E402
from llmnote.grading.record import checks_table, record, speed_table  # noqa: E402

BENCH = "assignments"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for assignments.csv (default: llmnote/data/results)")
    ap.add_argument("--only", nargs="+", choices=sorted(ASSIGNMENTS), default=None,
                    help="assignments to run (default: all)")
    ap.add_argument("--check-time-limit", type=float, default=300.0, help="seconds per check")
    ap.add_argument("--jobs", type=int, default=None,
                    help="worker processes for the checks (default: one per assignment on a GPU, "
                         "1 on the CPU); the speed reports are timed one at a time")
    args = ap.parse_args(argv)
    print(device.describe())
    if not device.on_gpu():
        print("warning: no GPU: the checks run on the interpreter and the speed reports are skipped")
    names = args.only or list(ASSIGNMENTS)
    jobs = args.jobs or (len(names) if device.on_gpu() else 1)
    t0 = time.perf_counter()
    df = record(names, jobs=jobs, time_limit_s=args.check_time_limit,
                save_to=lambda d: save(d, BENCH, args.out))
    path = save(df, BENCH, args.out)
    with pd.option_context("display.width", 250, "display.max_rows", 200, "display.max_colwidth", 60):
        print(checks_table(df)[["checks_passed", "checks_total"]])
        if (df["metric"] == "bandwidth").any():
            print(speed_table(df).round(3))
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    ok = (df[df["metric"] == "checks passed"]["p50"] == df[df["metric"] == "checks passed"]["x_value"]).all()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

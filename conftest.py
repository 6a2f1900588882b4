"""Per-chapter wall time: with ``LLMNOTE_TIMINGS=path.csv`` set, the time nbval spends
in each notebook (the sum of its cells' setup, call and teardown) is written there at
the end of the run, one row per notebook with the hardware (the columns of
``llmnote.bench.COLUMNS``); when the notebooks run one after another, also as each one
ends, so a run cut short keeps the times of the notebooks it finished. ``make test-gpu``
sets it; ``tools/chapter_times.py`` merges such files into
``llmnote/data/results/chapters.csv``.

Under pytest-xdist (``-n``), a notebook's cells share one kernel, so they must run in
one worker: xdist's default distribution (``load``), and ``worksteal`` when notebooks
are collected, are replaced by ``loadfile``."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

_TIMES: dict[str, float] = defaultdict(float)
_FAILED: set[str] = set()
_SEQUENTIAL: list[bool] = [False]  # one process runs every notebook, in order


def pytest_configure(config):
    """Under pytest-xdist, each worker gets its share of the cores for PyTorch's threads,
    and so do the notebook kernels and student processes it starts (``OMP_NUM_THREADS``):
    otherwise n workers each start a thread per core. (A CPU-side engine test that takes
    2 s alone ran past its 240 s limit beside 11 other test processes on a 16-core GPU
    host.)"""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    _SEQUENTIAL[0] = "PYTEST_XDIST_WORKER" not in os.environ and not (
        config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("OMP_NUM_THREADS", share)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def runs_notebooks(config) -> bool:
    """Whether this run collects notebooks: an argument (or, with none, a ``testpaths``
    entry) that is a ``.ipynb`` file or a folder holding one."""
    for arg in config.args:
        p = Path(str(arg).split("::")[0])
        if p.suffix == ".ipynb" or (p.is_dir() and next(p.rglob("*.ipynb"), None)):
            return True
    return False


@pytest.hookimpl(optionalhook=True)  # (a hook of xdist's, which may not be installed)
def pytest_xdist_make_scheduler(config, log):
    """``-n`` alone (``--dist load``) would send a notebook's cells to different workers,
    each with its own kernel, where a cell misses the names the cells before it defined:
    each file (notebook or test module) goes to one worker instead. ``--dist worksteal``
    would too, so it does the same when the run collects notebooks (and steals single
    tests otherwise). Other ``--dist`` modes are kept."""
    dist = config.getvalue("dist")
    if dist == "load" or (dist == "worksteal" and runs_notebooks(config)):
        from xdist.scheduler import LoadFileScheduling

        return LoadFileScheduling(config, log)
    return None


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        if _SEQUENTIAL[0] and _TIMES and path not in _TIMES:  # the ones before it are done
            _write()
        _TIMES[path] += report.duration
        if report.failed:
            _FAILED.add(path)


def pytest_sessionfinish(session, exitstatus):
    _write()


def _write() -> None:
    out = os.environ.get("LLMNOTE_TIMINGS")
    if not out or not _TIMES:
        return
    from llmnote.bench.suites.chapters import timing_rows, write_rows

    write_rows(timing_rows(dict(_TIMES), _FAILED), Path(out))

"""llmnote.grading, tools/make_student.py and the assignment notebooks.

- the instructor versions pass every check, hidden ones included;
- the generated student versions run top to bottom and every check reports
  "not implemented";
- a deliberately wrong solution of each assignment is caught;
- a solution that computes the answer with llmnote or PyTorch is refused.

The batch grader against adversarial submissions: tests/test_grading_batch.py.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import jupytext
import matplotlib
import nbformat
import pandas as pd
import pytest
import torch

from llmnote import grading
from llmnote.grading import notebooks as gnb
from llmnote.grading import record

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENT_DIR = ROOT / "notebooks" / "assignments" / "instructor"
_spec = importlib.util.spec_from_file_location("make_student", ROOT / "tools" / "make_student.py")
make_student = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_student)

NOTEBOOKS = {a.name: ASSIGNMENT_DIR / f"{a.notebook}.md" for a in grading.ASSIGNMENTS.values()}

# (assignment, text in the instructor's solution, wrong replacement, check that must catch it)
WRONG = [
    ("softmax", "e = tl.exp(x - m)", "e = tl.exp(x)", "large logits"),
    ("softmax", "row * stride_x + cols", "row * n_cols + cols", "non-contiguous rows"),
    ("softmax", "n = tl.minimum(tl.load(len_ptr + row), n_cols)", "n = n_cols",
     "rows of different lengths"),
    ("softmax", 'm = tl.where(m == -float("inf"), 0.0, m)', "m = m", "rows of different lengths"),
    ("rmsnorm", "tl.store(h_ptr + row * stride_h + cols, h, mask=mask)", "pass",
     "odd sizes, every dtype"),
    ("rmsnorm", "tl.store(rstd_ptr + row, rstd)", "tl.store(rstd_ptr + row, rstd * rstd)",
     "odd sizes, every dtype"),
    ("rmsnorm", "for c0 in range(0, N, BLOCK_N):", "for c0 in range(0, BLOCK_N, BLOCK_N):",
     "several tiles per row"),
    ("rmsnorm", "1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)",
     "1.0 / (tl.sqrt(tl.sum(acc, axis=0) / N) + eps)", "zeros, fp16 overflow, eps"),
    ("rmsnorm", "* (w + offset)", "* w", "Gemma offset"),
    ("rmsnorm", "block_n = min(triton.next_power_of_2(n), 4096)", "block_n = triton.next_power_of_2(n)",
     "3-D input, long rows"),
    ("rope", "(a * c - b * sn)", "(a * c + b * sn)", "odd sizes, every dtype"),
    ("rope", "tl.store(y_ptr + base + j, tail, mask=rest)", "pass", "partial rotary_dim"),
    ("rope", "dtype=torch.float64) / r)", "dtype=torch.float64) / d)", "partial rotary_dim"),
    ("flash_attention", "acc * alpha[:, None]", "acc", "odd sizes, every dtype"),
    ("flash_attention", "(m_i + tl.math.log2(l_safe)) / 1.4426950408889634", "m_i + tl.math.log2(l_safe)",
     "odd sizes, every dtype"),
    ("flash_attention", "keep = keep & (cols[None, :] > rows[:, None] + shift - WINDOW)",
     "keep = keep", "sliding window"),
    ("flash_attention", "lo = tl.maximum(start_m + shift - WINDOW + 1, 0)",
     "lo = tl.maximum(start_m + shift - WINDOW + 1 + BLOCK_N, 0)", "sliding window"),
    ("flash_attention", "keep = keep & (cols[None, :] <= rows[:, None] + shift)",
     "keep = keep & (cols[None, :] <= rows[:, None])", "causal, N_q <= N_k"),
    ("paged_decode", "blk = tl.load(BT + b * max_blocks + j).to(tl.int64)", "blk = b * max_blocks + j",
     "odd lengths, every dtype"),
    ("paged_decode", "ok = (slots < BS) & (j * BS + slots < n)", "ok = slots < BS", "odd lengths, every dtype"),
    ("paged_decode", "s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))", "s = s",
     "logit soft-capping"),
    ("int4", "scale = ((hi - lo) / 15)", "scale = ((hi - lo) / 7)", "quantize: odd sizes, every dtype"),
    ("int4", "acc += tl.sum((q - z) * s * x[:, None], axis=0)", "acc += tl.sum(q * s * x[:, None], axis=0)",
     "W4A16 GEMV: odd sizes, every dtype"),
    ("block_manager", "for i in range((len(token_ids) - 1) // bs):", "for i in range(len(token_ids) // bs):",
     "prefix hits"),
    ("block_manager", "h = hash((parent, tokens))", "h = hash((None, tokens))", "prefix hits"),
    ("block_manager", "            self.ref[b] -= 1\n", "            self.ref[b] = 0\n", "prefix hits"),
    ("block_manager", "revived = sum(1 for b in hits if self.ref[b] == 0)", "revived = 0",
     "cached blocks survive free until reused"),
    ("block_manager", "                    self.free_list.move_to_end(b, last=False)\n",
     "                    pass\n", "eviction order"),
    ("block_manager", "        table.clear()\n", "\n", "allocate, free, out of blocks"),
    ("block_manager", "for b in reversed(table):", "for b in table:", "eviction order"),
    ("roofline", "nbytes = 2 * (m * k + k * n + m * n)", "nbytes = 2 * (m * k + k * n)", "matmul roofline"),
    ("roofline", "nbytes = 2 * linear + batch * L * 2 * kv * context_len * 2", "nbytes = 2 * linear",
     "decode step vs llmnote.analysis"),
]


def code_cells(nb) -> list[str]:
    """Code cells without the setup cell (it pip-installs on Colab; here llmnote is imported)."""
    return gnb.code_sources((c.cell_type, c.source) for c in nb.cells)


run_cells = gnb.run_cells


def instructor(name: str) -> nbformat.NotebookNode:
    return jupytext.read(NOTEBOOKS[name], fmt="md:myst")


solved = gnb.solved_notebook  # what a student who got everything right hands in


# ------------------------------------------------------------------ the generator

def test_student_source_stubs_solutions_and_drops_hidden_tests():
    src = ("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n"
           "check(f)\n### BEGIN HIDDEN TESTS\nassert f(1) == 2\n### END HIDDEN TESTS")
    out = make_student.student_source(src)
    assert "return x + y" not in out and "assert f(1)" not in out and "BEGIN" not in out
    assert "    # YOUR CODE HERE\n    raise NotImplementedError" in out
    assert out.startswith("def f(x):\n    y = 1\n") and out.endswith("check(f)")
    ns: dict = {"check": lambda f: None}
    exec(out, ns)  # noqa: S102
    with pytest.raises(NotImplementedError):
        ns["f"](1)


@pytest.mark.parametrize("bad", ["### BEGIN SOLUTION\nx = 1",
                                 "x = 1\n### END SOLUTION",
                                 "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION"])
def test_unbalanced_markers_are_an_error(bad):
    with pytest.raises(make_student.MarkerError, match="SOLUTION"):
        make_student.student_source(bad, "nb, cell 3")


def test_every_assignment_has_a_notebook_with_markers():
    assert set(NOTEBOOKS) == set(grading.ASSIGNMENTS)
    for name, md in NOTEBOOKS.items():
        nb = instructor(name)
        assert make_student.has_markers(nb), md
        student = make_student.make_student(nb, md.stem)
        text = "\n".join(c.source for c in student.cells)
        assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
        assert student.metadata["llmnote"]["assignment"] == md.stem


def test_make_student_cli_writes_handouts(tmp_path):
    assert make_student.main(["--out", str(tmp_path)]) == 0
    written = sorted(p.stem for p in tmp_path.glob("*.ipynb"))
    assert written == sorted(md.stem for md in NOTEBOOKS.values())
    nb = nbformat.read(tmp_path / f"{written[0]}.ipynb", 4)
    nbformat.validate(nb)


# ------------------------------------------------------------------ the assignments

@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_instructor_version_passes_every_check(name):
    ns = run_cells(code_cells(instructor(name)))  # includes the hidden-test asserts
    report = grading.run_checks(grading.get(name), ns, hidden=True)
    assert report.passed, [(r.check, r.status, r.message) for r in report.results]
    assert len(report.results) == len(grading.get(name).checks)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_student_version_runs_and_reports_not_implemented(name, capsys):
    student = make_student.make_student(instructor(name), name)
    ns = run_cells(code_cells(student))  # top to bottom, no exception
    out = capsys.readouterr().out
    assert "[   TODO]" in out and "[   PASS]" not in out
    report = grading.run_checks(grading.get(name), ns, hidden=True)
    assert {r.status for r in report.results} == {grading.NOT_IMPLEMENTED}, report.statuses()
    assert report.score == 0


@pytest.mark.parametrize("name,right,wrong,caught_by", WRONG, ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)])
def test_a_wrong_solution_is_caught(name, right, wrong, caught_by):
    src = code_cells(solved(name))
    assert any(right in c for c in src), f"{right!r} is no longer in the {name} solution"
    ns = run_cells([c.replace(right, wrong) for c in src])
    report = grading.run_checks(grading.get(name), ns, hidden=True)
    status = report.statuses()
    assert status[caught_by] in (grading.FAIL, grading.ERROR), status
    assert not report.passed


def test_engine_block_manager_passes_the_assignment_checks():
    """The assignment's checks take a class: the engine's own passes all of them, so a
    student class that passes them follows the engine's interface and rules."""
    from llmnote.engine import BlockManager

    report = grading.run_checks(grading.get("block_manager"), {"BlockManager": BlockManager},
                                hidden=True, rules=grading.Rules())
    assert report.passed, [(r.check, r.status, r.message) for r in report.results]


def test_a_block_manager_with_another_interface_is_reported():
    """The previous assignment's interface (free instead of free_blocks, commit without
    num_computed) is a clear error, not a pass."""
    ns = run_cells(code_cells(solved("block_manager")))
    cls = ns["BlockManager"]

    class Old(cls):
        def commit(self, table, token_ids):  # noqa: D102
            return super().commit(table, token_ids, len(token_ids))

        free = cls.free_blocks
        free_blocks = property(lambda self: None)

    report = grading.run_checks(grading.get("block_manager"), {"BlockManager": Old}, hidden=True,
                                rules=grading.Rules())
    assert not report.passed
    assert report.statuses()["prefix hits"] == grading.ERROR
    assert "commit" in {r.check: r.message for r in report.results}["prefix hits"]


def test_notebook_reader_without_jupytext(monkeypatch):
    """benchmarks/assignments.py runs where Jupyter's packages may be missing: the small
    MyST reader gives the same code cells as jupytext."""
    import sys

    for name, md in NOTEBOOKS.items():
        with_md = gnb.code_sources(gnb.read_cells(md))
        monkeypatch.setitem(sys.modules, "jupytext", None)
        without = gnb.code_sources(gnb.read_cells(md))
        monkeypatch.delitem(sys.modules, "jupytext")
        assert without == with_md, name


def test_record_rows_on_cpu(tmp_path, capsys):
    """The rows benchmarks/assignments.py writes (here the pure-Python assignments, whose
    notebooks have no speed cell): the standard columns and the check columns."""
    from llmnote.bench import results

    df = record.record(["block_manager", "roofline"], jobs=1, time_limit_s=60,
                       save_to=lambda d: results.save(d, "assignments", tmp_path))
    saved = pd.read_csv(tmp_path / "assignments.csv")
    assert list(saved.columns[: len(results.COLUMNS)]) == results.COLUMNS
    assert len(saved) == len(df) == 2 and set(saved["metric"]) == {"checks passed"}
    checks = record.checks_table(saved)
    assert (checks["checks_passed"] == checks["checks_total"]).all()
    assert checks.loc["a7_block_manager", "checks_total"] == len(grading.get("block_manager").checks)
    assert "drop-in: the engine's scheduler=pass" in checks.loc["a7_block_manager", "check_status"]


def test_speed_table_layout():
    """The appendix's table from rows shaped like a GPU run's (the speed report's rows and
    the copy ceiling; values here are arbitrary, only the arithmetic is checked)."""
    from llmnote.bench.results import environment

    env, rows = environment(), []
    for prov, gbs in [("student", 1.5), ("reference", 3.0)]:
        for metric, v in [("time", 2.0), ("bandwidth", gbs)]:
            rows.append(dict(bench="a1_softmax", provider=prov, x_name="N", x_value=7, metric=metric,
                             unit="", p50=v, p20=v, p80=v, assignment="softmax", **env))
    rows.append(dict(bench="ceiling", provider="copy", x_name="bytes", x_value=1, metric="bandwidth",
                     unit="GB/s", p50=6.0, p20=6.0, p80=6.0, assignment="softmax", **env))
    t = record.speed_table(pd.DataFrame(rows))
    row = t.loc[("a1_softmax", "N", 7)]
    assert row["student / ceiling"] == row["student"] / row["copy ceiling"] == 0.25
    assert row["student / reference"] == 0.5


# ------------------------------------------------------------------ the check runner

@pytest.mark.parametrize("shape", [(), (7,), (2, 3), (3, 1, 4), (2, 3, 4, 5)])
def test_a_mismatch_is_named_by_its_index(shape):
    """The worst elements of a failed comparison are named by their index, as
    torch.unravel_index gives it (computed without it: its first call spends about a third
    of a second importing, enough to turn a graded check's plain mismatch into a timeout)."""
    from llmnote.testing import _unravel, describe_mismatch

    n = math.prod(shape)
    for i in range(n):
        assert _unravel(i, shape) == tuple(int(v) for v in torch.unravel_index(torch.tensor(i), shape))
    expected = torch.zeros(shape)
    actual = expected.clone()
    actual.view(-1)[n - 1] = 3.0  # the last element: every index at its largest
    last = tuple(d - 1 for d in shape)
    assert describe_mismatch(actual, expected).splitlines()[0] == \
        f"  at {last}: got 3, expected 0 (|diff| 3)"


def test_statuses_in_plain_words():
    a = grading.Assignment("demo", "demo", (
        grading.Check("ok", lambda f: f(), ("f",)),
        grading.Check("wrong", lambda f: grading.expect_close(torch.zeros(2, 3), torch.ones(2, 3),
                                                              dtype=torch.float32), ("f",)),
        grading.Check("shape", lambda f: grading.expect_close(torch.zeros(3), torch.ones(2),
                                                              dtype=torch.float32), ("f",)),
        grading.Check("crash", lambda f: [][1], ("f",)),
        grading.Check("forever", lambda f: time.sleep(30), ("f",)),
        grading.Check("todo", lambda g: g(), ("g",)),
        grading.Check("gone", lambda h: h(), ("h",)),
    ), "demo")

    def g():
        raise NotImplementedError

    # the first comparison imports what it needs (sympy, through torch): not under the 0.5 s
    # limit, whose alarm would leave that import half done for the tests after this one
    grading.expect_close(torch.ones(1), torch.ones(1), dtype=torch.float32)
    t0 = time.perf_counter()
    report = grading.run_checks(a, {"f": lambda: None, "g": g}, time_limit_s=0.5)
    assert time.perf_counter() - t0 < 5
    s = report.statuses()
    assert s == {"ok": "pass", "wrong": "fail", "shape": "fail", "crash": "error", "forever": "timeout",
                 "todo": "not implemented", "gone": "missing"}
    msg = {r.check: r.message for r in report.results}
    assert "at (" in msg["wrong"] and "6 of 6" in msg["wrong"]  # where, and how many
    assert "shape (3,)" in msg["shape"]
    assert "IndexError" in msg["crash"]
    assert "h not defined" in msg["gone"]
    assert report.score == 1 and report.max_score == 7


def test_case_names_the_failing_input():
    a = grading.get("softmax")
    report = grading.run_checks(a, {"softmax": lambda x: torch.softmax(x.float(), -1)},
                                rules=grading.Rules())  # PyTorch's softmax allowed here
    first = report.results[0]
    assert first.status == grading.FAIL
    assert "shape (" in first.message and "float16" in first.message and "dtype" in first.message


def test_speed_report_is_gpu_only(capsys):
    if llmnote_on_gpu():
        pytest.skip("on a GPU the speed report runs")
    assert grading.speed_report("x", lambda: None, lambda: None, lambda n: (), lambda n: 1, [1]) is None
    assert "needs a CUDA GPU" in capsys.readouterr().out


def llmnote_on_gpu() -> bool:
    from llmnote import device
    return device.on_gpu()


def test_unknown_assignment_is_a_clear_error():
    with pytest.raises(ValueError, match="assignment must be one of"):
        grading.get("nope")


def test_input_changed_in_place_is_named():
    """Doubling an input in place is reported as that, not as a wrong eps."""
    ns = run_cells(code_cells(solved("rmsnorm")))
    good = ns["add_rmsnorm"]

    def add_rmsnorm(x, residual, weight, eps=1e-6, offset=0.0, block_n=None):
        residual.mul_(2)
        return good(x, residual, weight, eps, offset, block_n)

    report = grading.run_checks(grading.get("rmsnorm"), {"add_rmsnorm": add_rmsnorm}, hidden=True)
    first = report.results[0]
    assert first.status == grading.FAIL
    assert "changed its input `residual` in place" in first.message, first.message


def test_bf16_without_the_upcast_says_so():
    from llmnote import device

    if not device.interpreting():
        pytest.skip("the interpreter's bf16 tl.dot is what this is about")
    src = code_cells(solved("flash_attention"))
    assert any("UPCAST = device.interpreting()" in c for c in src)
    ns = run_cells([c.replace("UPCAST = device.interpreting()", "UPCAST = False") for c in src])
    report = grading.run_checks(grading.get("flash_attention"), ns, hidden=True)
    msg = {r.check: r.message for r in report.results}["odd sizes, every dtype"]
    assert "bfloat16" in msg and "upcast" in msg, msg


# ------------------------------------------------------------------ previews and refusals

PREVIEWED = [  # a solution wrong in a property that only a hidden check graded in full
    ("rmsnorm", "block_n = min(triton.next_power_of_2(n), 4096)",
     "block_n = triton.next_power_of_2(n)", "3-D input, long rows (2 cases; graded with more)"),
    ("flash_attention", "sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale",
     "sm_scale = 1.0 / math.sqrt(D)", "GQA, MQA and sm_scale (2 cases; graded with more)"),
    ("paged_decode", "sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale",
     "sm_scale = 1.0 / math.sqrt(D)", "GQA, MQA and sm_scale (2 cases; graded with more)"),
]


@pytest.mark.parametrize("name,right,wrong,preview", PREVIEWED, ids=[p[0] for p in PREVIEWED])
def test_the_check_cell_previews_every_graded_property(name, right, wrong, preview):
    """Ignoring sm_scale (a4, a5) or a default block_n past Triton's largest tile (a2)
    passed every check of the notebook's check cell and failed only in the grader."""
    src = code_cells(solved(name))
    assert any(right in c for c in src), right
    ns = run_cells([c.replace(right, wrong) for c in src])
    status = grading.run_checks(grading.get(name), ns, quiet=True).statuses()
    assert status[preview] in (grading.FAIL, grading.ERROR), status


def _rope_from_llmnote(x, positions, theta=10000.0, rotary_dim=None):
    from llmnote.ops.rope import rope_ref

    return rope_ref(x.clone(), x.clone(), positions, theta)[0]


def _paged_from_the_grader(q, k_cache, v_cache, block_tables, context_lens, sm_scale=None,
                           softcap=None):
    from llmnote.grading.paged import paged_ref

    return paged_ref(q, k_cache, v_cache, block_tables, context_lens, sm_scale, softcap)


def _quantize_from_llmnote(w, group_size):
    from llmnote.quant.primitives import quantize

    quantize(w.float().T.contiguous(), 4, symmetric=False, granularity="group",
             group_size=group_size)
    raise AssertionError("not reached: the call above is refused")


def _gemv_from_llmnote(x, qweight, scales, zeros, group_size):
    from llmnote.quant.kernels.w4a16_ref import w4a16_linear_ref

    return w4a16_linear_ref(x, qweight, scales, zeros, group_size)


def _engine_block_manager():
    from llmnote.engine.block_manager import BlockManager

    class Mine(BlockManager):
        pass

    return Mine


REFUSALS = [
    ("rope", "rope", _rope_from_llmnote, "llmnote.ops"),
    ("paged_decode", "paged_decode_attention", _paged_from_the_grader, "llmnote.grading"),
    ("int4", "quantize_int4", _quantize_from_llmnote, "llmnote.quant.primitives"),
    ("int4", "w4a16_gemv", _gemv_from_llmnote, "llmnote.quant.kernels"),
    ("block_manager", "BlockManager", _engine_block_manager(), "llmnote.engine"),
]


@pytest.mark.parametrize("name,fn_name,fn,why", REFUSALS,
                         ids=[f"{r[0]}-{r[1]}" for r in REFUSALS])
def test_calling_llmnote_for_the_answer_is_refused(name, fn_name, fn, why):
    a = grading.get(name)
    check = next(c for c in a.checks if c.needs == (fn_name,))
    r = grading.core.run_check(a.name, check, grading.core.guarded({fn_name: fn}, a.rules))
    assert r.status == grading.REFUSED, (r.status, r.message)
    assert why in r.message, r.message


def test_quantized_outputs_on_another_device_are_named():
    """a6 checked the shape and dtype of qweight, scales and zeros, not their device."""
    ns = run_cells([c for c in code_cells(solved("int4"))
                    if "grading.check(" not in c and "speed_report" not in c])
    right = ns["quantize_int4"]

    def on_meta(w, group_size):
        q, s, z = right(w, group_size)
        return q.to("meta"), s, z

    a = grading.get("int4")
    check = next(c for c in a.checks if c.needs == ("quantize_int4",))
    r = grading.core.run_check(a.name, check, {"quantize_int4": on_meta})
    assert r.status == grading.FAIL, (r.status, r.message)
    assert "qweight: device meta" in r.message, r.message

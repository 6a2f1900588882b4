"""The batch grader against adversarial submissions, each with its expected verdict.

Two folders are graded once each (module fixtures): the roofline assignment
(pure Python, so the grader's limits, not the interpreter, are what is timed)
with submissions that stall, kill or fork their process, flood their output,
write files or try to forge the grade; and the softmax assignment (a Triton
kernel, on the interpreter) with submissions that hand in llmnote's kernel,
PyTorch's softmax or PyTorch math instead of a kernel of their own. Then the
command line: ``--assignment`` takes the notebook's name, rows are on disk as
soon as they are graded, Gradescope's results.json is written, and SIGTERM
stops the grader and the student's process at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from llmnote import grading
from llmnote.grading import notebooks as gnb

ROOT = Path(__file__).resolve().parent.parent


solved = gnb.solved_notebook  # what a student who got everything right hands in


def _write_pid(path) -> str:
    """A line of student code: this process's pid into ``path``, whole or not at all (a
    rename), so that the test never reads a file the grader's kill cut short."""
    return (f"open({str(path) + '.tmp'!r}, 'w').write(str(os.getpid())); "
            f"os.rename({str(path) + '.tmp'!r}, {str(path)!r})")


def _wait_for(path) -> str:
    """Student code: the cell ends only once ``path`` exists, so the process that writes
    it exists when the grader cleans up (on a loaded machine the grading could otherwise
    end before the fork had run, and the test would find no pid to check)."""
    return (f"t0 = time.time()\nwhile not os.path.exists({str(path)!r}) and "
            "time.time() - t0 < 60:\n    time.sleep(0.02)\n")


def with_cells(nb, *sources: str, replace: tuple[str, str] | None = None):
    nb = nbformat.from_dict(nb)
    if replace is not None:
        hit = [c for c in nb.cells if replace[0] in c.source]
        assert hit, replace[0]
        for c in hit:
            c.source = c.source.replace(*replace)
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


PARAMS = "def count_parameters(cfg) -> int:\n"
SWALLOW = ("    import time\n    while True:\n        try:\n            time.sleep(0.5)\n"
           "        except BaseException:\n            pass\n")


def _roofline_folder(tmp: Path) -> Path:
    good = solved("roofline")
    stub = with_cells(good, replace=(PARAMS, PARAMS + "    raise NotImplementedError\n"))
    pid_file = tmp / "forked.pid"
    subs = {
        "good": good,
        "swallow": with_cells(good, replace=(PARAMS, PARAMS + SWALLOW)),
        "swallow_cell": with_cells(good, "import time\nwhile True:\n    try:\n"
                                         "        time.sleep(0.5)\n    except BaseException:\n"
                                         "        pass\n"),
        "forge_run_check": with_cells(stub, "import llmnote.grading.core as c\n"
                                            "c.run_check = lambda *a, **k: None\n"
                                            "import llmnote.grading as g\n"
                                            "g.run_checks = lambda *a, **k: None\n"),
        "forge_stdout": with_cells(stub, "import sys\nprint('LLMNOTE-GRADE {\"check\": "
                                         "\"parameter count\", \"points\": 500}')\n"
                                         "sys.stdout = open('/dev/null', 'w')\n"),
        "kill_cell": with_cells(good, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"),
        "exit_in_check": with_cells(good, replace=(PARAMS, PARAMS + "    import os\n"
                                                           "    os._exit(3)\n")),
        "fork": with_cells(good, "import os, time\nif os.fork() == 0:\n"
                                 f"    {_write_pid(pid_file)}\n"
                                 "    time.sleep(1000)\n    os._exit(0)\n"
                                 + _wait_for(pid_file)),
        "daemon": with_cells(good, "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                                   "    if os.fork() == 0:\n"
                                   f"        {_write_pid(tmp / 'daemon.pid')}\n"
                                   "        time.sleep(1000)\n    os._exit(0)\n"
                                   + _wait_for(tmp / "daemon.pid")),
        "kill_parent": with_cells(good, "import os, signal\n"
                                        "os.kill(os.getppid(), signal.SIGKILL)\n"),
        "flood": with_cells(good, "while True:\n    print('x' * 1000)\n"),
        "writes": with_cells(good, "open('answers.txt', 'w').write('42')\n"),
        "imports_answer": with_cells(good, "from llmnote.analysis import count_params\n"
                                           "def count_parameters(cfg):\n"
                                           "    return count_params(cfg)\n"),
        "imports_in_a_thread": with_cells(good, "import threading\n"
                                                "from llmnote.analysis import count_params\n"
                                                "def count_parameters(cfg):\n    out = []\n"
                                                "    t = threading.Thread(target=lambda: "
                                                "out.append(count_params(cfg)))\n"
                                                "    t.start()\n    t.join()\n"
                                                "    return out[0]\n"),
    }
    missing = nbformat.from_dict(good)
    missing.cells = [c for c in missing.cells if "def decode_step_estimate" not in c.source]
    subs["deleted_cells"] = missing
    folder = tmp / "roofline"
    folder.mkdir()
    for stem, nb in subs.items():
        nbformat.write(nb, folder / f"{stem}.ipynb")
    (folder / "notes.txt").write_text("my answers are in the email")
    (folder / "corrupt.ipynb").write_text('{"cells": [')
    return folder


@pytest.fixture(scope="module")
def roofline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grade")
    folder = _roofline_folder(tmp)
    t0 = time.monotonic()
    df = grading.grade_folder(folder, "roofline", out=tmp / "scores.csv", check_time_limit_s=4,
                              cell_time_limit_s=5, notebook_time_limit_s=30,
                              output_limit_bytes=1 << 20, quiet=True)
    elapsed = time.monotonic() - t0
    details = df.attrs["details"].set_index(["student", "check"])
    return df.set_index("student"), details, elapsed, tmp


def status(details, student: str, check: str) -> str:
    return details.loc[(student, check), "status"]


FULL = grading.get("roofline").points
PARAM_CHECK = "parameter count"


def test_good_and_bounded(roofline):
    df, _, elapsed, tmp = roofline
    assert df.loc["good", "total"] == FULL
    assert (df["total"] <= df["max"]).all()
    assert elapsed < 400, elapsed
    rows = (tmp / "scores.csv").read_text().splitlines()
    assert len(rows) == 1 + len(df)


def test_swallowing_loop_in_a_check_is_killed(roofline):
    df, d, _, _ = roofline
    assert status(d, "swallow", PARAM_CHECK) == grading.TIMEOUT
    assert df.loc["swallow", "total"] == FULL - grading.get("roofline").checks[0].points
    assert status(d, "swallow", "matmul roofline") == grading.PASS  # a fresh process


def test_swallowing_loop_in_a_cell_is_killed(roofline):
    df, _, _, _ = roofline
    assert df.loc["swallow_cell", "total"] == FULL
    assert "time limit" in df.loc["swallow_cell", "problems"]


def test_forged_grades_do_not_count(roofline):
    df, d, _, _ = roofline
    for who in ("forge_run_check", "forge_stdout"):
        assert status(d, who, PARAM_CHECK) == grading.NOT_IMPLEMENTED, \
            (who, d.loc[(who, PARAM_CHECK), "message"], df.loc[who, "problems"])
        assert df.loc[who, "total"] == FULL - 1, who


def test_process_that_kills_itself(roofline):
    df, d, _, _ = roofline
    assert df.loc["kill_cell", "total"] == FULL
    assert "SIGKILL" in df.loc["kill_cell", "problems"]
    why = (d.loc[("exit_in_check", PARAM_CHECK), "message"], df.loc["exit_in_check", "problems"])
    assert status(d, "exit_in_check", PARAM_CHECK) == grading.ERROR, why
    assert "exited with code 3" in why[0], why


def test_forked_process_is_killed(roofline):
    df, _, _, tmp = roofline
    assert df.loc["fork", "total"] == FULL
    assert _gone(int((tmp / "forked.pid").read_text()))


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """The process has ended (a zombie that init has not reaped yet counts as ended)."""
    t0 = time.monotonic()
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        if time.monotonic() - t0 > wait_s:
            return False
        time.sleep(0.1)


def test_a_process_that_leaves_the_group_is_killed(roofline):
    """A double fork with ``os.setsid`` (a daemon) between: killing the process group
    missed it, and it outlived the batch."""
    df, _, _, tmp = roofline
    assert df.loc["daemon", "total"] == FULL
    assert _gone(int((tmp / "daemon.pid").read_text()))


def test_killing_its_parent_does_not_stop_the_batch(roofline):
    """The student process's parent is the supervisor, not the grader: killing it (this
    killed the grader, and the whole batch with it) leaves the grading to go on."""
    df, _, _, _ = roofline
    assert df.loc["kill_parent", "total"] == FULL, df.loc["kill_parent", "problems"]
    assert df.loc["writes", "total"] == FULL  # graded after it


def test_flood_and_files(roofline):
    df, _, _, _ = roofline
    assert df.loc["flood", "total"] == FULL
    assert "File too large" in df.loc["flood", "problems"]  # Python ignores SIGXFSZ
    assert "answers.txt" in df.loc["writes", "problems"]


@pytest.mark.parametrize("who", ["imports_answer", "imports_in_a_thread"])
def test_importing_the_answer_is_refused(roofline, who):
    """Also from a thread the function starts (the watch followed the calling thread
    only)."""
    _, d, _, _ = roofline
    assert status(d, who, PARAM_CHECK) == grading.REFUSED, d.loc[(who, PARAM_CHECK), "message"]
    assert "llmnote.analysis" in d.loc[(who, PARAM_CHECK), "message"]


def test_bad_files_get_a_row(roofline):
    df, d, _, _ = roofline
    assert df.loc["notes", "total"] == 0 and "not a notebook" in df.loc["notes", "problems"]
    assert df.loc["corrupt", "total"] == 0
    assert "not a readable notebook" in df.loc["corrupt", "problems"]
    for check, want in (("decode step vs llmnote.analysis", grading.MISSING),
                        (PARAM_CHECK, grading.PASS)):
        assert status(d, "deleted_cells", check) == want, \
            (check, d.loc[("deleted_cells", check), "message"], df.loc["deleted_cells", "problems"])



def test_starting_the_process_is_not_a_cells_time(tmp_path):
    """A cell's time limit is its own code's: starting the student's process (importing
    torch and llmnote, and on a GPU its CUDA context: seconds beside other processes) and
    restarting it after a kill are not counted in it. (With a 5 s limit on a busy GPU
    host, every cell of a notebook timed out while its process started.)"""
    from llmnote.grading.sandbox import StudentProcess

    with StudentProcess(["x = 1", "import os\nos._exit(3)", "y = x + 1"], workdir=tmp_path,
                        cell_time_limit_s=0.5) as proc:
        t0 = time.monotonic()
        notes = proc.run_cells()
        started = time.monotonic() - t0
        assert started > 1.0, "two process starts took under 1 s: this test shows nothing"
        assert proc.good == [0, 2], notes
        assert notes == ["cell 1: the student process exited with code 3"], notes
        assert proc.request("getattr", 0, "y") == 2


# ------------------------------------------------------------------ kernels

STUB_FN = "def softmax(x, lengths=None):\n"


@pytest.fixture(scope="module")
def softmax(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("softmax")
    good = solved("softmax")

    def body(code: str):
        return with_cells(good, f"{STUB_FN}{code}")

    subs = {
        "good": good,
        "llmnote_ops": with_cells(good, "from llmnote.ops import softmax\n"),
        "torch_softmax": body("    return torch.softmax(x, dim=-1)\n"),
        "tensor_method": body("    return x.float().softmax(-1).to(x.dtype)\n"),
        "pytorch_math": body("    e = (x.float() - x.float().amax(-1, keepdim=True)).exp()\n"
                             "    return (e / e.sum(-1, keepdim=True)).to(x.dtype)\n"),
        "patch_checks": with_cells(good, "import llmnote.grading.kernels as k\n"
                                         "k.expect_close = lambda *a, **kw: None\n",
                                   replace=("y = e / tl.where(total == 0.0, 1.0, total)",
                                            "y = e * 0.0")),
        "in_place": body("    x.mul_(1.0)\n    x += 0\n    return x\n"),
        # the answer from PyTorch, then handed to a kernel of the student's that does nothing
        "empty_kernel": with_cells(good, "@triton.jit\ndef touch(o_ptr):\n    pass\n\n"
                                   f"{STUB_FN}    xf = x.float()\n"
                                   "    if lengths is not None:\n"
                                   "        keep = torch.arange(x.shape[-1], device=x.device)"
                                   " < lengths[..., None]\n"
                                   "        xf = xf.masked_fill(~keep, float('-inf'))\n"
                                   "    m = xf.amax(-1, keepdim=True).clamp(min=-1e30)\n"
                                   "    e = (xf - m).exp()\n    s = e.sum(-1, keepdim=True)\n"
                                   "    y = (e / torch.where(s == 0, torch.ones_like(s), s))"
                                   ".to(x.dtype)\n"
                                   "    touch[(1,)](y)\n    return y\n"),
    }
    folder = tmp / "subs"
    folder.mkdir()
    for stem, nb in subs.items():
        nbformat.write(nb, folder / f"{stem}.ipynb")
    df = grading.grade_folder(folder, "a1_softmax", check_time_limit_s=60, quiet=True)
    return df.set_index("student"), df.attrs["details"].set_index(["student", "check"])


def test_kernel_assignment_needs_the_students_kernel(softmax):
    df, d = softmax
    full = grading.get("softmax").points
    assert df.loc["good", "total"] == full
    first = "odd sizes, every dtype"
    for who, why in [("llmnote_ops", "llmnote"), ("torch_softmax", "softmax"),
                     ("tensor_method", "softmax"), ("pytorch_math", "without launching")]:
        assert df.loc[who, "total"] == 0, who
        assert status(d, who, first) == grading.REFUSED, who
        assert why in d.loc[(who, first), "message"], (who, d.loc[(who, first), "message"])


def test_an_empty_kernel_handed_the_answer_is_refused(softmax):
    """Handing a result computed in PyTorch to a kernel that writes nothing passed the
    kernel rule, which only asked that the output be passed to a launch."""
    df, d = softmax
    assert df.loc["empty_kernel", "total"] == 0, df.loc["empty_kernel", "problems"]
    for check in [c.name for c in grading.get("softmax").checks]:
        msg = d.loc[("empty_kernel", check), "message"]
        assert status(d, "empty_kernel", check) == grading.REFUSED, (check, msg)
        assert "wrote nothing" in msg, msg


def test_patching_the_checks_changes_nothing(softmax):
    df, d = softmax
    assert df.loc["patch_checks", "total"] == 0
    assert status(d, "patch_checks", "odd sizes, every dtype") == grading.FAIL


def test_returning_the_input_is_named(softmax):
    _, d = softmax
    msg = d.loc[("in_place", "odd sizes, every dtype"), "message"]
    assert "new tensor" in msg


# ------------------------------------------------------------------ the command line

def _cli(args, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path[1:]))
    return subprocess.Popen([sys.executable, "-m", "llmnote.grading", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_cli_notebook_name_gradescope_and_sigterm(tmp_path):
    folder = tmp_path / "subs"
    folder.mkdir()
    good = solved("roofline")
    nbformat.write(good, folder / "a_good.ipynb")
    nbformat.write(with_cells(good, "import time\nwhile True:\n    try:\n        time.sleep(1)\n"
                                    "    except BaseException:\n        pass\n"),
                   folder / "b_stuck.ipynb")
    out, gs = tmp_path / "scores.csv", tmp_path / "results.json"
    p = _cli([str(folder), "--assignment", "a8_roofline.ipynb", "--out", str(out),
              "--gradescope", str(gs), "--cell-time-limit", "600",
              "--notebook-time-limit", "900"])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:  # the good row is on disk before the batch ends
        if out.exists() and len(out.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    assert len(out.read_text().splitlines()) == 2
    doc = json.loads(gs.read_text())
    assert doc["score"] == FULL and len(doc["tests"]) == len(grading.get("roofline").checks)
    assert {"name", "score", "max_score", "output"} <= set(doc["tests"][0])
    time.sleep(3)  # b_stuck is running its endless cell now
    p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("the grader ignored SIGTERM") from None
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err
    assert "LLMNOTE-GRADE" not in err


def test_unknown_assignment_names_the_choices():
    with pytest.raises(ValueError, match="a1_softmax"):
        grading.get("a9_nothing")
    assert grading.get("a4_flash_attention.ipynb") is grading.get("flash_attention")


def test_gradescope_autograder_zip(tmp_path):
    import zipfile

    from llmnote.grading.gradescope import build_autograder

    out = build_autograder("softmax", tmp_path / "a.zip", "llmnote @ git+https://x/y.git@main")
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == ["run_autograder", "setup.sh"]
        for info in z.infolist():
            assert info.external_attr >> 16 & 0o111, f"{info.filename} is not executable"
        run = z.read("run_autograder").decode()
        setup = z.read("setup.sh").decode()
    assert "--assignment a1_softmax" in run and "/autograder/results/results.json" in run
    assert "'llmnote @ git+https://x/y.git@main'" in setup
    assert run.startswith("#!/usr/bin/env bash") and setup.startswith("#!/usr/bin/env bash")


FA_DEF = "def flash_attention(q, k, v, causal=False, sm_scale=None, window=None):\n"


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    """The FlashAttention submissions that passed before the grader ran checks in its
    own process: each returns the right answer without a kernel of its own."""
    import jupytext

    from llmnote.grading import notebooks as gnb

    tmp = tmp_path_factory.mktemp("attention")
    stub = jupytext.read(gnb.STUDENT_DIR / "a4_flash_attention.md", fmt="md:myst")
    subs = {
        "ops_kernel": FA_DEF + "    return ops.flash_attention(q, k, v, causal=causal, "
                               "sm_scale=sm_scale, return_lse=True)\n",
        "reference": "from llmnote.ops import flash_attention_ref\n" + FA_DEF
                     + "    return flash_attention_ref(q, k, v, causal=causal, "
                       "sm_scale=sm_scale, return_lse=True)\n",
        "sdpa_lse": "import torch.nn.functional as F\n" + FA_DEF
                    + "    g = q.shape[1] // k.shape[1]\n"
                      "    k, v = (t.repeat_interleave(g, 1) for t in (k, v))\n"
                      "    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal,\n"
                      "                                       scale=sm_scale)\n"
                      "    s = (q.float() @ k.float().transpose(-1, -2)) * (\n"
                      "        sm_scale or q.shape[-1] ** -0.5)\n"
                      "    return o, torch.logsumexp(s, -1)\n",
        "pytorch": FA_DEF + "    g = q.shape[1] // k.shape[1]\n"
                            "    k, v = (t.repeat_interleave(g, 1).float() for t in (k, v))\n"
                            "    s = (q.float() @ k.transpose(-1, -2)) * (\n"
                            "        sm_scale or q.shape[-1] ** -0.5)\n"
                            "    m = s.amax(-1, keepdim=True)\n"
                            "    p = (s - m).exp()\n"
                            "    out = (p / p.sum(-1, keepdim=True)) @ v\n"
                            "    lse = (m + p.sum(-1, keepdim=True).log())[..., 0]\n"
                            "    return out.to(q.dtype), lse\n",
    }
    folder = tmp / "subs"
    folder.mkdir()
    for stem, cell in subs.items():  # the kernel cell stays the unfilled stub
        nbformat.write(with_cells(stub, cell), folder / f"{stem}.ipynb")
    df = grading.grade_folder(folder, "flash_attention", check_time_limit_s=60, quiet=True)
    return df.set_index("student"), df.attrs["details"].set_index(["student", "check"])


@pytest.mark.parametrize("who,why", [("ops_kernel", "llmnote.ops"), ("reference", "llmnote.ops"),
                                     ("sdpa_lse", "scaled_dot_product_attention"),
                                     ("pytorch", "without launching")])
def test_attention_without_a_kernel_scores_zero(attention, who, why):
    df, d = attention
    assert df.loc[who, "total"] == 0, df.loc[who, "problems"]
    msg = d.loc[(who, "odd sizes, every dtype"), "message"]
    assert d.loc[(who, "odd sizes, every dtype"), "status"] == grading.REFUSED, msg
    assert why in msg, msg


RMS_DEF = "def add_rmsnorm(x, residual, weight, eps=1e-6, offset=0.0, block_n=None):\n"


@pytest.fixture(scope="module")
def rmsnorm(tmp_path_factory):
    """Assignment 2 from the student page (the kernel cell left as the stub), with
    answers that come from llmnote or PyTorch instead of a kernel of the student's."""
    import jupytext

    tmp = tmp_path_factory.mktemp("rmsnorm")
    stub = jupytext.read(gnb.STUDENT_DIR / "a2_rmsnorm.md", fmt="md:myst")
    rstd = ("    hf = (x + residual).float()\n"
            "    rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)\n")
    subs = {
        "ops_kernel": RMS_DEF + rstd
        + "    y, h = ops.add_rmsnorm(x, residual, weight + offset, eps)\n"
          "    return y, h, rstd\n",
        "rms_norm": "import torch.nn.functional as F\n" + RMS_DEF
        + "    h = x + residual\n"
          "    y = F.rms_norm(h.float(), (h.shape[-1],), weight.float() + offset, eps)\n"
          "    return y.to(x.dtype), h, torch.rsqrt(h.float().pow(2).mean(-1) + eps)\n",
        "pytorch": RMS_DEF + rstd
        + "    y = hf * rstd[..., None] * (weight.float() + offset)\n"
          "    return y.to(x.dtype), x + residual, rstd\n",
        # the student process's guard switched off, the inputs zeroed so that a reference
        # built from them after the call would agree with the zeros returned
        "forge": "import llmnote.grading.guard as g\n"
                 "g.graded_call = lambda n, f, a, k, r=None: f(*a, **k)\n" + RMS_DEF
        + "    x.zero_()\n    residual.zero_()\n"
          "    return (torch.zeros_like(x), torch.zeros_like(x),\n"
          "            torch.zeros(x.shape[:-1], device=x.device))\n",
    }
    folder = tmp / "subs"
    folder.mkdir()
    for stem, cell in subs.items():
        nbformat.write(with_cells(stub, cell), folder / f"{stem}.ipynb")
    nbformat.write(solved("rmsnorm"), folder / "good.ipynb")
    df = grading.grade_folder(folder, "a2_rmsnorm", check_time_limit_s=120, quiet=True)
    return df.set_index("student"), df.attrs["details"].set_index(["student", "check"])


def test_a_patched_guard_cannot_hide_inputs_changed_in_place(rmsnorm):
    """The in-place check and the references are the grader's, from its own tensors."""
    df, d = rmsnorm
    assert df.loc["forge", "total"] == 0, df.loc["forge", "problems"]
    for check in [c.name for c in grading.get("rmsnorm").checks]:
        assert "in place" in d.loc[("forge", check), "message"], check


def test_rmsnorm_good_submission_scores_full(rmsnorm):
    df, _ = rmsnorm
    assert df.loc["good", "total"] == grading.get("rmsnorm").points, df.loc["good", "problems"]


@pytest.mark.parametrize("who,why", [("ops_kernel", "llmnote.ops"), ("rms_norm", "rms_norm"),
                                     ("pytorch", "without launching")])
def test_rmsnorm_without_a_kernel_scores_zero(rmsnorm, who, why):
    df, d = rmsnorm
    assert df.loc[who, "total"] == 0, df.loc[who, "problems"]
    for check in [c.name for c in grading.get("rmsnorm").checks]:
        msg = d.loc[(who, check), "message"]
        assert d.loc[(who, check), "status"] == grading.REFUSED, (check, msg)
        assert why in msg, msg

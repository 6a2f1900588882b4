"""Profiling helpers on the CPU: ncu's raw CSV report parsed from a hand-written
fixture in its documented format, the derived rows, the command line, the
one-line refusals, trace arithmetic (busy time, launch gaps, decode summary), the
NVTX/profiler ranges of the engine, and the recording script's arguments."""

import json
import math

import pandas as pd
import pytest
import torch

from llmnote.bench import profiling as P
from llmnote.bench.suites import profiling as S

# ncu --csv --page raw --print-units base: a header row, a units row, one row per kernel;
# ==PROF== messages and the program's own output interleave on stdout.
NCU_RAW = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
llmnote-case: {"case": "layernorm-bwd", "ideal_bytes": 805306368.0, "flops": 0.0}
==PROF== Profiling "_layernorm_bwd_kernel" - 0: 0%....50%....100% - 38 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","launch__registers_per_thread","sm__warps_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum"
"","","","","","","","","","","","byte","byte","nsecond","register/thread","%","","sector"
"0","4242","python3.12","127.0.0.1","_layernorm_bwd_kernel","1","7","(1024, 1, 1)","(132, 1, 1)","0","9.0","537,395,200","270,532,608","400,000","64","45.5","12.25","1,048,576"
==PROF== Disconnected from process 4242
"""

NCU_COPY = """"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"
"","","","","","","","","","","","Mbyte","Mbyte","usecond"
"0","4243","python3.12","127.0.0.1","vectorized_elementwise_kernel","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0","268.435456","268.435456","200"
"""


def test_parse_ncu_raw_csv_fixture():
    df = P.parse_ncu_csv(NCU_RAW)
    v = dict(zip(df.metric, df.value))
    assert set(df.kernel) == {"_layernorm_bwd_kernel"} and set(df.id) == {0}
    assert v["dram__bytes_read.sum"] == 537_395_200  # thousands separators read
    assert v["gpu__time_duration.sum"] == pytest.approx(400e-6)  # nsecond -> second
    assert dict(zip(df.metric, df.unit))["gpu__time_duration.sum"] == "second"
    # ncu 2025 prints the duration in "ns" although --print-units base is given
    short = P.parse_ncu_csv(NCU_COPY.replace('"usecond"', '"ns"'))
    assert dict(zip(short.metric, short.unit))["gpu__time_duration.sum"] == "second"
    assert dict(zip(short.metric, short.value))["gpu__time_duration.sum"] == pytest.approx(200e-9)
    assert v["sm__warps_active.avg.pct_of_peak_sustained_active"] == 45.5
    assert "Block Size" not in set(df.metric)  # launch dimensions are not metrics
    assert S.case_info(NCU_RAW) == (805306368.0, 0.0)
    c = P.parse_ncu_csv(NCU_COPY)  # scaled units converted
    assert dict(zip(c.metric, c.value))["dram__bytes_read.sum"] == pytest.approx(268435456)
    assert dict(zip(c.metric, c.value))["gpu__time_duration.sum"] == pytest.approx(200e-6)
    assert P.parse_ncu_csv("==PROF== nothing profiled\n").empty
    with pytest.raises(ValueError, match="not an ncu raw CSV report"):
        P.parse_ncu_csv('"a","b"\n"1","2"\n')
    with pytest.raises(TypeError, match="text must be a str"):
        P.parse_ncu_csv(b"bytes")


def test_ncu_rows_derive_bandwidth_and_fraction_of_copy():
    env = {"gpu_name": "GPU", "capability": "9.0", "torch": "t", "triton": "t", "llmnote_sha": "s",
           "date": "d"}
    reports = {"copy": P.parse_ncu_csv(NCU_COPY), "layernorm-bwd": P.parse_ncu_csv(NCU_RAW)}
    ideal = {"copy": (2 * 268435456.0, 0.0), "layernorm-bwd": S.case_info(NCU_RAW)}
    df = pd.DataFrame(S.ncu_rows(reports, ideal, env, "ncu 2025.1"))
    got = df.set_index(["provider", "metric"]).p50
    copy_bw = 2 * 268435456 / 200e-6 / 1e9
    ln_bw = (537_395_200 + 270_532_608) / 400e-6 / 1e9
    assert got["copy", "dram_bandwidth"] == pytest.approx(copy_bw)
    assert got["layernorm-bwd", "dram_bandwidth"] == pytest.approx(ln_bw)
    assert got["layernorm-bwd", "fraction_of_copy"] == pytest.approx(ln_bw / copy_bw)
    assert got["layernorm-bwd", "dram_over_ideal"] == pytest.approx(807_927_808 / 805306368)
    assert got["layernorm-bwd", "stall_long_scoreboard"] == 12.25
    assert (df.tool == "ncu 2025.1").all() and (df.p20 == df.p50).all()
    assert set(df[df.provider == "layernorm-bwd"].kernel) == {"_layernorm_bwd_kernel"}


def test_ncu_command_and_bad_arguments():
    cmd = P.ncu_command(["python", "x.py"], kernel_regex="_attn_fwd", metrics=["a.sum", "b.pct"],
                        launch_skip=2, launch_count=1)
    s = " ".join(cmd)
    assert cmd[0] == "ncu" and cmd[-2:] == ["python", "x.py"]
    for part in ("--csv", "--page raw", "--kernel-name regex:_attn_fwd", "--launch-skip 2",
                 "--launch-count 1", "--profile-from-start off", "--metrics a.sum,b.pct"):
        assert part in s
    with pytest.raises(ValueError, match="kernel_regex"):
        P.ncu_command(["p"], kernel_regex="")
    with pytest.raises(ValueError, match="launch_count must be an int >= 1, got 0"):
        P.ncu_command(["p"], kernel_regex="k", launch_count=0)
    with pytest.raises(ValueError, match="launch_skip"):
        P.ncu_command(["p"], kernel_regex="k", launch_skip=-1)
    with pytest.raises(ValueError, match="target"):
        P.ncu_command([], kernel_regex="k")
    with pytest.raises(TypeError, match="target must be a list of arguments"):
        P.ncu_command("python x.py", kernel_regex="k")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_ncu_refuses_in_one_line_without_a_gpu(capsys):
    why = P.ncu_unavailable()
    assert why and "no CUDA GPU" in why and "\n" not in why
    with pytest.raises(P.NcuUnavailable, match="recorded profile"):
        P.run_ncu(["python", "-c", "pass"], kernel_regex="k")
    assert S.ncu_part(("copy",)) == []
    assert capsys.readouterr().out.strip() == why


def test_ncu_permission_error_is_one_line(monkeypatch):
    import subprocess

    monkeypatch.setattr(P, "ncu_unavailable", lambda: None)
    monkeypatch.setattr(P, "ncu_path", lambda: "/usr/bin/ncu")
    done = subprocess.CompletedProcess([], 1, "==PROF== Connected\n", "==ERROR== ERR_NVGPUCTRPERM - "
                                       "The user does not have permission\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: done)
    with pytest.raises(P.NcuUnavailable, match="not permitted .*ERR_NVGPUCTRPERM") as e:
        P.run_ncu(["python"], kernel_regex="k")
    assert "\n" not in str(e.value)
    done2 = subprocess.CompletedProcess([], 0, NCU_RAW, "")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: done2)
    df, text = P.run_ncu(["python"], kernel_regex="k")
    assert len(df) == 7 and text == NCU_RAW
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        [], 1, "", "==ERROR== Failed to find metric bogus.sum"))
    with pytest.raises(RuntimeError, match="bogus.sum"):
        P.run_ncu(["python"], kernel_regex="k")


def _ev(name, cat, ts, dur, pid=0, tid=1):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def _trace():
    """A prefill step, then two decode steps of 100 us: kernels with gaps, one overlap."""
    ev = [_ev("llmnote.step", "user_annotation", 0, 50),
          _ev("prefill_kernel", "kernel", 10, 30, pid=1),
          _ev("llmnote.step", "user_annotation", 100, 100),
          _ev("llmnote.step", "user_annotation", 200, 100),
          _ev("cudaLaunchKernel", "cuda_runtime", 101, 4),
          _ev("cuLaunchKernelEx", "cuda_driver", 110, 6),
          _ev("void gemv<float, 4>(float*)", "kernel", 110, 20, pid=1),   # gap before: 70 (after prefill)
          _ev("rmsnorm", "kernel", 125, 10, pid=1),  # overlaps the gemv: gap 0
          _ev("void gemv<float, 4>(float*)", "kernel", 150, 20, pid=1),  # gap 15
          _ev("rmsnorm", "kernel", 260, 10, pid=1)]  # gap 90
    return {"traceEvents": ev + [{"name": "process_name", "ph": "M", "pid": 1}]}


def test_busy_time_and_launch_gaps():
    ev = P.trace_events(_trace())
    k = P.kernel_intervals(ev)
    assert P.busy_time(k) == 30 + 25 + 20 + 10  # the overlap counts once
    assert P.busy_time(k, 100, 300) == 25 + 20 + 10
    assert P.busy_time(k, 115, 128) == 13
    gaps = P.launch_gaps(k)
    assert gaps.gap.tolist() == [70, 0, 15, 90]
    assert P.launch_gaps(k.head(1)).empty and P.busy_time(k.head(0)) == 0.0


def test_decode_summary_per_token():
    ev = P.trace_events(_trace())
    stats, gaps, by, window = S.decode_summary(ev, tokens=3)  # two decode tokens
    assert window == (100.0, 300.0)
    assert stats["wall_per_token"] == 100 and stats["kernel_time_per_token"] == 27.5
    assert stats["gpu_busy_fraction"] == pytest.approx(55 / 200)
    assert stats["kernels_per_token"] == 2 and stats["launch_api_per_token"] == 5
    assert gaps.gap.tolist() == [0, 15, 90]  # the decode window's kernels only
    assert by.index[0] == "gemv" and by.loc["gemv", "time_per_token"] == 20
    env = {c: "x" for c in ("gpu_name", "capability", "torch", "triton", "llmnote_sha", "date")}
    rows, _ = S.decode_rows("llmnote-eager", ev, 3, env)
    df = pd.DataFrame(rows)
    assert set(df.bench) == {"profile-decode", "profile-gaps", "profile-kernels"}
    med = df[(df.bench == "profile-gaps") & (df.x_value == 0.5)].p50.item()
    assert med == 15
    with pytest.raises(ValueError, match="at least one decode step"):
        S.decode_summary(ev[ev.ts < 100], tokens=3)


def test_trim_trace_is_small_and_relative():
    out = P.trim_trace(_trace(), 100, 200, cats=("kernel", "user_annotation"), label="eager", pid=2)
    xs = [e for e in out if e["ph"] == "X"]
    assert min(e["ts"] for e in xs) == 0 and all(e["cat"] != "cuda_runtime" for e in xs)
    assert {e["pid"] for e in xs} == {2, 3}  # host, GPU
    assert "gemv" in {e["name"] for e in xs}  # names shortened
    names = {e["args"]["name"] for e in out if e["ph"] == "M"}
    assert names == {"eager host", "eager GPU"}
    assert P.short_name("void at::native::vectorized_elementwise_kernel<4, F>(int, F)") == (
        "at::native::vectorized_elementwise_kernel")


def test_annotate_ranges_show_in_a_cpu_profile(tmp_path):
    from llmnote.nvtx import annotate

    with pytest.raises(ValueError, match="name must be a non-empty str"):
        annotate("")

    def work():
        with annotate("llmnote.test"):
            torch.ones(8).sum()

    work()  # no profiler attached: runs, no error on a CPU build
    ev = P.trace_events(P.profile_trace(work, cuda=False))
    assert len(P.ranges(ev, "llmnote.test")) == 1
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace()))
    assert len(P.trace_events(path)) == 10
    with pytest.raises(ValueError, match="Chrome trace"):
        P.trace_events({"events": []})


def test_engine_steps_are_annotated(tiny_llama):
    from llmnote.engine import LLM, SamplingParams

    # on the CPU (also on a GPU machine): there one step() is one token; on a GPU the
    # engine may decode several tokens in one step (multi-step decoding)
    llm = LLM(tiny_llama, max_model_len=64, num_blocks=16, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ev = P.trace_events(P.profile_trace(lambda: llm.generate([[1, 2, 3]], sp, use_tqdm=False),
                                        cuda=False))
    assert len(P.ranges(ev, "llmnote.step")) == 3  # the prefill and two decode steps
    assert len(P.ranges(ev, "llmnote.run")) >= 1


def test_recording_arguments(capsys):
    with pytest.raises(ValueError, match="parts must be among"):
        S.run(parts=("gpu",))
    with pytest.raises(ValueError, match="cases must be among"):
        S.run(parts=("ncu",), cases=("nope",))
    with pytest.raises(ValueError, match="case must be one of"):
        S.driver("nope")
    assert set(S.CORE.items()) <= set(S.METRICS.items())


def test_reading_helpers_on_derived_rows(capsys, monkeypatch, tmp_path):
    env = {c: "x" for c in ("gpu_name", "capability", "torch", "triton", "llmnote_sha", "date")}
    reports = {"copy": P.parse_ncu_csv(NCU_COPY), "layernorm-bwd": P.parse_ncu_csv(NCU_RAW)}
    df = pd.DataFrame(S.ncu_rows(reports, {"layernorm-bwd": S.case_info(NCU_RAW)}, env, "ncu x"))
    t = S.ncu_table(df)
    assert list(t.index) == ["copy", "layernorm-bwd"]  # in the order of CASES
    assert t.loc["layernorm-bwd", "duration_us"] == pytest.approx(400)
    assert S.top_stalls(df, "layernorm-bwd").to_dict() == {"long_scoreboard": 12.25}
    assert S.pick(df, "copy", "dram_bandwidth") == pytest.approx(2 * 268435456 / 200e-6 / 1e9)
    assert math.isnan(S.pick(df, "copy", "nope")) and math.isnan(S.pick(None, "copy", "duration"))
    monkeypatch.setattr(P, "RESULTS_DIR", tmp_path)
    assert P.recorded_profile() is None
    assert capsys.readouterr().out.strip() == P.NO_RECORDING
    df.to_csv(tmp_path / "profiling.csv", index=False)
    assert len(P.recorded_profile("ncu")) == len(df)
    with pytest.raises(FileNotFoundError, match="no recorded trace"):
        P.recorded_trace()


def test_plot_timeline_draws_host_and_gpu_rows():
    import matplotlib

    matplotlib.use("Agg")
    trace = {"traceEvents": P.trim_trace(_trace(), 100, 300, label="eager", pid=0)}
    ax = P.plot_timeline(trace, width=150)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["eager GPU", "eager host"]
    assert ax.get_xlim() == (0, 150)
    with pytest.raises(ValueError, match="no complete events"):
        P.plot_timeline({"traceEvents": []})


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
def test_decode_profile_on_the_gpu(tmp_path):
    rows = pd.DataFrame(S.decode_part("llama-tiny", new=8, out_dir=tmp_path))
    dec = rows[rows.bench == "profile-decode"].set_index(["provider", "metric"]).p50
    for v in ("llmnote-graphs", "llmnote-eager"):
        assert dec[v, "kernels_per_token"] > 0 and 0 < dec[v, "gpu_busy_fraction"] <= 1
        assert dec[v, "kernel_time_per_token"] <= dec[v, "wall_per_token"]
    trace = P.load_trace(tmp_path / P.TRACE_FILE)
    assert (tmp_path / P.TRACE_FILE).stat().st_size <= S.MAX_TRACE_BYTES
    assert (P.trace_events(trace).cat == "kernel").any()


@needs_gpu
@pytest.mark.skipif(P.ncu_unavailable() is not None, reason="ncu missing")
def test_ncu_on_the_gpu(tmp_path):
    rows = pd.DataFrame(S.ncu_part(("copy", "rmsnorm-fwd"), tmp_path))
    if rows.empty:
        pytest.skip("ncu not permitted here (printed above)")
    t = S.ncu_table(rows)
    assert 0.5 < t.loc["rmsnorm-fwd", "dram_over_ideal"] < 2  # bytes moved ~ bytes needed
    assert 0 < t.loc["rmsnorm-fwd", "fraction_of_copy"] <= 1.2
    assert (tmp_path / "ncu_raw" / "copy.txt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path of the script")
def test_recording_script_without_a_gpu_records_nothing(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "profiling.py"
    spec = importlib.util.spec_from_file_location("profile_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    df = mod.main(["--parts", "ncu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert df.empty and "no CUDA GPU" in out and "nothing recorded" in out
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="cases must be among"):
        mod.main(["--parts", "ncu", "--cases", "copy,nope"])

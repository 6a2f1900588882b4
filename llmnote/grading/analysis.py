"""Checks for assignment 8, a roofline analysis of a model the student chooses:
the student's parameter count, matmul roofline and decode-step estimate are
compared with :mod:`llmnote.analysis` (``count_params``, ``roofline_time``,
``layer_table``) for the student's ``MODEL`` on the student's ``HARDWARE``."""

from __future__ import annotations

import random

from llmnote.analysis import count_params, get_hardware, layer_table, roofline_time
from llmnote.grading.core import Assignment, Check, case
from llmnote.grading.guard import Rules
from llmnote.models.presets import as_config


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)  # numpy / torch scalars
        except (TypeError, ValueError):
            raise AssertionError(f"{what}: expected a number, got {type(value).__name__}") from None
    return float(value)


def _close(got: object, want: float, rtol: float, what: str, hint: str = "") -> None:
    g = _number(got, what)
    if _rel(g, want) > rtol:
        raise AssertionError(f"{what}: got {g:.6g}, llmnote.analysis says {want:.6g} "
                             f"({100 * _rel(g, want):.2g}% off, allowed {100 * rtol:g}%)"
                             + (f". {hint}" if hint else ""))


def _setup(MODEL, HARDWARE):
    try:
        cfg = as_config(MODEL)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"MODEL = {MODEL!r} is not a preset name or HF config: {e}") from None
    try:
        hw = get_hardware(HARDWARE)
    except KeyError as e:
        raise AssertionError(str(e)) from None
    if count_params(cfg) < 1e8:
        raise AssertionError(f"MODEL = {MODEL!r} has fewer than 10^8 parameters: pick a real model "
                             "(a preset such as 'llama-3-8b' or 'qwen3-0.6b', or an HF config); in "
                             "toy models the small terms this assignment leaves out dominate")
    return cfg, hw


def params_check(count_parameters, MODEL, HARDWARE) -> None:
    cfg, _ = _setup(MODEL, HARDWARE)
    with case(f"MODEL = {MODEL!r}"):
        _close(count_parameters(cfg), count_params(cfg), 0.005, "parameter count",
               "Count embeddings, every projection of every layer, the norms, and the LM head "
               "unless it is tied to the embeddings")


def matmul_check(matmul_roofline, MODEL, HARDWARE) -> None:
    _, hw = _setup(MODEL, HARDWARE)
    peak, bw = hw.peak_flops.get("bf16", hw.peak_flops.get("fp16")), hw.bandwidth
    shapes = [(1, 4096, 4096), (random.randint(2, 64), 4096, 11008), (4096, 4096, 4096),
              (random.randint(100, 3000), random.randint(100, 3000), random.randint(100, 3000))]
    for m, n, k in shapes:
        with case(f"(m, n, k) = ({m}, {n}, {k}) on {hw.name}"):
            out = matmul_roofline(m, n, k, hw)
            if not isinstance(out, dict):
                raise AssertionError(f"matmul_roofline must return a dict, got {type(out).__name__}")
            for key in ("flops", "bytes", "intensity", "time_s", "bound"):
                if key not in out:
                    raise AssertionError(f"the dict misses key {key!r}")
            flops, nbytes = 2 * m * n * k, 2 * (m * k + k * n + m * n)
            _close(out["flops"], flops, 1e-6, "flops", "a multiply-add is 2 FLOPs")
            _close(out["bytes"], nbytes, 1e-6, "bytes", "read A and B once, write C once, 2 bytes each")
            _close(out["intensity"], flops / nbytes, 1e-6, "intensity (FLOP/byte)")
            _close(out["time_s"], roofline_time(flops, nbytes, peak, bw), 1e-6, "time_s")
            want = "compute" if flops / nbytes > peak / bw else "memory"
            if out["bound"] != want:
                raise AssertionError(f"bound: got {out['bound']!r}, expected {want!r} (intensity "
                                     f"{flops / nbytes:.3g} vs ridge point {peak / bw:.3g} FLOP/byte)")


def _decode_case(decode_step_estimate, cfg, hw, batch, ctx, label):
    with case(f"{label}, batch {batch}, context {ctx} on {hw.name}"):
        out = decode_step_estimate(cfg, hw, batch, ctx)
        if not isinstance(out, dict) or not {"flops", "bytes", "time_s"} <= set(out):
            raise AssertionError("decode_step_estimate must return a dict with keys flops, bytes, time_s")
        t = layer_table(cfg, hw, batch=batch, phase="decode", context_len=ctx)
        _close(out["flops"], float(t["flops"].sum()), 0.10, "decode flops",
               "2 x batch x (matmul weights) plus attention, 4 x batch x layers x heads x head_dim x context")
        _close(out["bytes"], float(t["bytes"].sum()), 0.10, "decode bytes",
               "every weight once (not the embedding table) plus the KV cache of every sequence")
        _close(out["time_s"], float(t["time_s"].sum()), 0.10, "decode time")


def decode_check(decode_step_estimate, MODEL, HARDWARE) -> None:
    cfg, hw = _setup(MODEL, HARDWARE)
    for batch, ctx in [(1, 512), (1, 8192), (64, 4096), (random.randint(2, 64), random.randint(256, 4096))]:
        _decode_case(decode_step_estimate, cfg, hw, batch, ctx, f"MODEL = {MODEL!r}")


def decode_other_models(decode_step_estimate, MODEL, HARDWARE) -> None:
    for name, hw in [("qwen3-8b", "A100-80GB"), ("llama-2-7b", "H100-SXM")]:
        _decode_case(decode_step_estimate, as_config(name), get_hardware(hw), 4, 2048, name)


ROOFLINE = Assignment(
    name="roofline",
    title="Assignment 8: a roofline analysis of a model you choose",
    notebook="a8_roofline",
    rules=Rules(("analysis",), (), (), "This assignment asks for your own counts."),
    checks=(
        Check("parameter count", params_check, ("count_parameters", "MODEL", "HARDWARE"), 1.0),
        Check("matmul roofline", matmul_check, ("matmul_roofline", "MODEL", "HARDWARE"), 2.0),
        Check("decode step vs llmnote.analysis", decode_check,
              ("decode_step_estimate", "MODEL", "HARDWARE"), 2.0),
        Check("decode step on other models", decode_other_models,
              ("decode_step_estimate", "MODEL", "HARDWARE"), 1.0, hidden=True),
    ),
)

"""Compile, for a GPU, every Triton kernel launch a CPU test run makes: GPU-only compile
errors found on a machine without a GPU.

    python tools/gpu_compile_check.py tests/test_ops_rmsnorm.py -k forward   # pytest args
    python tools/gpu_compile_check.py --arch 80 tests/test_ops_moe.py

Step 1 runs pytest with the given arguments in Triton's interpreter and records each
launch: the kernel, the type of every argument and the value of every constexpr, with
the specialisations the GPU compiler makes (an integer argument equal to 1 becomes a
constexpr, ``None`` too). Step 2, in a process without the interpreter, compiles each
recorded signature for ``cuda:<arch>`` (Triton's frontend, the LLVM backend and ptxas;
no GPU needed) and reports the ones that fail. Exit status 1 when one fails.

What it finds: code the interpreter runs but the compiler refuses, such as a method
called on an argument that the GPU turns into a constexpr (``N.to(...)`` when N is 1), or
a value whose shape differs between the two sides of a branch taken at run time. What
it cannot find: wrong results, races, or code behind constexprs that the CPU run never
sets (``UPCAST`` is compiled as on a GPU, False; block sizes chosen for the CPU stay).
Launches with a TMA tensor descriptor, and kernels defined in test modules, are listed
as not checked.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


# ------------------------------------------------------------------ step 1: record
class Unchecked(Exception):
    """A launch this tool cannot describe (a TMA tensor descriptor argument)."""


def _type_of(value, torch) -> tuple[str, object]:
    """(signature type, constexpr value or None) of one argument, as the GPU specialises."""
    if type(value).__name__ == "TensorDescriptor":
        raise Unchecked("a TMA tensor descriptor argument")
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype], None
    if value is None:
        return "constexpr", None
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        if value == 1:  # Triton specialises an integer argument equal to 1
            return "constexpr", 1
        return ("i64" if abs(value) >= 2**31 else "i32"), None
    if isinstance(value, float):
        return "fp32", None
    return "constexpr", repr(value)


def _is_constexpr(p: inspect.Parameter) -> bool:
    a = p.annotation
    return (isinstance(a, str) and "constexpr" in a) or type(a).__name__ == "constexpr" \
        or getattr(a, "__name__", "") == "constexpr"


def record(out: str, pytest_args: list[str]) -> int:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import pytest
    import torch
    from triton.runtime import interpreter

    global _DTYPES
    _DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
               torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
               torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
    for name, code in (("float8_e4m3fn", "fp8e4nv"), ("float8_e5m2", "fp8e5")):
        if hasattr(torch, name):
            _DTYPES[getattr(torch, name)] = code
    seen: dict[str, None] = {}
    unchecked: dict[str, str] = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        try:
            describe(self, args, kwargs)
        except Unchecked as why:
            unchecked[f"{self.fn.__module__}.{self.fn.__qualname__}"] = str(why)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def describe(self, args, kwargs) -> None:
        params = list(inspect.signature(self.fn).parameters.values())
        values = dict(zip([p.name for p in params], args))
        values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
        sig, const = {}, {}
        for p in params:
            v = values.get(p.name, p.default)
            if _is_constexpr(p):
                sig[p.name], const[p.name] = "constexpr", getattr(v, "value", v)
            else:
                sig[p.name], c = _type_of(v, torch)
                if sig[p.name] == "constexpr":
                    const[p.name] = c
        opts = {k: kwargs[k] for k in LAUNCH_OPTIONS if kwargs.get(k) is not None}
        seen[json.dumps([self.fn.__module__, self.fn.__qualname__, sig, const, opts],
                        sort_keys=True, default=repr)] = None

    interpreter.InterpretedFunction.run = recording_run
    status = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    Path(out).write_text(json.dumps([json.loads(k) for k in seen]))
    print(f"{len(seen)} distinct launches recorded")
    for name, why in sorted(unchecked.items()):
        print(f"not checked: {name} ({why})")
    return int(status)


# ------------------------------------------------------------------ step 2: compile
def _assignment_kernel(name: str):
    """A kernel defined in an instructor assignment notebook (module ``__assignment__``)."""
    import jupytext

    for path in sorted((ROOT / "notebooks/assignments/instructor").glob("*.md")):
        cells = [c.source for c in jupytext.read(path).cells if c.cell_type == "code"]
        if any(f"def {name}(" in c for c in cells):
            ns = {"__name__": "__assignment__"}
            for c in cells:
                exec(compile(c, str(path), "exec"), ns)  # noqa: S102
                if f"def {name}(" in c:
                    return ns[name]
    raise LookupError(f"no instructor notebook defines {name}")


def compile_all(path: str, arch: int) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["LLMNOTE_BACKEND"] = "reference"  # import llmnote without a GPU, uninterpreted
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = skipped = 0
    launches = json.loads(Path(path).read_text())
    for module, qualname, sig, const, opts in launches:
        const = {k: (False if k == "UPCAST" else v) for k, v in const.items()}  # a GPU's value
        try:
            if module == "__assignment__":
                fn = _assignment_kernel(qualname)
            elif module.startswith("test_"):
                print(f"not checked: {module}.{qualname} (defined in a test module)")
                skipped += 1
                continue
            else:
                fn = importlib.import_module(module)
                for part in qualname.split("."):
                    fn = getattr(fn, part)
            while not isinstance(fn, triton.runtime.jit.JITFunction):
                fn = fn.fn  # through autotune / heuristics wrappers
            src = ASTSource(fn=fn, signature=sig,
                            constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
            triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
        except Exception as e:  # report every failing launch, go on with the others
            failed += 1
            lines = str(e).strip().splitlines() or [type(e).__name__]
            shown = {k: v for k, v in const.items() if v is not None}
            print(f"FAIL {module}.{qualname} {shown} {opts}\n     {type(e).__name__}: "
                  + " | ".join(lines[-6:])[:1500])
    print(f"sm_{arch}: {len(launches) - failed - skipped} of {len(launches)} launches compile"
          + (f" ({skipped} not checked)" if skipped else ""))
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--record"]:
        return record(argv[1], argv[2:])
    if argv[:1] == ["--compile"]:
        return compile_all(argv[1], int(argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100)")
    args, pytest_args = parser.parse_known_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        rec = str(Path(tmp) / "launches.json")
        me = [sys.executable, str(Path(__file__).resolve())]
        status = subprocess.run([*me, "--record", rec, *pytest_args], env=env, cwd=ROOT).returncode
        if status not in (0, 5) or not Path(rec).exists():  # 5: no tests collected
            print(f"the test run failed (pytest exit status {status}); nothing compiled")
            return status or 1
        return subprocess.run([*me, "--compile", rec, str(args.arch)], env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

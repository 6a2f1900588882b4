"""Compile a Gluon kernel for a Hopper GPU on any machine, and read what came out.

A ``@gluon.jit`` kernel is never interpreted: Triton's CPU interpreter does not run
Gluon. What a machine without a GPU can do is *compile* it: Triton lowers the
kernel to TTGIR, LLVM IR and PTX, and ``ptxas`` (shipped inside the ``triton``
wheel) assembles the PTX into a cubin for ``sm_90``. :func:`compile_kernel` does
that from a signature and constexpr values, as a launch would, and returns a
:class:`Compiled`: the text of every stage, the registers per thread and the shared
memory per program that ``ptxas`` allotted (read from the cubin with ``cuobjdump``,
also shipped), and :meth:`Compiled.count` to count an instruction in the PTX.

:func:`compile_kernel` takes a ``@triton.jit`` kernel of the package too (an
autotuned one included), so that a Gluon kernel can be set beside its Triton
counterpart: when the kernels run in Triton's interpreter (this machine without a
GPU) every kernel, Gluon's too, is compiled in a child process that imports it
uninterpreted. The interpreter replaces functions of ``triton.language`` while it runs
a kernel, and a device function it runs never puts back those it replaced (Triton
3.9), so after an interpreted run a compile in the same process can reach the
interpreter's builder and fail.

Signature types are Triton's strings: ``"*bf16"`` for a pointer, ``"i32"`` for an
integer, ``"constexpr"`` for a compile-time value, and :func:`tensordesc` for a TMA
tensor descriptor. ``aligned`` names the arguments the launch would find divisible
by 16 (pointers 16-byte aligned, integers multiples of 16): Triton specialises on
that, and vector loads depend on it.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

_TEXT_STAGES = ("ttir", "ttgir", "llir", "ptx")

HOPPER = 90  # compute capability x 10 of the H100


def tensordesc(dtype: str, block_shape: list[int], layout) -> str:
    """The signature type of a Gluon TMA descriptor argument: element type (``"bf16"``),
    the block it copies, and the shared-memory layout of that block."""
    return f"tensordesc<{dtype}[{','.join(str(int(s)) for s in block_shape)}],{layout!r}>"


@dataclass
class Compiled:
    """One compiled kernel: ``asm`` maps a stage (``"ttgir"``, ``"llir"``, ``"ptx"``,
    ``"cubin"``) to its text (bytes for the cubin); ``registers`` per thread and
    ``shared`` bytes of shared memory per program, as ``ptxas`` allotted them."""

    name: str
    asm: dict = field(repr=False)
    registers: int
    shared: int
    spilled: int  # bytes of local memory and stack frame per thread (register spills)
    num_warps: int

    def count(self, instruction: str) -> int:
        """How many PTX lines issue ``instruction`` (a prefix such as ``"wgmma.mma_async"``)."""
        pattern = re.compile(r"^\s*(@!?%\w+\s+)?" + re.escape(instruction))
        return sum(1 for line in self.asm["ptx"].splitlines() if pattern.match(line))

    def layouts(self) -> list[str]:
        """The layouts the TTGIR declares (``#blocked``, ``#mma``, ``#shared``...), one per line."""
        return [line for line in self.asm["ttgir"].splitlines()
                if line.startswith("#") and not line.startswith("#loc")]

    def trace(self, *prefixes: str) -> list[str]:
        """The PTX opcodes starting with one of ``prefixes``, in program order, with the
        basic-block labels (``$L__BB0_2:``, where a branch may land) between them: the
        skeleton of the kernel."""
        out = []
        for line in self.asm["ptx"].splitlines():
            text = re.sub(r"^@!?%\w+\s+", "", line.split("//")[0].strip())
            if re.match(r"^\$L__BB\w+:$", text):
                out.append(text)
            elif text.startswith(prefixes):
                out.append(text.split()[0].rstrip(";"))
        return out

    def lines(self, instruction: str) -> list[str]:
        """The PTX lines that issue ``instruction``, without their guard predicate (``@%p1``)."""
        pattern = re.compile(r"^\s*(@!?%\w+\s+)?" + re.escape(instruction))
        return [re.sub(r"^@!?%\w+\s+", "", line.strip()) for line in self.asm["ptx"].splitlines()
                if pattern.match(line)]


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, SHARED, LOCAL, STACK of the cubin's kernel, from ``cuobjdump --dump-resource-usage``."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                             capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", out))
    return {k: int(v) for k, v in found.items()}


def _jit_function(kernel):
    """The ``JITFunction`` under Triton's autotune / heuristics wrappers (None under the
    interpreter, whose kernels are ``InterpretedFunction``s)."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        inner = getattr(kernel, "fn", None)
        if inner is None or inner is kernel or not hasattr(inner, "__module__"):
            return None
        kernel = inner
    return kernel


def compile_kernel(kernel, signature: dict[str, str], constexprs: dict[str, object] | None = None, *,
                   aligned: tuple[str, ...] = (), num_warps: int = 4, num_stages: int = 3,
                   arch: int = HOPPER, child: bool = False, maxnreg: int | None = None) -> Compiled:
    """Compile ``kernel`` (``@gluon.jit``, or ``@triton.jit`` from an importable module)
    for ``sm_<arch>`` without a GPU.

    ``signature``: every argument's type string, by name (constexprs as
    ``"constexpr"``); ``constexprs``: their values; ``aligned``: arguments to
    specialise as divisible by 16; ``num_warps``: warps per program;
    ``num_stages``: the software-pipelining depth Triton's compiler gives its loops
    (Gluon kernels pipeline by hand and ignore it); ``child``: compile in the child process
    even when this one could (Triton 3.9's Gluon bindings leave IR objects of ``gl.join``,
    ``gl.reshape`` and ``permute`` alive at exit, and nanobind then prints a leak report);
    ``maxnreg``: the registers a thread may take, as the launch's ``maxnreg`` (a
    warp-specialised kernel's partitions share them out).
    """
    from triton.experimental.gluon._runtime import GluonJITFunction

    from llmnote import device

    constexprs = dict(constexprs or {})
    jit = kernel if isinstance(kernel, GluonJITFunction) else _jit_function(kernel)
    if jit is not None:
        _check_arguments(jit, signature, constexprs, aligned)
    if jit is None or child or device.interpreting():  # (module docstring) in a child process
        return _compile_elsewhere(kernel, signature, constexprs, aligned, num_warps, num_stages, arch,
                                  maxnreg)
    return _compile(jit, signature, constexprs, aligned, num_warps, num_stages, arch, maxnreg)


def _check_arguments(kernel, signature, constexprs, aligned) -> None:
    names = list(kernel.arg_names)
    unknown = [n for n in [*signature, *constexprs, *aligned] if n not in names]
    if unknown:
        raise ValueError(f"{kernel.__name__} has no argument(s) {unknown}; its arguments are {names}")
    missing = [n for n in names if n not in signature]
    if missing:
        raise ValueError(f"signature must give a type for every argument of {kernel.__name__}; "
                         f"missing {missing}")


def _compile(kernel, signature, constexprs, aligned, num_warps, num_stages, arch,
             maxnreg=None) -> Compiled:
    """Compile in this process; the arguments are checked (:func:`_check_arguments`)."""
    names = list(kernel.arg_names)
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonJITFunction

    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    src = source(kernel, dict(signature), consts, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    usage = _resource_usage(k.asm["cubin"])
    # spilled registers go to the stack frame (STACK) since CUDA 12's ptxas, not LOCAL
    spilled = usage.get("LOCAL", 0) + usage.get("STACK", 0)
    return Compiled(name=k.metadata.name, asm=dict(k.asm), registers=usage.get("REG", 0),
                    shared=int(k.metadata.shared), spilled=spilled, num_warps=num_warps)


_RESULT = "@@compiled "  # the prefix of the child's answer lines on its stdout
_CHILD: list[subprocess.Popen] = []  # one child process, started on first use, kept for later jobs


def _child() -> subprocess.Popen:
    if _CHILD and _CHILD[0].poll() is None:
        return _CHILD[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LLMNOTE_BACKEND"] = "reference"  # import llmnote without a GPU, uninterpreted
    root = str(Path(__file__).resolve().parents[3])  # the folder holding this llmnote
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    log = tempfile.TemporaryFile("w+")  # the child's stderr: shown if it dies
    proc = subprocess.Popen([sys.executable, "-m", "llmnote.ops.gluon.compile"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    proc.log = log
    _CHILD[:] = [proc]
    atexit.register(proc.stdin.close)  # the child ends when its input does
    return proc


def _compile_elsewhere(kernel, signature, constexprs, aligned, num_warps, num_stages, arch,
                       maxnreg=None) -> Compiled:
    """Compile a kernel in the child process, where the interpreter is off."""
    inner = kernel
    while getattr(inner, "fn", None) is not None and not hasattr(inner, "__code__"):
        inner = inner.fn
    where = (inner.__module__, inner.__qualname__)
    if where[0] in ("__main__", "__assignment__") or "<locals>" in where[1]:
        raise ValueError(f"{where[1]} is not importable from a module; only a module's kernels can "
                         "be compiled in a child process")
    job = dict(where=where, signature=signature, constexprs=constexprs, aligned=list(aligned),
               num_warps=num_warps, num_stages=num_stages, arch=arch, maxnreg=maxnreg)
    proc = _child()
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith(_RESULT):
            out = json.loads(line[len(_RESULT):])
            break
    else:
        proc.log.seek(0)
        raise RuntimeError(f"the compiling child process ended while compiling {where[0]}.{where[1]}; "
                           f"its last words:\n{proc.log.read()[-3000:]}")
    if "error" in out:
        raise RuntimeError(f"compiling {where[0]}.{where[1]} failed:\n{out['error']}")
    out["asm"]["cubin"] = bytes.fromhex(out["asm"]["cubin"])
    return Compiled(**out)


def _main() -> None:
    """The child process of :func:`_compile_elsewhere`: one job as JSON per line of stdin,
    one answer line (``_RESULT`` + JSON: the result, or the error) per job on stdout."""
    for line in sys.stdin:
        try:
            job = json.loads(line)
            module, qualname = job["where"]
            kernel = importlib.import_module(module)
            for part in qualname.split("."):
                kernel = getattr(kernel, part)
            jit, aligned = _jit_function(kernel), tuple(job["aligned"])
            _check_arguments(jit, job["signature"], job["constexprs"], aligned)
            c = _compile(jit, job["signature"], job["constexprs"], aligned,
                         job["num_warps"], job["num_stages"], job["arch"], job.get("maxnreg"))
            asm = {k: v for k, v in c.asm.items() if k in _TEXT_STAGES}
            asm["cubin"] = c.asm["cubin"].hex()
            out = dict(name=c.name, asm=asm, registers=c.registers, shared=c.shared, spilled=c.spilled,
                       num_warps=c.num_warps)
        except Exception:  # the parent raises it, with the child's traceback
            import traceback

            tb = traceback.format_exc()  # (a chain: the first exception, the cause, comes first)
            out = {"error": tb if len(tb) <= 8000 else tb[:5000] + "\n...\n" + tb[-3000:]}
        print(_RESULT + json.dumps(out), flush=True)


if __name__ == "__main__":
    _main()

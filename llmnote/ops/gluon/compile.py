"""Compile a Gluon kernel for a Hopper GPU on any machine, and read what came out.

A ``@gluon.jit`` kernel is never interpreted: Triton's CPU interpreter does not run
Gluon. What a machine without a GPU can do is *compile* it: Triton lowers the
kernel to TTGIR, LLVM IR and PTX, and ``ptxas`` (shipped inside the ``triton``
wheel) assembles the PTX into a cubin for ``sm_90``. :func:`compile_kernel` does
that from a signature and constexpr values, as a launch would, and returns a
:class:`Compiled`: the text of every stage, the registers per thread and the shared
memory per program that ``ptxas`` allotted (read from the cubin with ``cuobjdump``,
also shipped), and :meth:`Compiled.count` to count an instruction in the PTX.

Signature types are Triton's strings: ``"*bf16"`` for a pointer, ``"i32"`` for an
integer, ``"constexpr"`` for a compile-time value, and :func:`tensordesc` for a TMA
tensor descriptor. ``aligned`` names the arguments the launch would find divisible
by 16 (pointers 16-byte aligned, integers multiples of 16): Triton specialises on
that, and vector loads depend on it.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

HOPPER = 90  # compute capability x 10 of the H100


def tensordesc(dtype: str, block_shape: list[int], layout) -> str:
    """The signature type of a Gluon TMA descriptor argument: element type (``"bf16"``),
    the block it copies, and the shared-memory layout of that block."""
    return f"tensordesc<{dtype}[{', '.join(str(int(s)) for s in block_shape)}],{layout!r}>"


@dataclass
class Compiled:
    """One compiled kernel: ``asm`` maps a stage (``"ttgir"``, ``"llir"``, ``"ptx"``,
    ``"cubin"``) to its text (bytes for the cubin); ``registers`` per thread and
    ``shared`` bytes of shared memory per program, as ``ptxas`` allotted them."""

    name: str
    asm: dict = field(repr=False)
    registers: int
    shared: int
    spilled: int  # bytes of local memory per thread (register spills)
    num_warps: int

    def count(self, instruction: str) -> int:
        """How many PTX lines issue ``instruction`` (a prefix such as ``"wgmma.mma_async"``)."""
        pattern = re.compile(r"^\s*(@!?%\w+\s+)?" + re.escape(instruction))
        return sum(1 for line in self.asm["ptx"].splitlines() if pattern.match(line))

    def lines(self, instruction: str) -> list[str]:
        """The PTX lines that issue ``instruction``, stripped."""
        pattern = re.compile(r"^\s*(@!?%\w+\s+)?" + re.escape(instruction))
        return [line.strip() for line in self.asm["ptx"].splitlines() if pattern.match(line)]


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, SHARED, LOCAL of the cubin's kernel, from ``cuobjdump --dump-resource-usage``."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                             capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|SHARED|LOCAL):(\d+)", out))
    return {k: int(v) for k, v in found.items()}


def compile_kernel(kernel, signature: dict[str, str], constexprs: dict[str, object] | None = None, *,
                   aligned: tuple[str, ...] = (), num_warps: int = 4, arch: int = HOPPER) -> Compiled:
    """Compile the Gluon ``kernel`` for ``sm_<arch>`` without a GPU.

    ``signature``: every argument's type string, by name (constexprs as
    ``"constexpr"``); ``constexprs``: their values; ``aligned``: arguments to
    specialise as divisible by 16; ``num_warps``: warps per program.
    """
    constexprs = dict(constexprs or {})
    names = list(kernel.arg_names)
    unknown = [n for n in [*signature, *constexprs, *aligned] if n not in names]
    if unknown:
        raise ValueError(f"{kernel.__name__} has no argument(s) {unknown}; its arguments are {names}")
    missing = [n for n in names if n not in signature]
    if missing:
        raise ValueError(f"signature must give a type for every argument of {kernel.__name__}; "
                         f"missing {missing}")
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(kernel, dict(signature), consts, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    usage = _resource_usage(k.asm["cubin"])
    return Compiled(name=k.metadata.name, asm=dict(k.asm), registers=usage.get("REG", 0),
                    shared=int(k.metadata.shared), spilled=usage.get("LOCAL", 0), num_warps=num_warps)

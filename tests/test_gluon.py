"""llmnote.ops.gluon: the Gluon copy and Hopper matmul.

On every machine (no GPU needed): each kernel compiles for sm_90 with the installed
Triton, and the compiled code holds what the book says it holds (128-bit loads in
the copy; TMA copies, mbarrier waits and ``wgmma.mma_async`` in the matmul; the
shared memory of the ring; no register spills); bad inputs and a missing Hopper GPU
raise clear errors. On a Hopper GPU: results against the references on fresh random
inputs, odd sizes, bf16 and fp16. The matmul refuses K or N that are not multiples
of 8 (TMA's 16-byte rows); M is free.
"""

import importlib

import pandas as pd
import pytest
import torch

from llmnote import device
from llmnote.ops import gluon
from llmnote.ops.gluon import compile_copy, compile_kernel, compile_matmul, copy, copy_ref, matmul, matmul_ref
from llmnote.testing import assert_close_lowp

gmm = importlib.import_module("llmnote.ops.gluon.matmul")  # the module (gluon.matmul is the function)
gcopy = importlib.import_module("llmnote.ops.gluon.copy")
gw4 = importlib.import_module("llmnote.ops.gluon.w4a16")

DTYPES = [torch.bfloat16, torch.float16]
cap = device.capability()
on_hopper = device.on_gpu() and cap is not None and cap[0] == 9
needs_hopper = pytest.mark.skipif(not on_hopper, reason="needs a Hopper GPU (compute capability 9.x)")
needs_gpu = pytest.mark.skipif(not (device.on_gpu() and cap is not None and cap >= (8, 0)),
                               reason="needs a CUDA GPU of compute capability 8.0 or newer")
off_gpu = pytest.mark.skipif(device.on_gpu(), reason="checks the error raised without a GPU")


# --------------------------------------------------------------- compiled for sm_90, any machine
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8], ids=str)
def test_copy_compiles_to_128_bit_accesses(dtype):
    size = torch.empty((), dtype=dtype).element_size()
    c = compile_copy(dtype)
    # 4 runs of 16 bytes per thread per program: four 128-bit loads and four stores, nothing narrower
    assert c.count("ld.global.v4.b32") == 4 and c.count("st.global.v4.b32") == 4
    assert c.count("ld.global") == 4 and c.count("st.global") == 4
    assert c.shared == 0 and c.spilled == 0
    # a length that is not a multiple of 16: the masks fall anywhere, one element per access
    u = compile_copy(dtype, aligned=False)
    assert u.count("ld.global.v") == 0
    assert u.count("ld.global") == 4 * (16 // size)
    assert u.lines("ld.global")[0].split()[0] == f"ld.global.b{8 * size}"


@pytest.mark.parametrize("b_trans", [False, True], ids=["KN", "NK^T"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_compiles_to_tma_mbarriers_and_wgmma(dtype, b_trans):
    cfg = gmm.DEFAULT_CONFIG
    c = compile_matmul(dtype, b_trans=b_trans)
    ptx = c.asm["ptx"]
    t = "bf16" if dtype == torch.bfloat16 else "f16"
    # two warpgroups, each 64 rows x BLOCK_N columns per instruction, 16 deep in K
    wgmma = c.lines("wgmma.mma_async")
    assert len(wgmma) == cfg["BLOCK_K"] // 16
    assert all(w.startswith(f"wgmma.mma_async.sync.aligned.m64n{cfg['BLOCK_N']}k16.f32.{t}.{t}") for w in wgmma)
    assert c.count("wgmma.wait_group.sync.aligned 1") >= 1 and c.count("wgmma.wait_group.sync.aligned 0") >= 1
    # TMA: tile loads into shared memory that complete on an mbarrier, one tile store back
    # (Triton 3.6 writes the destination state space as shared::cluster, later ones shared::cta)
    loads = [x for x in c.lines("cp.async.bulk.tensor.2d.shared") if "mbarrier::complete_tx" in x]
    assert len(loads) == 2 * (cfg["NUM_STAGES"] - 1) + 2  # A and B: in the prologue, then once in the loop
    assert c.count("cp.async.bulk.tensor.2d.global.shared") == 1
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert "ld.global" not in ptx  # every byte of A and B comes through TMA
    ring = cfg["NUM_STAGES"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    assert ring <= c.shared <= ring + cfg["BLOCK_M"] * cfg["BLOCK_N"] * 2 + 1024
    assert c.shared <= 227 * 1024  # an H100's shared memory per block
    assert c.spilled == 0 and c.registers <= 255


# configurations the GPU tests launch (each compiled here first)
CONFIGS = [{}, {"BLOCK_N": 128, "num_warps": 4, "NUM_STAGES": 4}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}]


@pytest.mark.parametrize("b_trans", [False, True], ids=["KN", "NK^T"])
@pytest.mark.parametrize("config", CONFIGS[1:], ids=["128x128w4s4", "64x64w4"])
def test_matmul_config_changes_the_instruction(config, b_trans):
    cfg = {**gmm.DEFAULT_CONFIG, **config}
    c = compile_matmul(torch.float16, b_trans=b_trans, **config)
    assert all(w.startswith(f"wgmma.mma_async.sync.aligned.m64n{cfg['BLOCK_N']}k16")
               for w in c.lines("wgmma.mma_async"))
    assert c.shared >= cfg["NUM_STAGES"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    assert c.spilled == 0


def test_compiled_signature_is_the_launched_one():
    """The descriptors matmul and w4a16_linear build on the host have the signature types the
    compile helpers use (Triton 3.9 spells them out; 3.6 specialises in C++)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from llmnote.ops.gluon import w4a16 as W

    if not hasattr(TensorDescriptor, "__mangle__"):
        pytest.skip("this Triton does not spell out a descriptor's signature type")
    a = torch.zeros(256, 512, dtype=torch.bfloat16)
    for b_trans in (False, True):
        for (block, layout) in gmm._layouts(torch.bfloat16, gmm.DEFAULT_CONFIG, b_trans):
            d = TensorDescriptor(a, list(a.shape), list(a.stride()), block, layout)
            assert d.__mangle__() == gluon.tensordesc("bf16", block, layout)
    x = torch.zeros(5, 128, dtype=torch.float16)
    d = TensorDescriptor(x, list(x.shape), list(x.stride()), [16, W.BLOCK_K], W._x_layout(torch.float16, 16))
    assert d.__mangle__() == gluon.tensordesc("fp16", [16, W.BLOCK_K], W._x_layout(torch.float16, 16))


def test_triton_counterpart_compiles_too():
    """A @triton.jit kernel of the package compiles the same way (in a child process while
    kernels run in the interpreter): Triton's compiler picks the copy's layout itself."""
    va = importlib.import_module("llmnote.ops.vector_add")
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n_elements": "i32",
           "BLOCK": "constexpr", "IS_FLOAT": "constexpr"}
    c = compile_kernel(va._vector_add_kernel, sig, {"BLOCK": 4096, "IS_FLOAT": True},
                       aligned=("x_ptr", "y_ptr", "out_ptr", "n_elements"), num_warps=8)
    assert c.layouts() == ["#blocked = #ttg.blocked<{sizePerThread = [4], threadsPerWarp = [32], "
                           "warpsPerCTA = [8], order = [0]}>"]
    assert c.count("ld.global.v4.b32") == 2 * 4 and c.count("st.global.v4.b32") == 4
    assert c.trace("st.global") == ["st.global.v4.b32"] * 4


def test_compiles_after_the_interpreter_ran(tmp_path, monkeypatch):
    """Triton's interpreter leaves functions of ``triton.language`` replaced after it runs a
    kernel that calls a device function (the fused MoE's kernels do); a compile with an
    empty cache after that still works, since it happens in the child process."""
    import triton
    import triton.language.core as core

    from llmnote.ops.moe import fused_moe, route

    if not device.interpreting():
        pytest.skip("the state the interpreter leaves behind")
    cast = core.cast
    x, w13, w2 = torch.randn(40, 48), torch.randn(4, 80, 48), torch.randn(4, 48, 40)
    fused_moe(x, w13, w2, *route(torch.randn(40, 4), 2, renormalize=True))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))  # nothing cached here
    c = compile_copy(torch.bfloat16)
    assert c.count("ld.global.v4.b32") == 4
    print("triton.language.core.cast replaced by the interpreter:", core.cast is not cast)


def test_compile_kernel_names_bad_arguments():
    sig = {"src_ptr": "*fp32", "dst_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "VEC": "constexpr"}
    with pytest.raises(ValueError, match="missing"):
        compile_kernel(gcopy._copy_kernel, {k: v for k, v in sig.items() if k != "n"}, {"BLOCK": 512, "VEC": 4})
    with pytest.raises(ValueError, match="no argument"):
        compile_kernel(gcopy._copy_kernel, sig, {"BLOCK": 512, "VEC": 4, "WIDTH": 2})
    with pytest.raises(TypeError, match="dtype"):
        compile_matmul(torch.float32)
    with pytest.raises(TypeError, match="unknown config"):
        compile_matmul(torch.bfloat16, BLOCK=64)


# ------------------------------------------------------------------------------ errors
def test_matmul_bad_inputs():
    bf = torch.bfloat16
    a = torch.zeros(16, 32, dtype=bf)
    with pytest.raises(TypeError, match="a must have dtype"):
        matmul(a.float(), torch.zeros(32, 16))
    with pytest.raises(TypeError, match="dtype"):
        matmul(a, torch.zeros(32, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="inner dimensions"):
        matmul(a, torch.zeros(24, 16, dtype=bf))
    with pytest.raises(ValueError, match="multiples of 8"):
        matmul(torch.zeros(16, 20, dtype=bf), torch.zeros(20, 16, dtype=bf))
    with pytest.raises(ValueError, match="multiples of 8"):
        matmul(a, torch.zeros(32, 12, dtype=bf))
    with pytest.raises(ValueError, match="2-D"):
        matmul(torch.zeros(2, 16, 32, dtype=bf), torch.zeros(32, 16, dtype=bf))
    with pytest.raises(ValueError, match="stride 1"):
        matmul(a, torch.zeros(32, 32, dtype=bf)[:, ::2])
    with pytest.raises(ValueError, match="stride 1 in its last"):
        matmul(torch.zeros(32, 16, dtype=bf).t(), torch.zeros(32, 16, dtype=bf))
    with pytest.raises(ValueError, match="non-empty"):
        matmul(torch.zeros(0, 32, dtype=bf), torch.zeros(32, 16, dtype=bf))
    with pytest.raises(TypeError, match="unknown config"):
        matmul(a, torch.zeros(32, 16, dtype=bf), BLOCK=64)


def test_copy_bad_inputs():
    with pytest.raises(TypeError, match="x must have dtype"):
        copy(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        copy(torch.zeros(8, 8).t())
    with pytest.raises(TypeError, match="torch.Tensor"):
        copy([1.0, 2.0])


@off_gpu
def test_no_gpu_error_names_what_is_needed():
    bf = torch.bfloat16
    with pytest.raises(RuntimeError, match=r"compute capability 9\.0 \(Hopper\).*this machine") as e:
        matmul(torch.zeros(16, 32, dtype=bf), torch.zeros(32, 16, dtype=bf))
    assert "llmnote.ops.matmul" in str(e.value)  # and what to use instead
    with pytest.raises(RuntimeError, match=r"compute capability 8\.0 or newer.*this machine"):
        copy(torch.zeros(64))


def test_references():
    a, b = torch.randn(5, 8), torch.randn(8, 3)
    assert torch.equal(matmul_ref(a, b), a @ b)
    x = torch.randn(4, 6).t()
    y = copy_ref(x)
    assert torch.equal(y, x) and y.is_contiguous() and y.data_ptr() != x.data_ptr()
    assert set(gluon.__all__) >= {"copy", "copy_ref", "matmul", "matmul_ref", "compile_kernel"}


# ------------------------------------------------------------------------------ on the GPU
@needs_gpu
@pytest.mark.parametrize("n", [1, 15, 16, 4097, 1 << 20, 3 * (1 << 20) + 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8], ids=str)
def test_copy_on_gpu(n, dtype, seed):
    x = (torch.randn(n, device="cuda") * 50).to(dtype)
    y = copy(x)
    assert torch.equal(y, copy_ref(x)) and y.data_ptr() != x.data_ptr()
    z = copy(x[1:])  # a start address that is not 16-byte aligned: the scalar path
    assert torch.equal(z, x[1:])


# (M, N, K) with M odd, N and K multiples of 8 but not of the tiles: fewer K steps than
# ring slots, more, a one-row product, and tiles past every edge.
SHAPES = [(1, 8, 8), (17, 40, 24), (129, 264, 200), (300, 520, 1000), (1000, 1544, 4104)]


@needs_hopper
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "128x128w4s4", "64x64w4"])
@pytest.mark.parametrize("b_layout", ["KN", "NK^T"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matmul_on_hopper(shape, dtype, b_layout, config, seed):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, k, device="cuda").to(dtype).t() if b_layout == "NK^T" else \
        torch.randn(k, n, device="cuda").to(dtype)
    out = matmul(a, b, **config)
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    assert_close_lowp(out, matmul_ref(a.float(), b.float()), matmul_ref(a, b), name=f"gluon matmul {shape}")


@needs_hopper
def test_matmul_on_hopper_large_values_and_views(seed):
    """Rows of a wider tensor (a row stride longer than K) and an all-zero row stay exact."""
    big = torch.randn(96, 512, device="cuda", dtype=torch.bfloat16)
    a = big[:, :256]  # stride 512, 16-byte aligned rows
    a[5].zero_()
    b = torch.randn(256, 136, device="cuda", dtype=torch.bfloat16)
    out = matmul(a, b)
    assert torch.all(out[5] == 0)
    assert_close_lowp(out, matmul_ref(a.float(), b.float()), matmul_ref(a, b), name="strided a")


# ------------------------------------------------------------------------------ the benchmark
def test_benchmark_suite_runs_tiny_and_summarises():
    """The suite at tiny sizes (on the CPU: the Triton and PyTorch rows, wall clock; the
    Gluon rows are skipped off Hopper), and its summary on a frame with known timings."""
    from llmnote.bench.harness import Timing, rows_for
    from llmnote.bench.suites import SUITES
    from llmnote.bench.suites import gluon as S

    assert SUITES["gluon"] is S.run
    df = S.run(square=[32], layers={"o": (16, 128)}, tokens=[8], copy_bytes=[4096], w4_batches=[2],
               w4_group=64)
    mm = df[df.bench == S.MATMUL_BENCH]
    assert set(mm["shape"]) == {"square", "linear"} and set(mm["layer"]) == {"", "o"}
    assert "llmnote" in set(mm.provider) and ("llmnote-gluon" in set(mm.provider)) == on_hopper
    w4 = df[df.bench == S.W4_BENCH]
    assert {"llmnote", "torch-linear", "read-packed-bytes"} <= set(w4.provider)
    bw = w4[(w4.metric == "bandwidth") & (w4.provider == "llmnote")]
    t = w4[(w4.metric == "time") & (w4.provider == "llmnote")]
    packed = 128 * 16 // 2 + 2 * (128 // 64) * 16 * 2  # codes + bf16 scales and zeros
    assert float(bw.p50.iloc[0]) == pytest.approx(packed / (float(t.p50.iloc[0]) * 1e-3) / 1e9)
    assert S.packed_bytes(16, 128, torch.bfloat16, 64) == packed
    read = w4[w4.provider == "read-packed-bytes"]
    assert set(read.weight_bytes.astype(int)) == {packed}  # the packed layer's bytes
    assert "torch" in set(df[df.bench == S.COPY_BENCH].provider)
    assert {"copy", "matmul-bf16"} <= set(df[df.bench == "ceiling"].provider)

    # only the named W4A16 providers, and none of the other sweeps
    few = S.run(square=[], layers={"o": (16, 128)}, tokens=[], copy_bytes=[], w4_batches=[2],
                w4_group=64, w4_providers=["torch-linear"])
    assert set(few.bench) == {"ceiling", S.W4_BENCH} and set(few[few.bench == S.W4_BENCH].provider) == {
        "torch-linear"}
    with pytest.raises(ValueError, match=r"w4_providers must be among .*got \['nope'\]"):
        S.run(square=[], layers={"o": (16, 128)}, tokens=[], copy_bytes=[], w4_batches=[2],
              w4_group=64, w4_providers=["nope"])

    env = {"gpu_name": "test"}
    shape = {"shape": "linear", "layer": "o", "M": 64, "N": 4096, "K": 4096}
    rows = []
    for provider, ms in [("llmnote-gluon", 0.5), ("llmnote", 1.0), ("cublas", 0.25)]:
        rows += rows_for(S.MATMUL_BENCH, provider, "M", 64, Timing(ms, ms, ms),
                         S._flops(lambda m: (m, 4096, 4096)), shape, env)
    for provider, ms in [("llmnote-gluon", 0.01), ("llmnote", 0.02), ("torch-linear", 0.04)]:
        rows += rows_for(S.W4_BENCH, provider, "M", 1, Timing(ms, ms, ms),
                         {"bandwidth": ("GB/s", lambda m, t: 1e7 / (t * 1e-3) / 1e9)},
                         {"layer": "o", "N": 4096, "K": 4096}, env)
    for provider, ms in [("llmnote-gluon", 2.0), ("torch", 1.0)]:
        rows += rows_for(S.COPY_BENCH, provider, "bytes", 1 << 30, Timing(ms, ms, ms),
                         {"bandwidth": ("GB/s", lambda b, t: 2 * b / (t * 1e-3) / 1e9)}, {}, env)
    rows += rows_for("ceiling", "copy", "bytes", 1 << 30, Timing(1.0, 1.0, 1.0),
                     {"bandwidth": ("GB/s", lambda b, t: b / (t * 1e-3) / 1e9)}, {}, env)
    s = S.summary(pd.DataFrame(rows))
    assert list(s.check) == ["matmul layer=o M=64 N=4096 K=4096", "w4a16 layer=o M=1 N=4096 K=4096",
                             f"copy bytes={1 << 30}"]
    mm_row, w4_row, copy_row = s.iloc[0], s.iloc[1], s.iloc[2]
    assert mm_row.gluon == pytest.approx(2 * 64 * 4096 * 4096 / 0.5e-3 / 1e12)
    assert (mm_row.vs_triton, mm_row.vs_peer) == (pytest.approx(2.0), pytest.approx(0.5))
    assert (w4_row.vs_triton, w4_row.vs_peer) == (pytest.approx(2.0), pytest.approx(4.0))
    assert w4_row.vs_ceiling == pytest.approx(1e7 / 1e-5 / 1e9 / (2**30 / 1e-3 / 1e9))
    assert (copy_row.vs_peer, copy_row.vs_ceiling) == (pytest.approx(0.5), pytest.approx(1.0))


# ------------------------------------------------------------------------------ W4A16
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_w4a16_decodes_into_wgmma_registers(dtype, block_m):
    """The int4 codes go from global memory to wgmma's register operand: one byte load per
    channel pair, no shared memory but the x ring and its barriers (the dequantized tile is
    never stored), wgmma with its left operand in registers. (The kernel's
    convert_layout(..., assert_trivial=True) would not compile if the decoded layout were
    not already the operand's.)"""
    from llmnote.ops.gluon import w4a16 as W

    c = gluon.compile_w4a16(dtype, block_m=block_m, bias=block_m == 32)
    t = "bf16" if dtype == torch.bfloat16 else "f16"
    wgmma = c.lines("wgmma.mma_async")
    assert len(wgmma) == W.BLOCK_K // 16
    assert all(w.startswith(f"wgmma.mma_async.sync.aligned.m64n{block_m}k16.f32.{t}.{t}") for w in wgmma)
    assert all(w.count("{") == 2 for w in wgmma)  # accumulator and A in registers; B: a descriptor
    assert c.count("st.shared") == 0 and c.count("ld.shared") == 0 and c.count("ldmatrix") == 0
    assert c.shared == W.NUM_STAGES * block_m * W.BLOCK_K * 2 + 8 * W.NUM_STAGES
    per_step = W.BLOCK_N * W.BLOCK_K // 2 // (32 * W.NUM_WARPS)  # bytes per thread per K step
    assert c.count("ld.global.b8") == 2 * per_step  # the first step, then the prefetch in the loop
    assert c.spilled == 0


def test_w4a16_repacked_reads_16_bytes_a_thread():
    """Repacked (Marlin's idea, for this kernel's tiles): one 16-byte load of codes per thread
    and K step where the book's packing takes 16 single-byte loads; the codes still land in
    wgmma's operand registers without shared memory or shuffles."""
    book, packed = (gluon.compile_w4a16(torch.bfloat16, block_m=64, repacked=r) for r in (False, True))
    assert book.count("ld.global.b8") == 2 * 16 and book.count("ld.global.v4") == 0  # first + prefetch
    # the first AHEAD steps before the loop, one more in it
    assert packed.count("ld.global.b8") == 0 and packed.count("ld.global.v4") == gw4.AHEAD + 1
    for ahead in (1, 2, 4):  # each step in flight holds its 4 words, scales and zeros
        for pairs in (False, True):
            c = gluon.compile_w4a16(torch.bfloat16, block_m=16, repacked=True, ahead=ahead,
                                    pairs=pairs)
            assert c.count("ld.global.v4") == ahead + 1 and c.spilled == 0, (ahead, pairs)
    assert packed.count("shfl") == 0 and packed.count("st.shared") == book.count("st.shared")
    assert [w.count("{") for w in packed.lines("wgmma.mma_async")] == [2] * 4  # A in registers
    assert packed.spilled == 0


@pytest.mark.parametrize("repacked", [False, True])
def test_w4a16_float_codes_need_no_int_to_float_conversion(repacked):
    """float_codes: each of a thread's 32 codes of a step becomes an fp32 bit pattern by
    integer logic and is dequantized by one multiply-add; one code at a time, the kernel
    converts each code (cvt) and subtracts and multiplies."""
    conv, flt = (gluon.compile_w4a16(torch.bfloat16, block_m=16, repacked=repacked, float_codes=f,
                                     pairs=False) for f in (False, True))
    cvt = ("cvt.rn.f32.u32", "cvt.rn.f32.s32")
    assert sum(conv.count(c) for c in cvt) == 32 and conv.count("fma.rn.f32") == 0
    assert sum(flt.count(c) for c in cvt) == 0 and flt.count("fma.rn.f32") == 32
    assert flt.spilled == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_w4a16_pairs_dequantize_two_weights_an_instruction(dtype):
    """pairs: a thread's 32 codes of a step become 16 pairs of 16-bit floats M + q by integer
    logic (no conversion; one lop3 a pair), and each pair is dequantized by two subtractions and one
    multiplication on the pair (sub and mul on bf16x2 / f16x2), with no fp32 arithmetic;
    the dequantized tile lands in wgmma's operand registers as before. It is the default on
    repacked codes (pairs=None); pairs=False decodes one code at a time."""
    t = "bf16x2" if dtype == torch.bfloat16 else "f16x2"
    one = gluon.compile_w4a16(dtype, block_m=16, repacked=True, pairs=False)
    assert one.asm["ptx"].count(f"sub.rn.{t}") == 0 and one.count("cvt.rn.f32") == 32
    for kw in ({}, {"ahead": 4}, {"overlap": True}, {"split_k": 3, "bias": True}):
        two = gluon.compile_w4a16(dtype, block_m=16, repacked=True, **kw)  # the default: pairs
        ptx = two.asm["ptx"]
        assert (ptx.count(f"sub.rn.{t}"), ptx.count(f"mul.rn.{t}")) == (32, 16), kw
        # the two codes of a pair lie 16 bits apart: one logic operation takes out both
        assert ptx.count("lop3.b32") == 16, kw
        assert two.count("cvt.rn.f32") == 0 and two.count("fma.rn.f32") == 0
        assert two.count("mul.f32") + two.count("mul.rn.f32") == 0
        assert [w.count("{") for w in two.lines("wgmma.mma_async")] == [2] * 4
        assert two.spilled == 0 and two.count("shfl") == 0
    assert gluon.compile_w4a16(dtype, block_m=16, repacked=True).registers <= one.registers
    assert gluon.compile_w4a16(dtype, block_m=16, repacked=True, pairs=True).asm["ptx"] == \
        gluon.compile_w4a16(dtype, block_m=16, repacked=True).asm["ptx"]
    # float codes are the fp32 path: no pairs there by default
    assert gluon.compile_w4a16(dtype, block_m=16, repacked=True, float_codes=True).asm["ptx"] \
        .count(f"sub.rn.{t}") == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_w4a16_pairs_arithmetic_is_the_fp32_paths(dtype, seed):
    """The pair M + q (M = 128 in bf16, 1024 in fp16: _pair_magic's halves), minus M, minus an
    integer zero point, times a scale, each rounded once to the 16-bit type as sub.rn and
    mul.rn round (their exact results fit in fp32): for every pair of codes, every zero
    point and scales over eight decades, the same bits as ((q - z) * s) in fp32 rounded
    once, the default path's tile."""
    from triton.experimental.gluon import language as gl

    magic = gw4._pair_magic(gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
    big = 128.0 if dtype == torch.bfloat16 else 1024.0
    q = torch.arange(16, dtype=torch.int32)
    lo, hi = (c.reshape(-1) for c in torch.meshgrid(q, q, indexing="ij"))
    pair = lo | (hi << 16) | magic  # the two codes in the two halves' lowest mantissa bits
    m = pair.view(dtype).reshape(-1, 2)
    assert torch.equal(m.float(), torch.stack((lo, hi), 1).float() + big)  # M + q, exactly
    scales = (torch.randn(300) * torch.logspace(-6, 2, 300)).to(dtype)
    for z in range(16):
        want = ((torch.stack((lo, hi), 1)[None] - z) * scales.float()[:, None, None]).to(dtype)
        t = (m.float() - big).to(dtype)
        t = (t.float() - z).to(dtype)
        got = (t.float()[None] * scales.float()[:, None, None]).to(dtype)
        assert torch.equal(got, want), z


def test_w4a16_overlap_leaves_one_product_in_flight():
    """overlap: the loop waits for all but one product (the step before's), so a step's
    wgmma runs while the next step is decoded; the last one is waited for after the loop."""
    one, two = (gluon.compile_w4a16(torch.bfloat16, block_m=16, repacked=True, overlap=o)
                for o in (False, True))
    waits = [w.split()[-1] for w in one.lines("wgmma.wait_group")]
    assert waits == ["0;"]
    assert [w.split()[-1] for w in two.lines("wgmma.wait_group")] == ["1;", "0;"]
    assert two.count("wgmma.mma_async") == one.count("wgmma.mma_async") and two.spilled == 0


@pytest.mark.parametrize("k,n", [(64, 64), (128, 200), (512, 33), (4096, 384)])
def test_w4a16_repack_round_trip_and_the_kernels_decoding(k, n, seed):
    """repack_w4a16 against its inverse, and against the kernel's decoding written out: word
    (d0, d1, d2, d3) of tile (step, t), nibble n3 + 2 k3 + 4 k0 holds the code of K
    64 step + 16 d3 + 8 k3 + 2 d2 + k0 and channel 64 t + 16 d0 + 8 n3 + d1 (0 past N):
    the two codes of a pair (k0 = 0, 1) 16 bits apart."""
    from llmnote.quant.primitives import pack_int4

    q = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    qw = pack_int4(q)
    qm = gw4.repack_w4a16(qw)
    assert qm.dtype == torch.int32 and qm.shape == (k // 64, -(-n // 64), 512)
    assert torch.equal(gw4.unrepack_w4a16(qm, n), qw)
    idx = torch.arange(512)
    d0, d1, d2, d3 = idx // 128, idx // 16 % 8, idx // 4 % 4, idx % 4
    j = torch.arange(8)
    n3, k3, k0 = j % 2, j // 2 % 2, j // 4
    nib = (qm.long()[..., None] >> (4 * j)) & 15  # (steps, tiles, 512, 8)
    kk = (64 * torch.arange(k // 64)[:, None, None, None] + 16 * d3[:, None] + 8 * k3
          + 2 * d2[:, None] + k0)
    nn = 64 * torch.arange(qm.shape[1])[None, :, None, None] + 16 * d0[:, None] + 8 * n3 + d1[:, None]
    kk, nn = torch.broadcast_tensors(kk, nn)
    want = torch.where(nn < n, q[kk, nn.clamp(max=n - 1)].long(), 0)
    assert torch.equal(nib, want)


def test_w4a16_split_k_compiles_to_a_deterministic_reduction():
    """Split-K: partial sums to the workspace, one acquire-release count per tile, the last
    program re-reads the slices past L1 (.cg) and zeroes the counter; one slice: none of it."""
    from llmnote.ops.gluon import w4a16 as W

    one, three = gluon.compile_w4a16(split_k=1), gluon.compile_w4a16(split_k=3, bias=True)
    assert one.count("atom.") == 0 and one.count("ld.global.cg") == 0
    assert [x.split()[0] for x in three.lines("atom.")] == ["atom.global.gpu.acq_rel.add.u32",
                                                           "atom.global.gpu.acq_rel.exch.b32"]
    assert three.count("ld.global.cg") > 0 and three.shared == one.shared
    # Llama-3-8B layers on 132 SMs: the 4096-channel ones split K, the 28672-channel one hardly
    assert [W.split_for(1, n, k, 132) for n, k in [(4096, 4096), (28672, 4096), (4096, 14336)]] == [8, 2, 9]
    assert W.split_for(1, 4096, 256, 132) == 1  # four K steps: no split
    # about eight programs an SM: twice the slices, as far as four-step slices allow
    assert [W.split_for(1, n, k, 132, per_sm=8) for n, k in [(4096, 4096), (28672, 4096),
                                                             (4096, 14336)]] == [16, 3, 16]


def _w4(n, k, g, dtype, dev):
    from llmnote.quant.primitives import pack_int4, quantize

    w = torch.randn(n, k)
    qt = quantize(w, 4, symmetric=False, granularity="group", group_size=g)
    qw = pack_int4(qt.q.t().contiguous()).to(dev)
    return qw, qt.scale.t().contiguous().to(dev, dtype), qt.zero.t().contiguous().to(dev, dtype)


def test_w4a16_bad_inputs():
    qw, s, z = _w4(8, 128, 64, torch.bfloat16, "cpu")
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        gluon.w4a16_linear(x.float(), qw, s, z, 64)
    with pytest.raises(ValueError, match="multiple of 64"):
        qw2, s2, z2 = _w4(8, 128, 32, torch.bfloat16, "cpu")
        gluon.w4a16_linear(x, qw2, s2, z2, 32)
    with pytest.raises(ValueError, match="group_size must be a positive int dividing K"):
        gluon.w4a16_linear(x, qw, s, z, 48)
    with pytest.raises(ValueError, match="split_k must be None or a positive int"):
        gluon.w4a16_linear(x, qw, s, z, 64, split_k=0)
    with pytest.raises(ValueError, match="qweight must be contiguous"):
        wide = torch.zeros(16, 16, dtype=torch.int32)[:, :8]
        gluon.w4a16_linear(x, wide, s, z, 64)
    with pytest.raises(ValueError, match=r"repacked must be repack_w4a16\(qweight\)"):
        gluon.w4a16_linear(x, qw, s, z, 64, repacked=qw)
    with pytest.raises(ValueError, match="ahead must be 1, 2 or 4, got 3"):
        gluon.w4a16_linear(x, qw, s, z, 64, ahead=3)
    with pytest.raises(TypeError, match="float_codes must be a bool, got 1"):
        gluon.w4a16_linear(x, qw, s, z, 64, float_codes=1)
    with pytest.raises(TypeError, match="overlap must be a bool, got 1"):
        gluon.w4a16_linear(x, qw, s, z, 64, overlap=1)
    with pytest.raises(TypeError, match="pairs must be None or a bool, got 1"):
        gluon.w4a16_linear(x, qw, s, z, 64, pairs=1)
    with pytest.raises(ValueError, match="pairs decodes repacked codes.*repacked=None"):
        gluon.w4a16_linear(x, qw, s, z, 64, pairs=True)
    with pytest.raises(ValueError, match="pairs decodes repacked codes.*float_codes=True"):
        gluon.w4a16_linear(x, qw, s, z, 64, pairs=True, repacked=gw4.repack_w4a16(qw),
                           float_codes=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        gw4.repack_w4a16(torch.zeros(4, 8, dtype=torch.int32))


@off_gpu
def test_w4a16_no_gpu_error():
    qw, s, z = _w4(8, 128, 64, torch.bfloat16, "cpu")
    with pytest.raises(RuntimeError, match=r"compute capability 9\.0 \(Hopper\).*w4a16_linear \(Triton\)"):
        gluon.w4a16_linear(torch.randn(2, 128).to(torch.bfloat16), qw, s, z, 64)


@needs_hopper
@pytest.mark.parametrize("m,n,k,g", [(1, 1, 64, 64), (1, 40, 256, 128), (5, 33, 192, 64), (16, 200, 512, 128),
                                     (33, 64, 128, 64), (64, 130, 384, 128), (100, 72, 256, 256),
                                     # 24 K steps: unsplit, the x ring wraps five times and each
                                     # slot's barrier comes back to phase 0 (the full-size
                                     # benchmark shapes were the only cover of that)
                                     (1, 96, 1536, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_w4a16_on_hopper(m, n, k, g, dtype, seed):
    from llmnote.quant.kernels.w4a16_ref import dequantize_int4_weight
    from llmnote.quant.primitives import unpack_int4

    qw, s, z = _w4(n, k, g, dtype, "cuda")
    x = torch.randn(m, k, device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if m % 2 else None
    out = gluon.w4a16_linear(x, qw, s, z, g, bias)
    b32 = None if bias is None else bias.float()
    ref32 = gluon.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), g, b32)
    w = dequantize_int4_weight(unpack_int4(qw), s, z, g).to(dtype)  # PyTorch's own low precision
    lowp = (x.float() @ w.float() + (0 if bias is None else bias.float())).to(dtype)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close_lowp(out, ref32, lowp, atol=1e-3, name=f"gluon w4a16 {(m, n, k, g)}")
    x3 = x.reshape(1, m, k)  # leading dimensions; the same sums in the same order
    assert torch.equal(gluon.w4a16_linear(x3, qw, s, z, g, bias), out.reshape(1, m, n))
    # the repacked codes (16-byte loads) decode to the same operand registers: the same result
    qm = gw4.repack_w4a16(qw)
    # (by default two codes at a time, pairs; below, one at a time as well)
    assert torch.equal(gluon.w4a16_linear(x, qw, s, z, g, bias, repacked=qm), out)
    assert torch.equal(gluon.w4a16_linear(x, qw, s, z, g, bias, repacked=qm, pairs=False), out)
    # codes decoded as fp32 1 + q / 16, one multiply-add: with integer zero points both
    # forms are exact in fp32 before the rounding to the tile's dtype, so the same result
    # and with each product left in flight while the next step decodes: the same
    # products in the same order
    for repacked in (None, qm):
        for kw in ({"float_codes": True}, {"overlap": True}, {"float_codes": True, "overlap": True}):
            assert torch.equal(gluon.w4a16_linear(x, qw, s, z, g, bias, repacked=repacked, **kw),
                               out), kw
    for split in (1, 2, 3, 5):  # 5 slices of 2 to 8 steps: some slices empty
        got = gluon.w4a16_linear(x, qw, s, z, g, bias, split_k=split)
        assert_close_lowp(got, ref32, lowp, atol=1e-3, name=f"gluon w4a16 {(m, n, k, g)} split {split}")
        assert torch.equal(got, gluon.w4a16_linear(x, qw, s, z, g, bias, split_k=split))  # deterministic
        for ahead in (1, 2, 4):  # slices shorter than the steps in flight included
            for pairs in (False, None):
                assert torch.equal(gluon.w4a16_linear(x, qw, s, z, g, bias, split_k=split,
                                                      repacked=qm, ahead=ahead, pairs=pairs), got)
        assert torch.equal(gluon.w4a16_linear(x, qw, s, z, g, bias, split_k=split, repacked=qm,
                                              ahead=4, float_codes=True, overlap=True), got)
        # pairs (the default above): q - z is exact in the 16-bit type (an integer below 16
        # in magnitude) and (q - z) s is rounded once, as the fp32 path's conversion rounds
        # it: the same tile, with the product in flight too
        for kw in ({"pairs": True}, {"ahead": 2, "overlap": True}):
            assert torch.equal(gluon.w4a16_linear(x, qw, s, z, g, bias, split_k=split, repacked=qm,
                                                  **kw), got), kw


def test_summary_of_the_shipped_csv_keeps_every_product():
    """Read back from CSV, the square products' empty layer name is NaN: the summary still
    has a row for each of them (pandas' groupby drops NaN keys unless told not to)."""
    from llmnote import bench
    from llmnote.bench.suites import gluon as gluon_suite

    recorded = bench.load("gluon")
    table = gluon_suite.summary(recorded)
    squares = recorded[(recorded.bench == gluon_suite.MATMUL_BENCH) & recorded.layer.isna()
                       & (recorded.provider == "llmnote-gluon")]
    assert len(squares) > 0
    got = table[table.check.str.startswith("matmul") & ~table.check.str.contains("layer=")]
    assert len(got) == squares.drop_duplicates(["M", "N", "K"]).shape[0], table.check.tolist()

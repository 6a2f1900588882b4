"""llmnote.ops.matmul against its reference: the pointer kernels (one tile per
program and persistent), the TMA kernel (Hopper; run by the interpreter on the
CPU), the fused epilogue, layouts, the pruning rule and the tile order.

Low precision: the kernel's error against ``matmul_ref`` on fp32-upcast inputs
must stay within twice the error of ``matmul_ref`` run in fp16/bf16
(``llmnote.testing.assert_close_lowp``). Under the interpreter the kernels
upcast bf16 tiles to fp32 before ``tl.dot`` (its bf16 dot is wrong); on a GPU
the bf16 tensor-core path itself is tested.
"""

import importlib
import random

import pytest
import torch

from llmnote import device
from llmnote.ops import matmul, matmul_ref
from llmnote.testing import MismatchError, assert_close_lowp

mm = importlib.import_module("llmnote.ops.matmul")  # the module (llmnote.ops.matmul is the function)

DTYPES = [torch.float16, torch.bfloat16]
# (M, N, K), none a multiple of the block: 1-row, 1-column and K = 1 products included.
ODD_SHAPES = [(1, 1, 1), (1, 65, 17), (17, 33, 65), (65, 17, 33), (33, 1, 40)]
# TMA needs 16-byte row strides: N and K multiples of 8 (M is free).
TMA_SHAPES = [(1, 8, 56), (17, 40, 24), (70, 24, 72)]
needs_tma = pytest.mark.skipif(not mm._tma_available(), reason="TMA needs Hopper (or the interpreter)")


def check(out, a, b, bias=None, activation=None):
    ref32 = matmul_ref(a.float(), b.float(), None if bias is None else bias.float(), activation)
    assert out.dtype == a.dtype and out.device == a.device and out.is_contiguous()
    assert_close_lowp(out, ref32, matmul_ref(a, b, bias, activation), name="matmul")


def rand(*shape, dtype, dev, scale=1.0):
    return (torch.randn(*shape, device=dev) * scale).to(dtype)


@pytest.mark.parametrize("persistent", [False, True], ids=["tiles", "persistent"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_odd_shapes(shape, dtype, persistent, dev, seed):
    m, n, k = shape
    a, b = rand(m, k, dtype=dtype, dev=dev), rand(k, n, dtype=dtype, dev=dev)
    check(matmul(a, b, persistent=persistent), a, b)


@needs_tma
@pytest.mark.parametrize("b_layout", ["KN", "NK^T"])
@pytest.mark.parametrize("persistent", [False, True], ids=["tiles", "persistent"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", TMA_SHAPES, ids=str)
def test_tma_and_pointer_paths(shape, dtype, tma, persistent, b_layout, dev, seed):
    m, n, k = shape
    a = rand(m, k, dtype=dtype, dev=dev)
    # "NK^T": b is the transpose of a row-major (N, K) weight, as in x @ W.T
    b = rand(k, n, dtype=dtype, dev=dev) if b_layout == "KN" else rand(n, k, dtype=dtype, dev=dev).t()
    kernel, use_tma, b_trans = mm._plan(a, b, persistent, tma)
    assert use_tma == tma and b_trans == (tma and b_layout == "NK^T")
    check(matmul(a, b, persistent=persistent, tma=tma), a, b)


@pytest.mark.parametrize("path", ["pointers", pytest.param("tma", marks=needs_tma)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", [None, "relu", "gelu_tanh", "silu"])
def test_fused_epilogue(activation, with_bias, path, dev, seed):
    dtype = torch.bfloat16
    a, b = rand(33, 48, dtype=dtype, dev=dev, scale=0.5), rand(48, 40, dtype=dtype, dev=dev)
    bias = rand(40, dtype=dtype, dev=dev) if with_bias else None
    out = matmul(a, b, bias, activation, tma=path == "tma")
    check(out, a, b, bias, activation)
    if activation == "relu":
        assert (out >= 0).all() and (out == 0).any()


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_fused_epilogue_fp16_persistent(activation, dev, seed):
    a, b = rand(20, 30, dtype=torch.float16, dev=dev), rand(30, 50, dtype=torch.float16, dev=dev)
    bias = rand(50, dtype=torch.float16, dev=dev)
    check(matmul(a, b, bias, activation, persistent=True), a, b, bias, activation)


@pytest.mark.parametrize("persistent", [False, True], ids=["tiles", "persistent"])
def test_strided_and_transposed_inputs(persistent, dev, seed):
    dt = torch.bfloat16
    a_t = rand(40, 19, dtype=dt, dev=dev).t()  # (19, 40), column-major
    b_t = rand(23, 40, dtype=dt, dev=dev).t()  # (40, 23), column-major
    check(matmul(a_t, b_t, persistent=persistent), a_t, b_t)
    a_s = rand(19, 80, dtype=dt, dev=dev)[:, ::2]  # column stride 2
    b_s = rand(70, 23, dtype=dt, dev=dev)[10:50]  # a window of rows
    check(matmul(a_s, b_s, persistent=persistent), a_s, b_s)
    b_e = rand(40, 1, dtype=dt, dev=dev).expand(40, 9)  # column stride 0
    check(matmul(a_s, b_e, persistent=persistent), a_s, b_e)


def test_leading_dimensions(dev, seed):
    dt = torch.float16
    x = rand(2, 3, 5, 24, dtype=dt, dev=dev)
    w = rand(24, 16, dtype=dt, dev=dev)
    out = matmul(x, w)
    assert out.shape == (2, 3, 5, 16)
    check(out, x, w)
    xp = rand(5, 2, 24, dtype=dt, dev=dev).permute(1, 0, 2)  # not viewable as 2-D: reshaped
    check(matmul(xp, w), xp, w)


def test_empty_dimensions(dev, seed):
    dt = torch.bfloat16
    assert matmul(rand(0, 8, dtype=dt, dev=dev), rand(8, 5, dtype=dt, dev=dev)).shape == (0, 5)
    assert matmul(rand(4, 8, dtype=dt, dev=dev), rand(8, 0, dtype=dt, dev=dev)).shape == (4, 0)
    a, b, bias = rand(3, 0, dtype=dt, dev=dev), rand(0, 5, dtype=dt, dev=dev), rand(5, dtype=dt, dev=dev)
    out = matmul(a, b, bias, "silu")  # K = 0: the epilogue alone, act(bias) on every row
    check(out, a, b, bias, "silu")


def test_a_wrong_tile_is_caught(dev, seed):
    """The tolerance above rejects a result in which one tile skipped its last K step."""
    dt = torch.bfloat16
    a, b = rand(64, 96, dtype=dt, dev=dev), rand(96, 64, dtype=dt, dev=dev)
    out = matmul(a, b)
    check(out, a, b)  # the real result passes
    wrong = out.clone()
    wrong[16:32, 32:48] = (a[16:32, :80].float() @ b[:80, 32:48].float()).to(dt)  # K tail dropped
    with pytest.raises(MismatchError, match="exceeds"):
        check(wrong, a, b)
    one_wrong = out.clone()  # a single element off by 5% of the output's largest magnitude
    one_wrong[40, 7] += 0.05 * out.float().abs().max().to(dt)
    with pytest.raises(MismatchError, match=r"at \(40, 7\)"):
        check(one_wrong, a, b)


def test_reference_is_linear_algebra(dev, seed):
    a, b, bias = torch.randn(7, 5, device=dev), torch.randn(5, 3, device=dev), torch.randn(3, device=dev)
    want = torch.nn.functional.gelu(torch.addmm(bias, a, b), approximate="tanh")
    torch.testing.assert_close(matmul_ref(a, b, bias, "gelu_tanh"), want)


def test_tuned_config_names_the_path(dev, seed):
    a, b = rand(20, 24, dtype=torch.float16, dev=dev), rand(24, 16, dtype=torch.float16, dev=dev)
    matmul(a, b, persistent=True, tma=False)
    cfg = mm.tuned_config(a, b, persistent=True, tma=False)
    assert cfg.startswith("persistent ") and "x" in cfg and " w" in cfg


# ---- the pruning rule -------------------------------------------------------------------


def dims(configs):
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages) for c in configs]


def test_pruning_drops_tiles_larger_than_the_problem():
    gpu = mm.GPU_CONFIGS
    kept = dims(mm.select_configs(gpu, 8192, 8192, 8192, 2, smem_limit=None))
    assert kept == dims(gpu)  # a large problem keeps every config
    skinny = dims(mm.select_configs(gpu, 1, 4096, 4096, 2, smem_limit=None))
    assert skinny and all(bm == min(d[0] for d in dims(gpu)) for bm, _, _, _ in skinny)
    tiny = mm.select_configs(gpu, 3, 5, 7, 2, smem_limit=None)
    assert len(tiny) == 1  # nothing fits every dimension: the smallest tile is kept


def test_pruning_respects_shared_memory():
    gpu = mm.GPU_CONFIGS
    limit = 100 * 1024
    kept = mm.select_configs(gpu, 4096, 4096, 4096, 2, smem_limit=limit)
    assert kept and len(kept) < len(gpu)
    for c in gpu:
        bm, bn, bk, st = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages
        need = st * (bm * bk + bk * bn) * 2
        assert mm.config_smem(bm, bn, bk, st, 2) == need
        assert mm.config_smem(bm, bn, bk, st, 2, tma_store=True) == need + bm * bn * 2
        assert (c in kept) == (need <= limit)
    assert len(mm.select_configs(gpu, 4096, 4096, 4096, 2, smem_limit=1)) == 1  # fallback


# ---- the program order ------------------------------------------------------------------


def python_tile_coords(pid, num_pid_m, num_pid_n, group_m):
    group, r = divmod(pid, group_m * num_pid_n)
    rows = min(num_pid_m - group * group_m, group_m)
    return group * group_m + r % rows, r // rows


@pytest.mark.parametrize("grid", [(1, 1, 1), (5, 7, 2), (9, 4, 4), (6, 6, 8), (4, 3, 1)])
def test_program_tiles_is_a_grouped_permutation(grid):
    pm, pn, g = grid
    tiles = mm.program_tiles(pm, pn, g)
    assert tiles.shape == (pm * pn, 2)
    assert sorted(map(tuple, tiles.tolist())) == [(i, j) for i in range(pm) for j in range(pn)]
    assert [tuple(t) for t in tiles.tolist()] == [python_tile_coords(p, pm, pn, g) for p in range(pm * pn)]
    for start in range(0, pm * pn, g * pn):  # each run of g * pn programs covers <= g tile-rows
        rows = set(tiles[start:start + g * pn, 0].tolist())
        assert len(rows) == min(g, pm - start // pn)
    if g == 1:
        assert tiles.tolist() == [[i, j] for i in range(pm) for j in range(pn)]  # row-major


def test_program_tiles_random_grids():
    for _ in range(5):
        pm, pn, g = random.randint(1, 9), random.randint(1, 9), random.randint(1, 6)
        got = [tuple(t) for t in mm.program_tiles(pm, pn, g).tolist()]
        assert got == [python_tile_coords(p, pm, pn, g) for p in range(pm * pn)], (pm, pn, g)


# ---- bad input --------------------------------------------------------------------------


def _bad_cases(dev):
    h = torch.float16
    ok_a, ok_b = torch.ones(4, 8, dtype=h, device=dev), torch.ones(8, 3, dtype=h, device=dev)
    return [
        (([[1.0]], ok_b), {}, TypeError, "a must be a torch.Tensor, got list"),
        ((ok_a.int(), ok_b), {}, TypeError, r"a must have dtype in \(float16, bfloat16\), got int32"),
        ((ok_a.float(), ok_b.float()), {}, TypeError, r"a must have dtype in \(float16, bfloat16\), got float32"),
        ((ok_a[0], ok_b), {}, ValueError, "a must have at least 2 dimension"),
        ((ok_a, ok_b[None]), {}, ValueError, "b must be 2-D, got 3-D"),
        ((ok_a, ok_b[:5]), {}, ValueError, r"inner dimensions must match: a is \(..., K\) with K = 8"),
        ((ok_a, ok_b.bfloat16()), {}, TypeError, "a and b must have the same dtype"),
        ((ok_a, ok_b, torch.ones(4, dtype=h, device=dev)), {}, ValueError, r"bias must have shape \(N,\) = \(3,\)"),
        ((ok_a, ok_b, torch.ones(3, dtype=torch.bfloat16, device=dev)), {}, TypeError,
         "a and bias must have the same dtype"),
        ((ok_a, ok_b, None, "gelu"), {}, ValueError, "activation must be None or one of"),
        ((ok_a, ok_b), {"tma": "yes"}, TypeError, "tma must be None, True or False"),
        ((torch.ones(4, 8, dtype=h, device="meta"), ok_b), {}, ValueError, "a must be on"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_input(case, dev):
    args, kwargs, exc, match = _bad_cases(dev)[case]
    with pytest.raises(exc, match=match):
        matmul(*args, **kwargs)


@needs_tma
def test_tma_refuses_layouts_it_cannot_describe(dev):
    a, b = torch.ones(4, 17, dtype=torch.float16, device=dev), torch.ones(17, 8, dtype=torch.float16, device=dev)
    with pytest.raises(ValueError, match=r"TMA cannot describe a \(shape \(4, 17\)"):
        matmul(a, b, tma=True)
    assert matmul(a, b).shape == (4, 8)  # tma=None falls back to the pointer kernel


@pytest.mark.skipif(mm._tma_available(), reason="this machine has TMA")
def test_tma_true_without_tma_is_an_error(dev):
    a, b = torch.ones(4, 16, dtype=torch.float16, device=dev), torch.ones(16, 8, dtype=torch.float16, device=dev)
    with pytest.raises(ValueError, match="tma=True needs"):
        matmul(a, b, tma=True)


def test_default_path_uses_tma_only_on_hopper(dev):
    a, b = torch.ones(32, 64, dtype=torch.float16, device=dev), torch.ones(64, 32, dtype=torch.float16, device=dev)
    _, use_tma, _ = mm._plan(a, b, False, None)
    cap = device.capability()
    assert use_tma == (device.on_gpu() and cap is not None and cap >= (9, 0) and mm.TensorDescriptor is not None)


# ---- launching with a given config, and the tuned-config fast path ----------------------


@pytest.mark.parametrize("persistent", [False, True], ids=["tiles", "persistent"])
@pytest.mark.parametrize("path", ["pointers", pytest.param("tma", marks=needs_tma)])
def test_program_order_does_not_change_the_result(path, persistent, dev, seed):
    a, b = rand(40, 32, dtype=torch.bfloat16, dev=dev), rand(32, 48, dtype=torch.bfloat16, dev=dev)
    tma = path == "tma"
    tuned = matmul(a, b, persistent=persistent, tma=tma)
    cfg = mm.tuned(a, b, persistent=persistent, tma=tma)
    assert cfg is not None
    for g in (1, 3):
        other = type(cfg)({**cfg.kwargs, "GROUP_M": g}, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, pre_hook=cfg.pre_hook)
        out = mm.matmul_with_config(a, b, other, persistent=persistent, tma=tma)
        assert torch.equal(out, tuned), f"GROUP_M={g}: each tile must be computed the same way"


def test_second_call_reuses_the_tuned_config(dev, seed):
    a, b = rand(23, 72, dtype=torch.float16, dev=dev), rand(72, 31, dtype=torch.float16, dev=dev)
    first = matmul(a, b)
    cfg = mm.tuned(a, b)
    assert cfg is not None
    a2 = rand(29, 72, dtype=torch.float16, dev=dev)  # same M bucket (32), N, K: same entry
    assert mm.tuned(a2, b) is cfg
    check(matmul(a2, b), a2, b)
    assert torch.equal(matmul(a, b), first)

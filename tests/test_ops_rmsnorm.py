import pytest
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.ops._rowwise import SMEM_FOR_STAGES, RowConfig, bwd_config, fwd_config
from llmnote.ops.rmsnorm import MAX_N, add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from llmnote.ops.rmsnorm import _backward as rms_backward
from llmnote.ops.rmsnorm import _fwd_config as rms_fwd_config
from llmnote.ops.rmsnorm import _forward as rms_forward
from llmnote.testing import MismatchError, assert_close, assert_close_lowp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Odd sizes: rows not a multiple of BLOCK_M, lengths not a power of two, 1-element
# rows, 3-D input, 300 rows (several row tiles per backward program, so the
# cross-row sum of dweight is exercised), long rows several to a backward program
# and the longest row supported.
SHAPES = [(1, 1), (3, 7), (37, 129), (2, 3, 341), (5, 1823), (300, 129), (20, 4100),
          (1, MAX_N - 3)]
LOWP_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def outputs_and_grads(fn, inputs, dys):
    """``fn(*inputs)``'s outputs, then d(sum_i out_i * dy_i)/d(input) for every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, leaves, [dy.to(o.dtype) for o, dy in zip(outs, dys)])
    return list(outs) + list(grads)


def check_all(names, fn, ref, torch_lowp, inputs, dys):
    """Every output and gradient of ``fn`` against ``ref`` run in fp32 (autograd).

    In fp16/bf16 the error against the fp32 reference may be at most twice that
    of PyTorch's own low-precision result (``torch_lowp``), plus a small atol.
    """
    dtype = inputs[0].dtype
    got = outputs_and_grads(fn, inputs, dys)
    want = outputs_and_grads(ref, [t.float() for t in inputs], dys)
    if dtype == torch.float32:
        for name, g, w in zip(names, got, want):
            assert_close(g, w, atol=1e-5, rtol=1e-4, name=name)
        return
    lowp = outputs_and_grads(torch_lowp, inputs, dys)
    for name, g, w, t in zip(names, got, want, lowp):
        assert g.dtype == t.dtype, f"{name}: dtype {g.dtype}, PyTorch gives {t.dtype}"
        assert_close_lowp(g, w, t, atol=LOWP_ATOL[dtype], name=name)


def _inputs(shape, dtype, dev):
    x = (torch.randn(shape, device=dev) * 2).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], device=dev)).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rmsnorm_forward_backward(shape, dtype, dev, seed):
    x, w = _inputs(shape, dtype, dev)
    dy = torch.randn(shape, device=dev).to(dtype)
    n = shape[-1]
    check_all(["y", "dx", "dweight"], rmsnorm, rmsnorm_ref,
              lambda x, w: F.rms_norm(x, (n,), w, 1e-6), [x, w], [dy])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 341), (5, 1823), (300, 129), (20, 4100)],
                         ids=str)
def test_add_rmsnorm_forward_backward(shape, dtype, dev, seed):
    x, w = _inputs(shape, dtype, dev)
    r = torch.randn(shape, device=dev).to(dtype)
    dy, dh = (torch.randn(shape, device=dev).to(dtype) for _ in range(2))
    n = shape[-1]

    def torch_lowp(x, r, w):
        h = x + r
        return F.rms_norm(h, (n,), w, 1e-6), h

    check_all(["out", "new_residual", "dx", "dresidual", "dweight"], add_rmsnorm,
              add_rmsnorm_ref, torch_lowp, [x, r, w], [dy, dh])


def test_reference_is_torch_rms_norm(dev, seed):
    x, w = _inputs((17, 300), torch.float32, dev)
    assert_close(rmsnorm_ref(x, w, 1e-5), F.rms_norm(x, (300,), w, 1e-5), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_rows(dtype, dev, seed):
    big = torch.randn(40, 700, device=dev).to(dtype)
    w = torch.randn(501, device=dev).to(dtype)
    dy = torch.randn(40, 501, device=dev).to(dtype)
    lowp = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)  # noqa: E731
    check_all(["y", "dx", "dweight"], rmsnorm, rmsnorm_ref, lowp, [big[:, 13:514], w], [dy])
    check_all(["y", "dx", "dweight"], rmsnorm, rmsnorm_ref, lowp,
              [big[:, :80].t(), w[:40]], [dy[:40, :80].t()])  # column stride 700
    check_all(["y", "dx", "dweight"], rmsnorm, rmsnorm_ref, lowp,
              [big[:, :80], w[::2][:80]], [dy[:, :80]])  # weight with stride 2


def test_fp32_weight_with_bf16_x(dev, seed):
    """Mixed precision: y and dx in x's dtype, dweight in the weight's."""
    x = torch.randn(50, 97, device=dev).to(torch.bfloat16)
    w = 1 + 0.5 * torch.randn(97, device=dev)
    dy = torch.randn(50, 97, device=dev).to(torch.bfloat16)
    got = outputs_and_grads(rmsnorm, [x, w], [dy])
    want = outputs_and_grads(rmsnorm_ref, [x.float(), w], [dy])
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for name, g, r in zip(["y", "dx"], got, want):  # vs the reference rounded to bf16
        assert_close_lowp(g, r, r.to(torch.bfloat16), atol=1e-2, name=name)
    assert_close(got[2], want[2], atol=1e-4, rtol=1e-4, name="dweight")


def test_one_output_used(dev, seed):
    x, w = _inputs((6, 33), torch.float32, dev)
    r = torch.randn(6, 33, device=dev)
    for which in (0, 1):  # only the norm's output / only the new residual
        leaves = [t.clone().requires_grad_() for t in (x, r, w)]
        add_rmsnorm(*leaves)[which].sum().backward()
        ref_leaves = [t.clone().requires_grad_() for t in (x, r, w)]
        add_rmsnorm_ref(*ref_leaves)[which].sum().backward()
        for got, want in zip(leaves, ref_leaves):
            assert (got.grad is None) == (want.grad is None)
            if want.grad is not None:
                assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_residual_grads_are_separate_tensors(dev, seed):
    x, w = _inputs((4, 40), torch.float32, dev)
    x.requires_grad_()
    r = torch.randn(4, 40, device=dev, requires_grad=True)
    out, h = add_rmsnorm(x, r, w)
    (out.sum() + h.sum()).backward()
    assert_close(x.grad, r.grad, atol=0, rtol=0)
    x.grad.add_(1.0)  # must not change r.grad
    assert not torch.equal(x.grad, r.grad)


def test_weight_grad_is_deterministic(dev, seed):
    x, w = _inputs((300, 129), torch.float32, dev)
    dy = torch.randn(300, 129, device=dev)
    first = outputs_and_grads(rmsnorm, [x, w], [dy])[2]
    assert torch.equal(first, outputs_and_grads(rmsnorm, [x, w], [dy])[2])


def test_check_catches_a_wrong_gradient(dev, seed):
    """The comparison used above must fail on a slightly wrong weight gradient:
    one element off by 0.1%, or the sum missing the last row (a dropped tile)."""
    x, w = _inputs((300, 129), torch.float32, dev)
    dy = torch.randn(300, 129, device=dev)
    dweight = outputs_and_grads(rmsnorm, [x, w], [dy])[2]
    want = outputs_and_grads(rmsnorm_ref, [x, w], [dy])[2]
    one_off = dweight.clone()
    one_off[5] += 1e-3 * (1 + dweight[5].abs())
    with pytest.raises(MismatchError, match=r"(?s)dweight: 1 of 129 .* at \(5,\)"):
        assert_close(one_off, want, atol=1e-5, rtol=1e-4, name="dweight")
    last = x[-1].float()
    dropped = dweight - dy[-1] * last * torch.rsqrt(last.pow(2).mean() + 1e-6)
    with pytest.raises(MismatchError, match="dweight: .* elements differ"):
        assert_close(dropped, want, atol=1e-5, rtol=1e-4, name="dweight")


def test_reference_backend_calls_the_reference(monkeypatch, dev, seed):
    monkeypatch.setattr(device, "use_reference", lambda op, min_capability=None: True)
    x, w = _inputs((3, 10), torch.float32, dev)
    assert torch.equal(rmsnorm(x, w), rmsnorm_ref(x, w))
    assert torch.equal(add_rmsnorm(x, x, w)[0], add_rmsnorm_ref(x, x, w)[0])


def test_empty(dev):
    w = torch.ones(5, device=dev)
    assert rmsnorm(torch.empty(0, 5, device=dev), w).shape == (0, 5)
    assert [t.shape for t in add_rmsnorm(*[torch.empty(2, 0, 5, device=dev)] * 2, w)] == [
        (2, 0, 5), (2, 0, 5)]


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (([1.0], None), TypeError, "x must be a torch.Tensor, got list"),
        ((torch.ones(3, 4, dtype=torch.int32), torch.ones(4)), TypeError,
         r"x must have dtype in \(float32, float16, bfloat16\), got int32"),
        ((torch.tensor(1.0), torch.ones(1)), ValueError, "x must have at least 1 dimension"),
        ((torch.ones(3, 4), torch.ones(5)), ValueError,
         r"weight must have shape \(4,\) to match the last dimension of x"),
        ((torch.ones(3, 4), torch.ones(1, 4)), ValueError, "weight must be 1-D"),
        ((torch.ones(3, 4), torch.ones(4, dtype=torch.int64)), TypeError, "weight must have dtype"),
        ((torch.ones(3, 4), torch.ones(4, device="meta")), ValueError, "weight must be on"),
        ((torch.ones(3, 4, device="meta"), torch.ones(4)), ValueError, "x must be on"),
        ((torch.ones(1, MAX_N + 1), torch.ones(MAX_N + 1)), ValueError,
         r"x.shape\[-1\] = 65537 is longer than the 65536"),
        ((torch.ones(3, 4), torch.ones(4), -1.0), ValueError, "eps must be a finite number >= 0"),
        ((torch.ones(3, 4), torch.ones(4), "1e-6"), TypeError, "eps must be a float, got str"),
    ],
)
def test_bad_input(args, exc, match, dev):
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) and a.device.type != "meta" else a
                 for a in args)
    with pytest.raises(exc, match=match):
        rmsnorm(*args)


@pytest.mark.parametrize(
    "residual, exc, match",
    [
        (torch.ones(3, 5), ValueError, "x and residual must have the same shape"),
        (torch.ones(3, 4, dtype=torch.float16), TypeError,
         "x and residual must have the same dtype"),
        (None, TypeError, "residual must be a torch.Tensor, got NoneType"),
    ],
)
def test_add_rmsnorm_bad_residual(residual, exc, match, dev):
    residual = residual.to(dev) if residual is not None else None
    with pytest.raises(exc, match=match):
        add_rmsnorm(torch.ones(3, 4, device=dev), residual, torch.ones(4, device=dev))


# Launch shapes other than the defaults: several rows a program, tiles loaded ahead
# (num_stages), the persistent forward (num_stages > 1), more tiles than programs.
CONFIGS = [RowConfig(1, 256, 4, 1), RowConfig(2, 256, 4, 3), RowConfig(4, 256, 8, 2),
           RowConfig(8, 256, 8, 1), RowConfig(1, 256, 4, chunk=64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_launch_configs(config, dtype, dev, seed):
    m, n = 37, 201
    x, w = _inputs((m, n), dtype, dev)
    r, dy, dh = (torch.randn(m, n, device=dev).to(dtype) for _ in range(3))
    y, h, rstd = rms_forward(x, r, w, 1e-6, config=config)
    want = outputs_and_grads(add_rmsnorm_ref, [x.float(), r.float(), w.float()], [dy, dh])

    def torch_lowp(x, r, w):
        h = x + r
        return F.rms_norm(h, (n,), w, 1e-6), h

    lowp = outputs_and_grads(torch_lowp, [x, r, w], [dy, dh])
    dx, dw = rms_backward(dy, h, w, rstd, dh, config=config)
    got = [y, h, dx, dx, dw.to(w.dtype)]
    names = ["out", "new_residual", "dx", "dresidual", "dweight"]
    for name, g, ref, t in zip(names, got, want, lowp):
        if dtype == torch.float32:
            assert_close(g, ref, atol=1e-5, rtol=1e-4, name=name)
        else:
            assert_close_lowp(g, ref, t, atol=1e-2, name=name)


@pytest.mark.parametrize("n", [1, 100, 1024, 4097, 16384, MAX_N])
@pytest.mark.parametrize("element_size", [2, 4])
def test_default_configs(n, element_size):
    """The heuristics cover the row and keep the staged tiles in shared memory."""
    for cfg, tensors in [(fwd_config(n, element_size), 1), (bwd_config(n, element_size), 2),
                         (bwd_config(n, element_size, tensors=3), 3)]:
        assert cfg.block_n >= n and cfg.block_n & (cfg.block_n - 1) == 0
        assert cfg.num_warps in (4, 8, 16, 32)
        assert 1 <= cfg.per_thread <= 64
        staged = cfg.num_stages * cfg.block_m * cfg.block_n * element_size * tensors
        assert cfg.num_stages == 1 or staged <= SMEM_FOR_STAGES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_forward_without_residual(dtype, dev, seed):
    """RMSNorm's two-pass forward (sums of squares in chunks, then y from a second read
    of the row), as the default configuration takes it for fp32 rows of 16384; here
    201 columns in chunks of 64, the last one partial."""
    m, n = 37, 201
    x, w = _inputs((m, n), dtype, dev)
    y, h, _ = rms_forward(x, None, w, 1e-6, config=RowConfig(2, 256, 4, chunk=64))
    assert h is None
    want = rmsnorm_ref(x.float(), w.float(), 1e-6)
    if dtype == torch.float32:
        assert_close(y, want, atol=1e-5, rtol=1e-4, name="y")
    else:
        assert_close_lowp(y, want, F.rms_norm(x, (n,), w, 1e-6), atol=1e-2, name="y")


def test_forward_config_adjustments():
    """RMSNorm rows of 16384 (fp32 and bf16) take the two-pass forward; add_rmsnorm packs
    short rows four to a 16-warp program; other shapes keep :func:`fwd_config`."""
    for size in (2, 4):
        long = rms_fwd_config(16384, size, False)
        assert 0 < long.chunk < long.block_n and long.block_n % long.chunk == 0
    assert rms_fwd_config(8192, 2, False) == fwd_config(8192, 2)
    assert rms_fwd_config(16384, 4, True) == fwd_config(16384, 4)
    short = rms_fwd_config(1024, 2, True)
    assert (short.block_m, short.num_warps, short.per_thread) == (4, 16, 8)
    assert rms_fwd_config(100, 4, True).block_n == 128

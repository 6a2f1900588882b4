import pytest
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.ops._rowwise import RowConfig
from llmnote.ops.layernorm import MAX_N, layernorm, layernorm_ref
from llmnote.ops.layernorm import _backward as ln_backward
from llmnote.ops.layernorm import _forward as ln_forward
from llmnote.testing import MismatchError, assert_close, assert_close_lowp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Odd sizes: rows not a multiple of BLOCK_M, lengths not a power of two, 1-element
# rows, 3-D input, 300 rows (several row tiles per backward program, so the
# cross-row sums of dweight and dbias are exercised), long rows several to a
# backward program, a long row whose dx takes the chunked second pass (N > 16384,
# not a multiple of the chunk) and the longest row supported.
SHAPES = [(1, 1), (3, 7), (37, 129), (2, 3, 341), (5, 1823), (300, 129), (20, 4100),
          (3, 16389), (1, MAX_N - 3)]
LOWP_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
NAMES = ["y", "dx", "dweight", "dbias"]


def outputs_and_grads(fn, inputs, dy):
    """``fn(*inputs)``, then d(sum(out * dy))/d(input) for every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dy.to(out.dtype))]


def check_all(inputs, dy, eps=1e-5):
    """Output and gradients against layernorm_ref run in fp32 (autograd); in fp16/bf16
    the error may be at most twice that of ``F.layer_norm`` in that dtype, plus atol."""
    dtype = inputs[0].dtype
    got = outputs_and_grads(lambda x, w, b: layernorm(x, w, b, eps), inputs, dy)
    want = outputs_and_grads(lambda x, w, b: layernorm_ref(x, w, b, eps),
                             [t.float() for t in inputs], dy)
    if dtype == torch.float32:
        for name, g, w in zip(NAMES, got, want):
            assert_close(g, w, atol=1e-5, rtol=1e-4, name=name)
        return
    n = inputs[0].shape[-1]
    lowp = outputs_and_grads(lambda x, w, b: F.layer_norm(x, (n,), w, b, eps), inputs, dy)
    for name, g, w, t in zip(NAMES, got, want, lowp):
        assert g.dtype == t.dtype, f"{name}: dtype {g.dtype}, PyTorch gives {t.dtype}"
        assert_close_lowp(g, w, t, atol=LOWP_ATOL[dtype], name=name)


def _inputs(shape, dtype, dev):
    x = (torch.randn(shape, device=dev) * 2 + 3).to(dtype)  # an offset the mean must remove
    w = (1 + 0.5 * torch.randn(shape[-1], device=dev)).to(dtype)
    b = torch.randn(shape[-1], device=dev).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(shape, dtype, dev, seed):
    check_all(_inputs(shape, dtype, dev), torch.randn(shape, device=dev).to(dtype))


def test_reference_is_torch_layer_norm(dev, seed):
    x, w, b = _inputs((17, 300), torch.float32, dev)
    assert_close(layernorm_ref(x, w, b, 1e-3), F.layer_norm(x, (300,), w, b, 1e-3),
                 atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_and_eps(dtype, dev, seed):
    big, w, b = _inputs((40, 700), dtype, dev)
    dy = torch.randn(40, 700, device=dev).to(dtype)
    check_all([big[:, 13:514], w[:501], b[:501]], dy[:, :501])  # row stride 700
    check_all([big[:, :80].t(), w[:40], b[::2][:40]], dy[:40, :80].t())  # column stride 700
    check_all([big[:, :50] * 1e-3, w[:50], b[:50]], dy[:, :50], eps=0.1)  # eps dominates


def test_constant_rows(dev):
    """Zero variance: the output is the bias, and nothing is NaN."""
    x = torch.full((3, 20), 7.0, device=dev)
    w, b = torch.randn(20, device=dev), torch.randn(20, device=dev)
    assert_close(layernorm(x, w, b), b.expand(3, 20), atol=1e-5, rtol=0)


def test_grads_are_deterministic(dev, seed):
    inputs = _inputs((300, 129), torch.float32, dev)
    dy = torch.randn(300, 129, device=dev)
    first = outputs_and_grads(layernorm, inputs, dy)
    again = outputs_and_grads(layernorm, inputs, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_check_catches_a_wrong_gradient(dev, seed):
    """The comparison used above must fail when dbias misses the last row."""
    inputs = _inputs((300, 129), torch.float32, dev)
    dy = torch.randn(300, 129, device=dev)
    dbias = outputs_and_grads(layernorm, inputs, dy)[3]
    want = outputs_and_grads(layernorm_ref, inputs, dy)[3]
    assert_close(dbias, want, atol=1e-5, rtol=1e-4, name="dbias")
    with pytest.raises(MismatchError, match=r"dbias: .* elements differ"):
        assert_close(dbias - dy[-1], want, atol=1e-5, rtol=1e-4, name="dbias")


def test_reference_backend_calls_the_reference(monkeypatch, dev, seed):
    monkeypatch.setattr(device, "use_reference", lambda op, min_capability=None: True)
    x, w, b = _inputs((3, 10), torch.float32, dev)
    assert torch.equal(layernorm(x, w, b), layernorm_ref(x, w, b))


def test_empty(dev):
    w = torch.ones(5, device=dev)
    assert layernorm(torch.empty(2, 0, 5, device=dev), w, w).shape == (2, 0, 5)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (("x", None, None), TypeError, "x must be a torch.Tensor, got str"),
        ((torch.ones(3, 4, dtype=torch.float64), torch.ones(4), torch.ones(4)), TypeError,
         r"x must have dtype in \(float32, float16, bfloat16\), got float64"),
        ((torch.ones(3, 4), torch.ones(3), torch.ones(4)), ValueError,
         r"weight must have shape \(4,\) to match the last dimension of x"),
        ((torch.ones(3, 4), torch.ones(4), torch.ones(2, 2)), ValueError, "bias must be 1-D"),
        ((torch.ones(3, 4), torch.ones(4), None), TypeError, "bias must be a torch.Tensor"),
        ((torch.ones(3, 4), torch.ones(4), torch.ones(4, device="meta")), ValueError,
         "bias must be on"),
        ((torch.ones(2, MAX_N + 5), torch.ones(MAX_N + 5), torch.ones(MAX_N + 5)), ValueError,
         r"x.shape\[-1\] = 65541 is longer than the 65536"),
        ((torch.ones(3, 4), torch.ones(4), torch.ones(4), float("nan")), ValueError,
         "eps must be a finite number >= 0, got nan"),
    ],
)
def test_bad_input(args, exc, match, dev):
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) and a.device.type != "meta" else a
                 for a in args)
    with pytest.raises(exc, match=match):
        layernorm(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [RowConfig(1, 256, 4, 1), RowConfig(2, 256, 4, 3),
                                    RowConfig(4, 256, 8, 2), RowConfig(1, 256, 4, chunk=64),
                                    RowConfig(2, 256, 4, chunk=128)], ids=str)
def test_launch_configs(config, dtype, dev, seed):
    """Several rows a program, tiles loaded ahead, the persistent forward, dx in a
    second pass over the row in chunks (201 columns: the last chunk is partial): same
    results."""
    m, n = 37, 201
    x, w, b = _inputs((m, n), dtype, dev)
    dy = torch.randn(m, n, device=dev).to(dtype)
    y, mean, rstd = ln_forward(x, w, b, 1e-5, config=config)
    dx, (dw, db) = ln_backward(dy, x, w, mean, rstd, config=config)
    got = [y, dx, dw.to(dtype), db.to(dtype)]
    want = outputs_and_grads(layernorm_ref, [x.float(), w.float(), b.float()], dy)
    lowp = outputs_and_grads(lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), [x, w, b], dy)
    for name, g, ref, t in zip(NAMES, got, want, lowp):
        if dtype == torch.float32:
            assert_close(g, ref, atol=1e-5, rtol=1e-4, name=name)
        else:
            assert_close_lowp(g, ref, t, atol=1e-2, name=name)


def test_long_rows_take_the_chunked_pass():
    """LayerNorm keeps 4 row arrays: from N = 16384 on (16 values a thread) its backward
    computes dx in a second pass; RMSNorm (3 arrays) only from N = 32768 on."""
    from llmnote.ops._rowwise import bwd_config
    assert bwd_config(8192, 2, arrays=4).chunk == 0
    for n in (16384, 16385, MAX_N):
        cfg = bwd_config(n, 2, arrays=4)
        assert 0 < cfg.chunk < cfg.block_n and cfg.block_n % cfg.chunk == 0
        assert cfg.num_stages == 1 and cfg.per_thread <= 64
    assert bwd_config(16384, 2, arrays=4).num_warps == 16  # 128 registers a thread
    assert bwd_config(16384, 2, arrays=3).chunk == 0 and bwd_config(32768, 4).chunk > 0


@pytest.mark.skipif(not device.on_gpu(), reason="register caps apply to compiled kernels only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1000, 1024, 4096])
def test_register_caps_change_no_output(n, dtype, seed):
    """The forward's default shapes up to N = 4096 cap the registers (``maxnreg``) so that
    the rare fp64 branch does not lower the occupancy of every tile. The cap only moves
    values between registers and local memory: on rows that take the branch (constant,
    huge, nearly constant, a NaN) and rows that do not, every output equals the same
    launch uncapped, bit for bit."""
    import dataclasses

    from llmnote.ops.layernorm import _fwd_config
    cfg = _fwd_config(n, dtype.itemsize)
    assert cfg.maxnreg > 0
    x, w, b = _inputs((67, n), dtype, "cuda")
    x[0], x[1], x[2] = 3.7, 3e38, float("nan")
    x[3, ::7] = 3e38
    x[4] = 1000.0 + torch.randn(n, device="cuda") * 1e-3
    got = ln_forward(x, w, b, 1e-5, config=cfg)
    want = ln_forward(x, w, b, 1e-5, config=dataclasses.replace(cfg, maxnreg=0))
    for name, g, ref in zip(["y", "mean", "rstd"], got, want):
        assert torch.equal(g.isnan(), ref.isnan()), name
        assert torch.equal(g.nan_to_num(), ref.nan_to_num()), name

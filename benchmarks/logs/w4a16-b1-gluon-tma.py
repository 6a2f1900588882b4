"""#30: an experiment, not shipped. Batch-1 W4A16 GEMV in Gluon whose weight tiles (16 packed rows,
one group of 128 channels, by BN columns) and their scales and zeros arrive by TMA in a ring of
shared-memory slots, so the bytes in flight take no registers; every warp decodes from shared
memory in an explicit BlockedLayout (R packed rows x 8 columns a thread, no layout conversion),
with the decode and affine correction of the Triton kernels. It writes fp32 partial sums per
K slice (no split-K reduction: the timing leaves that out). Run on the H200 as two files
(.scratch), merged here. Run: python3 benchmarks/logs/w4a16-b1-gluon-tma.py. Log:
w4a16-b1-limits-h200-2026-11-29.txt, section 5."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from llmnote.ops.gluon._common import cta_barrier, tma_load

ROWS = 16  # packed rows per step: one group of 128


@gluon.jit
def _issue(q_desc, s_desc, z_desc, ready, q_ring, s_ring, z_ring, step, slot, off_n, issue):
    nbytes: gl.constexpr = q_desc.block_type.nbytes + s_desc.block_type.nbytes + z_desc.block_type.nbytes
    mbarrier.expect(ready.index(slot), nbytes, pred=issue)
    tma_load(q_desc, [step * 16, off_n], ready.index(slot), q_ring.index(slot), pred=issue)
    tma_load(s_desc, [step, off_n], ready.index(slot), s_ring.index(slot), pred=issue)
    tma_load(z_desc, [step, off_n], ready.index(slot), z_ring.index(slot), pred=issue)


@gluon.jit
def _gemv_tma_kernel(q_desc, s_desc, z_desc, x_ptr, ws_ptr, N, n_steps, per, NIBBLE,
                     NUM_STAGES: gl.constexpr, R: gl.constexpr):
    BN: gl.constexpr = q_desc.block_type.shape[1]
    TR: gl.constexpr = 16 // R
    L: gl.constexpr = gl.BlockedLayout(size_per_thread=[R, 8], threads_per_warp=[TR, 32 // TR],
                                       warps_per_cta=[1, gl.num_warps()], order=[1, 0])
    RL: gl.constexpr = gl.SliceLayout(1, L)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    off_n = pid_n * BN
    lo = pid_k * per
    hi = gl.minimum(lo + per, n_steps)
    q_ring = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 16, BN], q_desc.layout)
    s_ring = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 1, BN], s_desc.layout)
    z_ring = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 1, BN], z_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(j), count=1)
    for j in gl.static_range(NUM_STAGES):
        _issue(q_desc, s_desc, z_desc, ready, q_ring, s_ring, z_ring, lo + j, j, off_n, lo + j < hi)
    mask_lo = NIBBLE
    mask_hi = NIBBLE << 4
    rows = gl.arange(0, 16, layout=RL)
    acc = gl.zeros([16, BN], gl.float32, layout=L)
    for k in range(lo, hi):
        i = k - lo
        slot = i % NUM_STAGES
        mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
        words = q_ring.index(slot).load(L)
        s = s_ring.index(slot).load(L).to(gl.float32)
        z = z_ring.index(slot).load(L).to(gl.float32)
        cta_barrier()
        fence_async_shared()
        _issue(q_desc, s_desc, z_desc, ready, q_ring, s_ring, z_ring, k + NUM_STAGES, slot, off_n,
               k + NUM_STAGES < hi)
        ch = (k * 16 + rows) * 8
        t = gl.zeros([16, BN], gl.float32, layout=L)
        xe_s = gl.zeros([16], gl.float32, layout=RL)
        xo_s = gl.zeros([16], gl.float32, layout=RL)
        for p in gl.static_range(4):
            if 8 * p <= 15:
                sh = words << (15 - 8 * p)
            else:
                sh = words >> (8 * p - 15)
            f_even = ((sh & mask_lo) | 0x41800000).to(gl.float32, bitcast=True)
            f_odd = ((sh & mask_hi) | 0x3F800000).to(gl.float32, bitcast=True)
            xe = gl.load(x_ptr + ch + 2 * p).to(gl.float32)
            xo = gl.load(x_ptr + ch + 2 * p + 1).to(gl.float32)
            t += gl.expand_dims(xe, 1) * f_even
            t += gl.expand_dims(xo, 1) * f_odd
            xe_s += xe
            xo_s += xo
        x1 = gl.expand_dims(16.0 * xe_s + xo_s, 1)
        x2 = gl.expand_dims(xe_s + xo_s, 1)
        acc += (t - x1) * (s * 16.0) - x2 * (z * s)
    for j in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(j))
    out = gl.sum(acc, axis=0)
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, L))
    gl.store(ws_ptr + pid_k * N + cols, out, mask=cols < N)


def gemv_tma(x, qw, s, z, split, bn=256, stages=4, r=4, warps=4, ws=None):
    K8, N = qw.shape
    n_steps = K8 // 16
    per = triton.cdiv(n_steps, split)
    split = triton.cdiv(n_steps, per)
    ql = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    qd = TensorDescriptor.from_tensor(qw, [16, bn], ql)
    sd = TensorDescriptor.from_tensor(s, [1, bn], sl)
    zd = TensorDescriptor.from_tensor(z, [1, bn], sl)
    if ws is None:
        ws = torch.empty(split, N, device=x.device, dtype=torch.float32)
    from llmnote.quant.kernels.w4_decode import NIBBLE
    _gemv_tma_kernel[(triton.cdiv(N, bn), split)](qd, sd, zd, x, ws, N, n_steps, per, NIBBLE,
                                                  NUM_STAGES=stages, R=r, num_warps=warps)
    return ws


if __name__ == "__main__":
    import math
    import itertools
    from llmnote.bench.suites.quant import _w4_weights, _graph_timing, GROUP, L2_FLUSH_BYTES
    from llmnote.bench.ceilings import copy_bandwidth
    from llmnote.bench.results import ceiling
    from llmnote.quant import kernels as K
    dev = torch.device("cuda")
    copy = ceiling(copy_bandwidth())
    print(f"# {torch.cuda.get_device_name()} copy {copy:.0f} GB/s", flush=True)
    SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o": (4096, 4096)}
    LAYOUTS = [(4, 4, 256), (4, 2, 128), (2, 4, 128), (2, 8, 256), (8, 4, 512), (8, 2, 256)]  # (R, warps, bn)
    for label, (k, n) in SHAPES.items():
        qw, s, z = _w4_weights(k, n, dev)
        qbytes = qw.numel() * 4 + (s.numel() + z.numel()) * 2
        nq = max(1, math.ceil(L2_FLUSH_BYTES / qbytes))
        qs = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(nq - 1)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = K.w4a16_linear_ref(x, qw, s, z, GROUP).float()
        tol = 2**-7 * ref.abs().max().item()
        t = _graph_timing([lambda t=t: K.w4a16_linear(x, *t, GROUP) for t in qs], max(nq, 8)).p50
        print(f"{label}: shipped {t * 1e3:.1f} us {qbytes / (t * 1e-3) / 1e9 / copy:.2f}", flush=True)
        res = []
        for (r, w, bn), st, split in itertools.product(LAYOUTS, (2, 4, 6), (1, 2, 4, 8, 16)):
            tiles = math.ceil(n / bn)
            if tiles * split > 1200 or (k // 128) // split < 2:
                continue
            try:
                ws = gemv_tma(x, qw, s, z, split, bn=bn, stages=st, r=r, warps=w)
                err = (ws.sum(0).to(torch.bfloat16).float() - ref).abs().max().item()
                if err > tol:
                    print(label, r, w, bn, st, split, "WRONG", err, tol, flush=True); continue
                wss = [torch.empty_like(ws) for _ in qs]
                t = _graph_timing([lambda t=t, o=o: gemv_tma(x, *t, split, bn=bn, stages=st, r=r, warps=w, ws=o)
                                   for t, o in zip(qs, wss)], max(nq, 8)).p50
            except Exception as e:
                print(label, r, w, bn, st, split, "error", repr(e)[:300], flush=True); continue
            res.append((t, r, w, bn, st, split))
        res.sort()
        for t, r, w, bn, st, split in res[:6]:
            print(f"  {label} tma-ring {t * 1e3:6.1f} us {qbytes / (t * 1e-3) / 1e9 / copy:.2f} R {r} warps {w} bn {bn} stages {st} split {split} (partials, no reduce)", flush=True)

"""Paged MLA decode against its two PyTorch peers, at DeepSeek-V3's attention shapes.

Bench ``mla-decode`` (``x_name = "context"``): one query token per sequence,
``H = 128`` heads, latent ``r = 512``, rope ``dr = 64`` (nope 128, value 128),
bf16, batch 1 to 64, every sequence ``context`` long. Bandwidth = the latent
rows read (``B * context * (r + dr) * 2`` bytes) / time; ``copy_fraction`` =
that over the copy bandwidth measured at the start of the same run (row
``bench = ceiling``, provider ``copy``); a recording (not a quick run) also
records a dense matmul in the dtype (provider ``matmul-bf16``), the tensor cores'
ceiling. Providers:

* ``llmnote``: :func:`llmnote.ops.attention.mla_decode.mla_decode` with its
  defaults on a paged cache (64-token pages, shuffled), the absorbed query
  given; checked against the fp32 reference first. On a Hopper GPU that is the
  warp-specialised Gluon kernel (:mod:`llmnote.ops.gluon.mla`), elsewhere the
  Triton one. Its rows name the kernel and tile (``tile``: ``"gluon 64x32
  s4"``, or the tile the Triton autotuner chose) and the count of splits
  (``splits``);
* ``llmnote-triton``: the Triton kernel (``kernel="triton"``), where the
  default is the Gluon one: the step from the portable kernel to Hopper's;
* ``sdpa-absorbed``: SDPA on the absorbed form over a contiguous latent cache,
  the heads laid out as the query rows of one kv head (``q (B, 1, H, r + dr)``,
  ``k = [c, k_rope] (B, 1, L, r + dr)``, ``v = c``), SDPA's own backend;
* ``torch-naive``: decompress ``K, V`` from the latent (``kv_b_proj`` GEMM),
  then SDPA per head; skipped where ``K, V`` would not fit in memory.

The peers read a contiguous cache (no block table), which favours them.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.bench.ceilings import copy_bandwidth, matmul_rate
from llmnote.bench.harness import Skip, sweep
from llmnote.bench.results import ceiling
from llmnote.bench.suites.common import dtype_name
from llmnote.ops.attention._common import num_sms
from llmnote.ops.attention.mla_decode import (
    _gluon_takes, _mla_split_kernel, choose_mla_splits, mla_decode, mla_decode_ref,
)
from llmnote.ops.gluon import mla as gluon_mla
from llmnote.testing import assert_close_lowp

BENCH = "mla"
V3 = dict(heads=128, latent=512, rope=64, nope=128, value=128)  # DeepSeek-V3 attention
BATCHES = [1, 4, 16, 64]
CONTEXTS = [1024, 4096, 8192, 16384, 32768]
PAGE = 64


def _inputs(b: int, ctx: int, s: dict, dtype, page: int = PAGE, seed: int = 0) -> dict:
    dev = device.default_device()
    g = torch.Generator(device=dev).manual_seed(seed)
    h, r, dr, dn, dv = s["heads"], s["latent"], s["rope"], s["nope"], s["value"]
    per = -(-ctx // page)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)
    rows = rnd(b, per * page, r + dr)  # the latent cache, contiguous: (B, L, r + dr)
    perm = torch.randperm(b * per, generator=g, device=dev)
    cache = torch.empty((b * per, page, r + dr), dtype=dtype, device=dev)
    # page j of sequence i goes to block perm[i * per + j]
    cache[perm] = rows.view(b * per, page, r + dr)
    return dict(
        q_lat=rnd(b, h, r, scale=r ** -0.25), q_rope=rnd(b, h, dr, scale=r ** -0.25),
        q_nope=rnd(b, h, dn, scale=dn ** -0.25), rows=rows[:, :ctx], cache=cache,
        tables=perm.view(b, per).to(torch.int32),
        lens=torch.full((b,), ctx, dtype=torch.int32, device=dev),
        w_kv_b=rnd(h * (dn + dv), r, scale=r ** -0.5), scale=(dn + dr) ** -0.5,
    )


def _tile_name(config) -> str:
    """``"64x64 w8 s2 tma"``: heads x positions, warps, stages, and whether by TMA."""
    kw = config.kwargs
    return (f"{kw['BLOCK_H']}x{kw['BLOCK_N']} w{config.num_warps} s{config.num_stages}"
            + (" tma" if kw.get("TMA") else ""))


def _gluon_default(x: dict) -> bool:
    """Whether mla_decode's default takes the Gluon kernel for these inputs."""
    return _gluon_takes(x["q_lat"], x["q_rope"], x["cache"])


def _providers(b: int, s: dict, dtype, chosen: dict | None = None) -> dict:
    """The four providers at batch ``b``; ``chosen[ctx]`` gets the kernel and tile of
    llmnote's default (the Triton autotuner's pick is made at its first call at a size)."""
    def ours(ctx, kernel=None):
        x = _inputs(b, ctx, s, dtype)
        if kernel == "triton" and not _gluon_default(x):
            raise Skip("the default is the Triton kernel here (provider llmnote)")
        args = (x["q_lat"], x["q_rope"], x["cache"], x["tables"], x["lens"], x["scale"])
        got = mla_decode(*args, kernel=kernel)
        if chosen is not None and kernel is None:
            chosen[ctx] = (f"gluon {gluon_mla.BLOCK_H}x{gluon_mla.BLOCK_N} s{gluon_mla.STAGES}"
                           if _gluon_default(x) else _tile_name(_mla_split_kernel.best_config))
        sl = slice(0, min(b, 2))
        ref = mla_decode_ref(*(t[sl].float() if t.is_floating_point() else t[sl]
                               for t in args[:2]), x["cache"].float(), x["tables"][sl],
                             x["lens"][sl], x["scale"])
        peer = mla_decode_ref(args[0][sl], args[1][sl], x["cache"], x["tables"][sl],
                              x["lens"][sl], x["scale"])
        assert_close_lowp(got[sl], ref, peer, atol=2**-10 * float(ref.abs().max()),
                          name=f"llmnote mla_decode (kernel={kernel})")
        return lambda: mla_decode(*args, validate=False, kernel=kernel)

    def sdpa_absorbed(ctx):
        x = _inputs(b, ctx, s, dtype)
        q = torch.cat([x["q_lat"], x["q_rope"]], dim=-1)[:, None]  # (B, 1, H, r + dr)
        k = x["rows"][:, None]  # (B, 1, L, r + dr)
        v = k[..., :s["latent"]]  # (B, 1, L, r): the latent is the value

        def f():
            return F.scaled_dot_product_attention(q, k, v, scale=x["scale"])
        try:
            f()
        except RuntimeError as e:
            raise Skip(str(e).splitlines()[0][:120]) from None
        return f

    def naive(ctx):
        h, dn, dv = s["heads"], s["nope"], s["value"]
        elem = torch.empty((), dtype=dtype).element_size()
        need = b * ctx * h * (2 * dn + s["rope"] + 2 * dv) * elem  # K, V and their copies
        if device.on_gpu() and need > 0.4 * device.memory_available(torch.device("cuda")):
            raise Skip(f"decompressed K and V need ~{need / 2**30:.0f} GiB from batch {b}, "
                       f"context {ctx}")
        x = _inputs(b, ctx, s, dtype)
        q = torch.cat([x["q_nope"], x["q_rope"]], dim=-1)[:, :, None]  # (B, H, 1, dn + dr)
        rows, w = x["rows"], x["w_kv_b"]

        def f():
            kv = (rows[..., :s["latent"]] @ w.T).view(b, ctx, h, dn + dv).transpose(1, 2)
            k_rope = rows[..., s["latent"]:][:, None].expand(-1, h, -1, -1)
            k = torch.cat([kv[..., :dn], k_rope], dim=-1)  # (B, H, L, dn + dr)
            return F.scaled_dot_product_attention(q, k, kv[..., dn:], scale=x["scale"])
        f()
        return f

    return {"llmnote": ours, "llmnote-triton": lambda ctx: ours(ctx, "triton"),
            "sdpa-absorbed": sdpa_absorbed, "torch-naive": naive}


def run(quick: bool = False, shapes: dict | None = None, batches: list[int] | None = None,
        contexts: list[int] | None = None, dtype: torch.dtype = torch.bfloat16) -> pd.DataFrame:
    """The MLA decode benchmark (quick: batch 16 at 4k and 16k); ``shapes``, ``batches``
    and ``contexts`` override the defaults (a CPU smoke test uses tiny ones)."""
    s = {**V3, **(shapes or {})}
    batches = batches or ([16] if quick else BATCHES)
    contexts = contexts or ([4096, 16384] if quick else CONTEXTS)
    copy = copy_bandwidth()
    copy_gbs = ceiling(copy)
    # the tensor cores' side: a large dense product in the same dtype, in the same run (a
    # recording; a quick run, such as the chapter's on the reader's GPU, skips it)
    frames = [copy] + ([] if quick else [matmul_rate(dtype)])
    rep = 50 if device.on_gpu() else 5
    sms = num_sms(device.default_device())
    for b in batches:
        def nbytes(ctx, b=b):
            return b * ctx * (s["latent"] + s["rope"]) * torch.empty((), dtype=dtype).element_size()

        def gbs(ctx, ms, nbytes=nbytes):
            return nbytes(ctx) / (ms * 1e-3) / 1e9

        metrics = {"bandwidth": ("GB/s", gbs),
                   "copy_fraction": ("", lambda ctx, ms, gbs=gbs: gbs(ctx, ms) / copy_gbs)}
        chosen: dict = {}
        rows = sweep(
            "mla-decode", "context", contexts, _providers(b, s, dtype, chosen), metrics,
            rep_ms=rep, extra=lambda ctx, b=b, nbytes=nbytes: {
                "B": b, "H": s["heads"], "latent": s["latent"], "rope": s["rope"],
                "page": PAGE, "dtype": dtype_name(dtype), "latent_bytes": nbytes(ctx)},
        )
        # llmnote's rows name its launch: the autotuned tile and the count of splits
        ours = rows["provider"] == "llmnote"
        rows.loc[ours, "tile"] = rows.loc[ours, "x_value"].map(chosen)
        rows.loc[ours, "splits"] = [
            choose_mla_splits(b, s["heads"], -(-ctx // PAGE) * PAGE, sms)
            for ctx in rows.loc[ours, "x_value"]]
        frames.append(rows)
    return pd.concat(frames, ignore_index=True)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Copy fraction by (batch, context) and provider."""
    rows = df[(df["bench"] == "mla-decode") & (df["metric"] == "copy_fraction")]
    return rows.pivot_table(index=["B", "x_value"], columns="provider", values="p50")

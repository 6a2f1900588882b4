"""The engine's step for a model with multi-head latent attention (DeepSeek-V3).

The cache is a second kind beside the key/value cache of
:class:`~llmnote.engine.model_runner.ModelRunner`: per layer one tensor
``(num_blocks, block_size, r + dr)`` holding each token's latent ``c`` and its
rope key, one row per token for all heads (576 numbers for DeepSeek-V3 instead
of ``2 * 128 * 128`` keys and values with MHA). Blocks, the block table, the
scheduler, prefix caching and sampling are the engine's own; only the layer
differs. Each layer of a step, on the packed tokens ``(T, hidden)``:

1. project: the query (with its RoPE part), the latent and the rope key
   (:meth:`llmnote.models.deepseek.MLAttention.project`); write ``[c, k_rope]``
   at the tokens' slots;
2. absorb ``W_UK`` into the query: ``q_lat (T, H, r)``;
3. attend over the paged rows: a decode-only step takes the paged MLA kernel
   (:func:`llmnote.ops.attention.mla_decode.mla_decode`: on a Hopper GPU the Gluon kernel,
   for which the engine's default ``block_size`` becomes 64, :func:`preferred_block_size`;
   elsewhere the Triton one) on a GPU, or wherever ``attention_backend="paged"``; prefills
   and the CPU take :func:`mla_paged_attention_ref` (bottom-right causal, plain PyTorch);
4. ``W_UV`` then ``o_proj``, and the MLP (dense SwiGLU, or DeepSeek-V3's mixture of
   experts).

On a GPU the decode steps replay CUDA graphs as the other runner's do
(:mod:`llmnote.engine.cuda_graphs`: static inputs, a scratch block for padded rows, the
graph of each batch size captured at its first step); the captured forward is
:meth:`MLAModelRunner._mla_layers` with the paged MLA kernel. Multi-step decoding
(:mod:`llmnote.engine.multistep`, ``decode_steps``: 8 with graphs) is the other runner's:
the captured step feeds itself its inputs and its greedy tokens, so a run of decode steps
is replays, the host reading the tokens once at the end.
"""

from __future__ import annotations

import torch

from llmnote import device
from llmnote.engine.attention import AttentionMetadata
from llmnote.engine.config import GRAPH_DECODE_STEPS, EngineConfig
from llmnote.engine.cuda_graphs import use_graphs
from llmnote.engine.kv_cache import choose_num_blocks
from llmnote.engine.model_runner import ModelRunner
from llmnote.engine.paged_kernel import _inputs
from llmnote.engine.step_kernels import feed_step, greedy_tokens
from llmnote.models.deepseek import DeepseekV3, absorb_weights


def mla_paged_attention_ref(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                            meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
    """Packed queries ``q_lat (T, H, r)``, ``q_rope (T, H, dr)`` over the paged rows
    ``kv_cache (num_blocks, block_size, r + dr)`` -> ``(T, H, r)``; sequence ``b``'s
    queries are the last of its ``context_lens[b]`` positions (bottom-right causal)."""
    r = q_lat.shape[-1]
    out = torch.empty_like(q_lat)
    bs = kv_cache.shape[1]
    for b in range(meta.batch):
        q0, q1, n_k = meta.cu_seqlens_q[b], meta.cu_seqlens_q[b + 1], meta.context_lens[b]
        blocks = torch.tensor(meta.block_tables[b][: -(-n_k // bs)], dtype=torch.long,
                              device=kv_cache.device)
        rows = kv_cache[blocks].flatten(0, 1)[:n_k].float()  # (n_k, r + dr)
        q = torch.cat([q_lat[q0:q1], q_rope[q0:q1]], dim=-1).float()  # (n_q, H, r + dr)
        s = torch.einsum("qhd,kd->hqk", q, rows) * sm_scale  # (H, n_q, n_k)
        n_q = q1 - q0
        allowed = torch.arange(n_k, device=s.device)[None, :] <= \
            torch.arange(n_k - n_q, n_k, device=s.device)[:, None]  # (n_q, n_k)
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("hqk,kr->qhr", p, rows[:, :r]).to(out.dtype)
    return out


def preferred_block_size(model: object) -> int | None:
    """The cache block size that ``model``'s decode kernel prefers, or None for the engine's
    default: for a latent-attention model, the page at which
    :func:`~llmnote.ops.attention.mla_decode.mla_decode` takes the Gluon kernel on this GPU
    (64: a Hopper GPU, bf16/fp16, ``r = 512``, ``dr = 64``); for any other model, None."""
    if not isinstance(model, DeepseekV3):
        return None
    from llmnote.ops.attention.mla_decode import preferred_page

    c, p = model.config, next(model.parameters())
    return preferred_page(c.kv_lora_rank, c.qk_rope_head_dim, p.dtype, p.device)


class MLAModelRunner(ModelRunner):
    """:class:`ModelRunner` for :class:`~llmnote.models.deepseek.DeepseekV3`: the latent
    cache, the absorbed attention; batching, sampling and ``run`` are inherited."""

    def __init__(self, model: DeepseekV3, config: EngineConfig) -> None:
        self.model, self.config = model.eval(), config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.ops = model.ops.for_device(self.device)
        c = model.config
        is_cuda = self.device.type == "cuda" and not device.interpreting()
        graphs = use_graphs(model, self.ops, config.cuda_graphs, is_cuda)
        if config.attention_backend == "flash":
            raise ValueError("attention_backend='flash' does not apply to MLA models; pass "
                             "None, 'reference' or 'paged'")
        on_gpu = device.on_gpu() and self.device.type == "cuda"
        self.backend = config.attention_backend or ("paged" if on_gpu else "reference")
        # graphs capture the paged kernel's decode; the reference reads the host
        if config.cuda_graphs and self.backend != "paged":
            raise ValueError("cuda_graphs=True captures the paged MLA kernel: pass "
                             "attention_backend=None or 'paged'")
        self.use_graphs = graphs and self.backend == "paged"
        self.use_gemv, self.use_w4 = False, False
        # multi-step decoding (engine.multistep) as the other runner: the graph feeds itself
        self.decode_steps = config.decode_steps or (GRAPH_DECODE_STEPS if self.use_graphs else 1)
        self.max_model_len = min(config.max_model_len or 10**12, c.max_position_embeddings)
        self.num_blocks = choose_num_blocks(model, config, self.dtype, self.device,
                                            self.max_model_len)
        self.max_model_len = min(self.max_model_len, self.num_blocks * config.block_size)
        # with graphs, one more block: the scratch block that padded rows write to
        shape = (self.num_blocks + self.use_graphs, config.block_size, c.latent_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(c.num_hidden_layers)]
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.graphs, self.num_graph_steps, self.num_decode_runs = {}, 0, 0
        self.absorbed = [absorb_weights(layer.self_attn.kv_b_proj.weight, c.num_attention_heads,
                                        c.qk_nope_head_dim) for layer in model.model.layers]
        if self.use_graphs:
            self._init_graphs()
        self._cold = self.device.type == "cuda"  # the first step compiles in parallel first

    def _attend(self, i: int, q_lat: torch.Tensor, q_rope: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        scale = self.model.config.softmax_scale
        decode_only = q_lat.shape[0] == meta.batch and meta.cu_seqlens_q[-1] == meta.batch
        if self.backend == "paged" and decode_only:
            from llmnote.ops.attention.mla_decode import mla_decode

            tables, _, ctx, _ = _inputs(meta, self.device)  # int32, built once per step
            return mla_decode(q_lat, q_rope, self.kv_caches[i], tables, ctx, scale,
                              validate=False)
        return mla_paged_attention_ref(q_lat, q_rope, self.kv_caches[i], meta, scale)

    def _mla_layers(self, ids: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, attend, rope=None) -> torch.Tensor:
        """The decoder on packed tokens ``ids (T,)`` -> ``(T, hidden)`` before the final
        norm; ``attend(layer, q_lat (T, H, r), q_rope (T, H, dr)) -> (T, H, r)`` reads the
        latent cache after this step's rows are written; ``rope`` replaces the model's."""
        decoder = self.model.model
        x = decoder.embed_tokens(ids)  # (T, hidden)
        t = ids.shape[0]
        for i, layer in enumerate(decoder.layers):
            a = layer.self_attn
            q_nope, q_rope, c, k_rope = a.project(layer.input_layernorm(x)[None], positions,
                                                  rope)
            rows = torch.cat([c[0], k_rope[0]], dim=-1)  # (T, r + dr)
            self.kv_caches[i].view(-1, rows.shape[-1])[slot_mapping] = rows.to(self.dtype)
            w_uk, w_uv = self.absorbed[i]
            q_lat = torch.einsum("htd,hdr->thr", q_nope[0], w_uk).contiguous()  # (T, H, r)
            o_lat = attend(i, q_lat, q_rope[0].transpose(0, 1).contiguous())
            o = torch.einsum("thr,hdr->thd", o_lat, w_uv)  # (T, H, dv)
            x = x + a.o_proj(o.reshape(t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_rows: list[int]) -> torch.Tensor:
        """ids, positions: (T,) -> logits (len(logits_rows), vocab) of the chosen rows."""
        x = self._mla_layers(ids, positions, meta.slot_mapping,
                             lambda i, q_lat, q_rope: self._attend(i, q_lat, q_rope, meta))
        if len(logits_rows) < x.shape[0]:
            x = x[torch.tensor(logits_rows, dtype=torch.long, device=x.device)]
        return self.model.lm_head(self.model.model.norm(x))

    # ------------------------------------------------------------ CUDA graphs
    def _rotary_dim(self) -> int:
        return self.model.config.qk_rope_head_dim

    def _splits(self, b: int) -> int:
        """Unused: :func:`~llmnote.ops.attention.mla_decode.mla_decode` takes its split
        count from the block tables' width (``max_model_len``), the same at every step."""
        return 0

    def _decode_graph_forward(self, b: int, splits: int) -> torch.Tensor:
        """The captured decode forward of the first ``b`` rows of the static buffers."""
        from llmnote.ops.attention.mla_decode import mla_decode

        scale = self.model.config.softmax_scale
        feed_step(self.g_in, self.g_step.tokens, self.g_step.step, self.config.max_num_seqs, b)
        tables, ctx = self.g_tables[:b], self.g_ctx[:b]
        x = self._mla_layers(
            self.g_ids[:b], self.g_pos[:b], self.g_slots[:b],
            lambda i, q_lat, q_rope: mla_decode(q_lat, q_rope, self.kv_caches[i], tables, ctx,
                                                scale, validate=False), self._rope)
        logits = self.model.lm_head(self.model.model.norm(x))  # (b, vocab)
        greedy_tokens(logits, self.g_step)
        return logits

    def close(self) -> None:
        super().close()  # the graphs and their buffers
        self.kv_caches, self.absorbed = [], []

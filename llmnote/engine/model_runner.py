"""Runs one scheduled step on the model: pack the tokens, write their keys and
values into the paged cache, attend, and sample.

The KV cache of each layer is ``(num_blocks, block_size, kv_heads, head_dim)``
for keys and the same for values. Its size is fixed on the CPU and, on a GPU,
the given fraction of the memory left free once the weights are loaded
(minus room for the activations of the largest step).

The forward pass is the one of :class:`llmnote.models.llama.Llama`, called
submodule by submodule on a packed batch ``(1, tokens, hidden)``: the
embedding, norms, projections, the model's RoPE and MLP ops are the model's
own; only attention is replaced by attention over the paged cache
(:mod:`llmnote.engine.attention`). Logits are computed only for the last token
of each sequence that samples in this step.
"""

from __future__ import annotations

import torch

from llmnote import device
from llmnote.engine.attention import BACKENDS, AttentionMetadata, write_kv
from llmnote.engine.config import EngineConfig
from llmnote.engine.sampler import sample
from llmnote.engine.scheduler import ScheduledBatch
from llmnote.models.llama import Llama


def kv_bytes_per_block(model: Llama, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * elem


def choose_num_blocks(model: Llama, config: EngineConfig, dtype: torch.dtype,
                      dev: torch.device) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    if dev.type != "cuda":
        return config.cpu_num_blocks
    c, t = model.config, config.max_num_batched_tokens
    elem = torch.empty((), dtype=dtype).element_size()
    act = t * (6 * c.hidden_size + 3 * c.intermediate_size
               + 3 * c.num_attention_heads * c.head_dim) * elem  # a step's activations, roughly
    act += config.max_num_seqs * c.vocab_size * 4 * 3  # fp32 logits, sorted copy, probabilities
    free, _ = torch.cuda.mem_get_info(dev)
    per_block = kv_bytes_per_block(model, config.block_size, dtype)
    n = int((free * config.gpu_memory_utilization - act) // per_block)
    if n < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache ({free / 2**30:.2f} GiB free)")
    return n


class ModelRunner:
    def __init__(self, model: Llama, config: EngineConfig) -> None:
        self.model, self.config = model.eval(), config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        c = model.config
        self.num_blocks = choose_num_blocks(model, config, self.dtype, self.device)
        shape = (self.num_blocks, config.block_size, c.num_key_value_heads, c.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(c.num_hidden_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(c.num_hidden_layers)]
        on_gpu = device.on_gpu() and self.device.type == "cuda"
        backend = config.attention_backend or ("flash" if on_gpu else "reference")
        self.attention = BACKENDS[backend]
        self.backend = backend
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)

    # ------------------------------------------------------------ inputs
    def prepare(self, batch: ScheduledBatch
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(token ids, positions, attention metadata, rows whose logits are sampled)."""
        bs = self.config.block_size
        ids, pos, slots, cu, ctx, tables, last = [], [], [], [0], [], [], []
        for seq, n in batch.items:
            start = seq.num_computed
            ids.extend(seq.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(seq.block_table[i // bs] * bs + i % bs for i in range(start, start + n))
            cu.append(cu[-1] + n)
            ctx.append(start + n)
            tables.append(seq.block_table)
            if start + n == len(seq):  # every token computed: sample the next one
                last.append(cu[-1] - 1)

        def as_t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long).to(self.device, non_blocking=True)

        meta = AttentionMetadata(as_t(slots), cu, ctx, tables, bs)
        return as_t(ids), as_t(pos), meta, last

    # ------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_rows: list[int]) -> torch.Tensor:
        """ids, positions: (T,) -> logits (len(logits_rows), vocab) of the chosen rows."""
        decoder = self.model.model
        x = decoder.embed_tokens(ids)[None]  # (1, T, h)
        t = ids.shape[0]
        for i, layer in enumerate(decoder.layers):
            a = layer.self_attn
            h_, hkv, d = a.n_heads, a.n_kv, a.head_dim
            hs = layer.input_layernorm(x)
            q = a.q_proj(hs).view(1, t, h_, d)  # (1, T, H, D)
            k = a.k_proj(hs).view(1, t, hkv, d)
            v = a.v_proj(hs).view(t, hkv, d)
            if a.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (1, heads, T, D)
            a.ops.rope(q, k, positions, *a.rope_args)  # in place
            q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # (T, heads, D)
            write_kv(k, v, self.k_caches[i], self.v_caches[i], meta.slot_mapping)
            o = self.attention(q, self.k_caches[i], self.v_caches[i], meta, d**-0.5)  # (T, H, D)
            x = x + a.o_proj(o.reshape(1, t, h_ * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        rows = torch.tensor(logits_rows, dtype=torch.long, device=x.device)
        return self.model.lm_head(decoder.norm(x[0, rows]))  # (S, vocab)

    def generator(self, seq_id: int, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.default_generator
        if seq_id not in self.generators:
            self.generators[seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[seq_id]

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)

    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """Run one step; returns ``seq_id -> sampled token`` for the sequences that sample."""
        ids, pos, meta, last = self.prepare(batch)
        sampling = [seq for seq, n in batch.items if seq.num_computed + n == len(seq)]
        logits = self.forward(ids, pos, meta, last)
        if not sampling:
            return {}
        gens = [self.generator(s.seq_id, s.params.seed) for s in sampling]
        tokens = sample(logits, [s.params for s in sampling], gens).tolist()  # a host sync
        return {s.seq_id: tok for s, tok in zip(sampling, tokens)}

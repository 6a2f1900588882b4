"""Every chapter: a jupytext .md source paired with an output-free .ipynb, in
sync, starting with the one standard setup cell, and listed in _toc.yml."""

import importlib.util
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("nbtools", ROOT / "tools" / "notebooks.py")
nbtools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbtools)

CHAPTERS = nbtools.chapters()


def toc_files() -> set[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = {toc["root"]}
    for part in toc.get("parts", []):
        for ch in part.get("chapters", []):
            files.add(ch["file"])
            files.update(s["file"] for s in ch.get("sections", []))
    return files


def cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_chapters():
    assert CHAPTERS, "no jupytext chapters found under notebooks/"


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_pair_in_sync_and_without_outputs(md):
    ipynb = md.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `make sync`"
    nb = nbformat.read(ipynb, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, f"{ipynb.name} has outputs"
    assert cells(nb) == cells(jupytext.read(md, fmt="md:myst")), f"{ipynb.name} differs from {md.name}: run `make sync`"


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_starts_with_the_standard_setup_cell(md):
    first = nbtools.first_code_cell(jupytext.read(md, fmt="md:myst"))
    assert first is not None and first.source.strip() == nbtools.setup_cell().strip()


def test_setup_cell_installs_from_the_configured_repository():
    url, branch = nbtools.repository()
    assert f"git+{url}.git@{branch}" in nbtools.setup_cell()
    assert "llmnote.device.describe()" in nbtools.setup_cell()


def test_every_toc_entry_exists_and_every_chapter_is_listed():
    files = toc_files()
    for f in files:
        assert any((ROOT / f).with_suffix(s).exists() for s in (".md", ".ipynb")), f"_toc.yml lists missing {f}"
    for md in CHAPTERS:
        assert str(md.relative_to(ROOT).with_suffix("")) in files, f"{md.name} is not in _toc.yml"

"""The book builds with warnings as errors, and the chapter pages carry a Colab
button that opens the paired .ipynb. Execution is switched off here because
nbval already executes every notebook in this same test run; `make book`
executes them all."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("jupyter_book", reason="the book build needs jupyter-book (make test installs it)")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("book")
    # the site's MathJax and widget scripts (from npm), as `make book` does
    fetched = subprocess.run(["make", "-s", "_build/vendor/.fetched"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert fetched.returncode == 0, f"fetching the site's scripts failed:\n{fetched.stderr[-2000:]}"
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    cfg["execute"]["execute_notebooks"] = "off"
    # Without execution no cell glues its figures into the prose: the glue
    # roles' "no key" warnings are expected here (`make book` executes, and
    # tests/test_chapter_text.py checks that every glued name is glued).
    cfg["sphinx"]["config"]["suppress_warnings"] = ["mystnb.glue"]
    config = tmp / "_config.yml"
    config.write_text(yaml.safe_dump(cfg))
    jb = Path(sys.executable).with_name("jupyter-book")
    r = subprocess.run(
        [str(jb if jb.exists() else shutil.which("jupyter-book")), "build", str(ROOT), "--config", str(config),
         "--path-output", str(tmp), "--warningiserror", "--keep-going", "-q"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, f"book build failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return tmp / "_build" / "html"


def test_every_toc_page_is_rendered(html):
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [toc["root"]] + [c["file"] for p in toc["parts"] for c in p["chapters"]]
    for page in pages:
        assert (html / f"{page}.html").exists(), f"{page} was not rendered"


def test_chapters_have_a_colab_button_to_the_paired_ipynb(html):
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    org_repo = cfg["repository"]["url"].removeprefix("https://github.com/")
    for ipynb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        rel = ipynb.relative_to(ROOT)
        page = (html / rel.with_suffix(".html")).read_text()
        link = f"https://colab.research.google.com/github/{org_repo}/blob/{cfg['repository']['branch']}/{rel}"
        assert link in page, f"{rel}: no Colab link {link}"


def test_scripts_do_not_hide_standard_modules():
    """``python benchmarks/x.py`` puts benchmarks/ first on sys.path, so a script named as a
    standard-library module replaces it for every import in that run (a
    benchmarks/profile.py stopped benchmarks/moe.py: torch.compile imports cProfile, which
    imports profile)."""
    hiding = [p.relative_to(ROOT).as_posix() for folder in ("benchmarks", "tools")
              for p in (ROOT / folder).glob("*.py") if p.stem in sys.stdlib_module_names]
    assert not hiding, hiding

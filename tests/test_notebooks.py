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


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_colab_opens_it_on_a_gpu_with_its_kernel_named(md):
    nb = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
    assert nb.metadata.get("accelerator") == "GPU", f"{md.name}: no accelerator metadata"
    assert nb.metadata.get("colab", {}).get("gpuType"), f"{md.name}: no Colab GPU type"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


# ---------------------------------------------------------------- the setup cell, for real
def _venv(path: Path) -> Path:
    """A fresh virtualenv (its commands run with ``cwd`` outside the repository, so the
    checkout's own ``llmnote/`` is not on their path)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "venv", str(path)], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:  # e.g. a system Python without ensurepip (the GPU image's)
        pytest.skip(f"this Python cannot make a virtualenv: {r.stderr.strip()[-300:]}")
    return path / "bin" / "python"


def _clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH: the fresh virtualenv must not see the checkout."""
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


NO_NETWORK = ("Failed to establish a new connection", "Temporary failure in name resolution",
              "Network is unreachable", "No matching distribution found")


def _stub_wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-Python wheel that only claims to be ``name`` ``version``: stands for the
    torch or triton a GPU runtime already has (pip decides on names and versions)."""
    import zipfile

    whl = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"__version__ = '{version}'\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return whl


def _install_part(requirement: str) -> str:
    """The setup cell up to ``import llmnote``, installing ``requirement``."""
    cell = nbtools.setup_cell()
    url, branch = nbtools.repository()
    cell = cell.replace(f"llmnote @ git+{url}.git@{branch}", requirement)
    return cell.split("import llmnote\n")[0]


@pytest.mark.slow
def test_setup_cell_installs_llmnote_and_keeps_the_runtimes_torch(tmp_path):
    import subprocess

    py = _venv(tmp_path / "venv")
    stubs = [_stub_wheel(tmp_path, "torch", "2.5.0"), _stub_wheel(tmp_path, "triton", "3.1.0")]
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", *map(str, stubs)],
                   check=True, timeout=300)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    r = subprocess.run([str(py), "-c", _install_part(f"llmnote @ git+file://localhost{clone}")],
                       capture_output=True, text=True, timeout=1200, cwd=tmp_path,
                       env=_clean_env())
    if r.returncode != 0 and any(m in r.stderr for m in NO_NETWORK):
        pytest.skip("llmnote's dependencies cannot be fetched here (no package index)")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    show = subprocess.run([str(py), "-c", "import importlib.metadata as m; "
                           "print(m.version('torch'), m.version('triton'), m.version('llmnote'))"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=_clean_env())
    assert show.stdout.split() == ["2.5.0", "3.1.0", "0.1.0"], show.stdout + show.stderr


def test_setup_cell_stops_cleanly_with_one_message_when_the_install_fails(tmp_path):
    import subprocess

    py = _venv(tmp_path / "venv")
    bad = f"llmnote @ git+file://localhost{tmp_path / 'no-such-repository'}"
    r = subprocess.run([str(py), "-c", _install_part(bad) + "\nprint('NOT REACHED')\n"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=_clean_env())
    assert r.returncode == 1 and "NOT REACHED" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Could not install llmnote @ git+file://localhost") and "repository.url" in last
    assert "Traceback" not in r.stderr


def test_setup_page_shows_the_recorded_chapter_times():
    """book/setup.md's table is the one drawn from chapters.csv, which covers every
    chapter and assignment on each machine it records (the CPU at least)."""
    spec = importlib.util.spec_from_file_location("chapter_times", ROOT / "tools" / "chapter_times.py")
    ct = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct)
    text = (ROOT / "book" / "setup.md").read_text()
    shown = text.split(ct.START, 1)[1].split(ct.END, 1)[0].strip()
    assert shown == ct.markdown_table(), "run `python tools/chapter_times.py` to redraw the table"
    import pandas as pd

    df = pd.read_csv(ct.CSV)
    recorded = {p.removesuffix(".ipynb") for p in df["x_value"]}
    chapters = {str(md.relative_to(ROOT)).removesuffix(".md") for md in CHAPTERS}
    assert "interpreter" in set(df.provider), "no CPU (interpreter) times recorded"
    cpu = df[df.provider == "interpreter"]  # the CPU build: every chapter, every time
    have = {p.removesuffix(".ipynb") for p in cpu["x_value"]}
    assert chapters <= have, f"on the CPU: no time for {sorted(chapters - have)}"
    for (provider, gpu), rows in df.groupby(["provider", "gpu_name"]):  # each GPU: a part
        assert set(rows["llmnote_sha"].astype(str)), f"{provider} on {gpu}: rows name no commit"
    assert recorded <= chapters, f"times for notebooks that are gone: {sorted(recorded - chapters)}"


def _root_conftest():
    """The repository's root ``conftest.py`` as a module of its own."""
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    return root


def test_parallel_runs_keep_a_notebooks_cells_in_one_worker(tmp_path, monkeypatch):
    """Under pytest-xdist a notebook's cells share one kernel: the root conftest sends each
    file to one worker for ``--dist load`` always and for ``worksteal`` when notebooks are
    collected (a worksteal run of the chapters once split them, and most cells failed on
    names their notebook's earlier cells define in another worker)."""
    from types import SimpleNamespace

    root = _root_conftest()
    (tmp_path / "nb").mkdir()
    (tmp_path / "nb" / "deep").mkdir()
    (tmp_path / "nb" / "deep" / "a.ipynb").write_text("{}")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_a.py").write_text("")
    monkeypatch.chdir(tmp_path)
    runs = [root.runs_notebooks(SimpleNamespace(args=a))
            for a in (["nb"], ["t"], ["t", "nb/deep/a.ipynb::Cell 3"], ["t/test_a.py::test_x"])]
    assert runs == [True, False, True, False]


def test_the_scheduler_each_dist_mode_gets(tmp_path, monkeypatch):
    """(The hook of the test above, with pytest-xdist installed.)"""
    from types import SimpleNamespace

    scheduling = pytest.importorskip("xdist.scheduler")
    root = _root_conftest()
    (tmp_path / "nb").mkdir()
    (tmp_path / "nb" / "a.ipynb").write_text("{}")
    (tmp_path / "t").mkdir()
    monkeypatch.chdir(tmp_path)
    for dist, args, want in (("load", ["t"], True), ("worksteal", ["nb"], True),
                             ("worksteal", ["t"], False), ("each", ["nb"], False)):
        config = SimpleNamespace(args=args, getvalue=lambda name, d=dist: d)
        if want:
            assert isinstance(root.pytest_xdist_make_scheduler(config, None),
                              scheduling.LoadFileScheduling)
        else:
            assert root.pytest_xdist_make_scheduler(config, None) is None

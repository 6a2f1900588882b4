"""A Gradescope autograder for an assignment: a zip with ``setup.sh`` (installs
llmnote) and ``run_autograder`` (grades the submitted notebook with
``python -m llmnote.grading`` and writes ``/autograder/results/results.json``,
one test per check, see :func:`llmnote.grading.batch.write_gradescope`).

From a checkout of the repository (the install line is read from its
``_config.yml``)::

    make gradescope ASSIGNMENT=a1_softmax     # -> _build/gradescope/a1_softmax.zip
"""

from __future__ import annotations

import shlex
import zipfile
from pathlib import Path

SETUP = """\
#!/usr/bin/env bash
# Gradescope runs this once, when the autograder image is built.
set -euo pipefail
apt-get update -q && apt-get install -y -q python3 python3-pip git
python3 -m pip install -q --upgrade pip
python3 -m pip install -q nbformat {requirement}
"""

RUN = """\
#!/usr/bin/env bash
# Gradescope runs this for every submission. The student's notebook is graded in a
# process of its own; the results are written by the grader, never by it.
set -uo pipefail
mkdir -p /autograder/results
cd /autograder/results
python3 -m llmnote.grading /autograder/submission --assignment {assignment} \\
    --pattern '*.ipynb' --out /autograder/results/scores.csv \\
    --gradescope /autograder/results/results.json \\
    --check-time-limit {check} --cell-time-limit {cell} --notebook-time-limit {notebook}
if [ ! -s /autograder/results/results.json ]; then
  echo '{{"score": 0, "output": "no notebook (.ipynb) was found in the submission"}}' \\
    > /autograder/results/results.json
fi
"""


def build_autograder(assignment: str, out: str | Path, requirement: str, *,
                     check_time_limit_s: float = 120.0, cell_time_limit_s: float = 300.0,
                     notebook_time_limit_s: float = 900.0) -> Path:
    """Write Gradescope's autograder zip for ``assignment`` (a name or notebook name)
    to ``out``; ``requirement`` is the pip requirement that installs llmnote."""
    from llmnote.grading import get

    a = get(assignment)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    files = {
        "setup.sh": SETUP.format(requirement=shlex.quote(requirement)),
        "run_autograder": RUN.format(assignment=a.notebook, check=check_time_limit_s,
                                     cell=cell_time_limit_s, notebook=notebook_time_limit_s),
    }
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16  # executable, as Gradescope runs them
            z.writestr(info, text)
    return out

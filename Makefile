# The two commands of the README:  `make book`  and  `make test`.
# Each creates .venv and installs requirements.txt + llmnote (editable) when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test sync clean student instructor-book gradescope

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

## book: execute every chapter on this machine and render the site into _build/html
book: $(STAMP)
	$(BIN)/jupyter-book build . --warningiserror --keep-going

## test: unit tests, every notebook through nbval, and a book build check
test: $(STAMP)
	$(BIN)/python -m pytest

## sync: stamp the standard setup cell into every chapter and re-pair .md <-> .ipynb
sync: $(STAMP)
	$(BIN)/python tools/notebooks.py

## student: write the student assignment pages (notebooks/assignments/*.md, .ipynb) from
## the instructor notebooks in notebooks/assignments/instructor/ (commit both)
student: $(STAMP)
	$(BIN)/python tools/make_student.py

## instructor-book: the book plus a part with the instructor assignments (solutions,
## hidden checks) into _build/instructor/_build/html; never publish it
instructor-book: $(STAMP)
	$(BIN)/python tools/make_student.py --instructor-toc _build/instructor/_toc.yml
	$(BIN)/jupyter-book build . --toc _build/instructor/_toc.yml --path-output _build/instructor --warningiserror --keep-going

## gradescope: Gradescope's autograder zip, e.g. make gradescope ASSIGNMENT=a1_softmax
gradescope: $(STAMP)
	$(BIN)/python tools/make_student.py --gradescope $(ASSIGNMENT) --out _build/gradescope

clean:
	rm -rf _build

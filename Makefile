# The two commands of the README:  `make book`  and  `make test`.
# Each creates .venv and installs requirements.txt + llmnote (editable) when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test sync clean

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

clean:
	rm -rf _build

# The two commands of the README:  `make book`  and  `make test`; with a GPU, `make test-gpu`.
# Each creates .venv and installs requirements.txt + llmnote (editable) when needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test test-gpu sync clean student instructor-book gradescope check-site

# The site's scripts, served from the site itself (no CDN): MathJax, and
# RequireJS + the ipywidgets HTML manager that render the widgets' saved
# state. Fetched from the npm registry by `npm pack` (which checks each
# tarball's integrity); _config.yml puts _build/vendor on html_static_path.
VENDOR       := _build/vendor
VENDOR_STAMP := $(VENDOR)/.fetched
NPM_ASSETS   := mathjax@3.2.2 requirejs@2.3.7 @jupyter-widgets/html-manager@1.0.6

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

$(VENDOR_STAMP): Makefile
	rm -rf $(VENDOR) && mkdir -p $(VENDOR)/npm $(VENDOR)/mathjax $(VENDOR)/html-manager
	cd $(VENDOR)/npm && npm pack --silent $(NPM_ASSETS) >/dev/null
	tar -xzf $(VENDOR)/npm/mathjax-*.tgz -C $(VENDOR)/mathjax --strip-components=2 package/es5
	tar -xzf $(VENDOR)/npm/requirejs-*.tgz -C $(VENDOR) --strip-components=1 package/require.js
	tar -xzf $(VENDOR)/npm/jupyter-widgets-html-manager-*.tgz -C $(VENDOR)/html-manager \
	    --strip-components=2 package/dist
	rm -rf $(VENDOR)/npm
	cd $(VENDOR)/html-manager && rm -f *.map *.embed.js embed.js libembed-amd.js
	find $(VENDOR)/mathjax -maxdepth 1 -name '*.js' ! -name tex-mml-chtml.js -delete
	touch $@

## book: execute every chapter on this machine and render the site into _build/html
book: $(STAMP) $(VENDOR_STAMP)
	$(BIN)/jupyter-book build . --warningiserror --keep-going

## test: unit tests, every notebook through nbval, and a book build check
test: $(STAMP) $(VENDOR_STAMP)
	$(BIN)/python -m pytest

# With a CUDA GPU: no virtualenv (it would bring the CPU build of torch); the python3 that
# has PyTorch with CUDA and Triton runs everything, given the tools below.
GPU_PYTHON    ?= python3
GPU_MEMORY_GB ?= 15
GPU_TOOLS     := nbval pytest pytest-timeout ipykernel jupytext pyyaml pandas matplotlib tqdm \
                 ipywidgets safetensors tokenizers transformers

## test-gpu: the whole suite and every chapter and assignment through nbval, compiled on this
##           machine's GPU capped at GPU_MEMORY_GB GiB (a T4 has 15); times per chapter go to
##           _build/chapters-gpu.csv. PYTEST_ARGS="tests" or "notebooks" runs a part.
test-gpu:
	@$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  'make test-gpu: $(GPU_PYTHON) sees no CUDA GPU (torch.cuda.is_available() is False)')"
	@$(GPU_PYTHON) -c "import nbval, pytest_timeout, ipykernel, jupytext, yaml, pandas, \
	  matplotlib, tqdm, ipywidgets, safetensors, tokenizers, transformers" 2>/dev/null \
	  || $(GPU_PYTHON) -m pip install -q $(GPU_TOOLS)
	mkdir -p _build
	PYTHONPATH=$(CURDIR) LLMNOTE_GPU_MEMORY_GB=$(GPU_MEMORY_GB) \
	  LLMNOTE_TIMINGS=$(CURDIR)/_build/chapters-gpu.csv \
	  $(GPU_PYTHON) -m pytest -p no:cacheprovider --nbval-cell-timeout=600 $(PYTEST_ARGS)

## check-site: open every page of _build/html in headless Chromium with the
## network off; fails on unrendered math, broken images or links, and code,
## tables or math wider than the column. The site is brought up to date first:
## `make book` runs when a source of the book (chapters, book/, the config, the
## llmnote package and its recorded data) is newer than the last checked build.
SITE_SOURCES := _config.yml _toc.yml requirements.txt \
    $(shell find book notebooks llmnote -type f -not -path '*/__pycache__/*' \
        -not -path '*/.ipynb_checkpoints/*' -not -name '*.ipynb' -not -name '*.pyc' 2>/dev/null)
SITE_STAMP := _build/.site-sources

# Sphinx re-reads (and re-executes) only the pages whose own source changed; the
# chapters also run the llmnote package and read its recorded data, so when one
# of those changed since the last checked build Sphinx's saved environment goes
# and every page is rebuilt.
$(SITE_STAMP): $(STAMP) $(VENDOR_STAMP) $(SITE_SOURCES)
	$(if $(and $(wildcard $@),$(filter llmnote/% requirements.txt,$?)),rm -rf _build/.doctrees)
	$(MAKE) book
	touch $@

check-site: $(SITE_STAMP)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/python -m pip install -q playwright==1.65.2
	$(BIN)/python tools/check_site.py _build/html

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

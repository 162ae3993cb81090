# Two entry points: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch first: anything that depends on torch pulls a multi-GB CUDA build otherwise.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test bench docs lint clean gpu-check

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	touch $@

# The test environment holds everything the demo needs (its extras are a superset): a venv
# installed by `make test` since pyproject.toml last changed serves `make demo` as it is.
$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	@if [ -f $(VENV)/.test ] && [ $(VENV)/.test -nt pyproject.toml ]; then \
		echo "$(VENV) has the test extras, a superset of the demo's: nothing to install"; \
	else \
		$(PIP) install -q -e ".[loggers,examples]" ninja && \
		$(PY) scripts/build_torchrl_extension.py; \
	fi
	touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[ray,loggers,examples,test,docs]"
	$(PY) scripts/build_torchrl_extension.py
	touch $@

demo: $(VENV)/.demo
	$(PY) examples/demo.py

# Run one at a time, the suite leaves a core idle while processes, Ray and torch.distributed
# start and stop: TEST_WORKERS pytest workers run it side by side (tests/conftest.py groups
# and orders it). Two keep both cores of a two-core machine busy; more only compete for them.
# The benchmark floors are timing ratios: they run alone, after it. The run ends with its ten
# slowest tests, where a change that slows the suite shows first. A worker that dies is not
# replaced: the run stops at once, naming the test it died in (xdist 3.8 can wait forever
# for the work of a replaced worker under --dist loadgroup).
TEST_WORKERS ?= 2

test: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m pytest tests rl_observers -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --max-worker-restart=0 --durations=10
	$(PY) -m pytest benchmarks -q --benchmark-disable -p no:randomly

bench: $(VENV)/.test
	$(PY) -m pytest benchmarks -q

# The claims that need a CUDA device (tests marked cuda); one line and exit 0 without one.
gpu-check: $(VENV)/.test
	$(PY) scripts/gpu_check.py

docs: $(VENV)/.test
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

lint: $(VENV)/.test
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) docs/_build runs .pytest_cache .benchmarks

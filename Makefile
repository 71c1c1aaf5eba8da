# `make test` and `make serve` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION    ?= 2.13.0
PYTRITON_VERSION ?= 0.7.0

# `make serve HTTP_PORT=9000 GRPC_PORT=9001 METRICS_PORT=9002`
HTTP_PORT        ?= 8000
GRPC_PORT        ?= 8001
METRICS_PORT     ?= 8002
MODEL_REPOSITORY ?= model_repository
TINY_MODEL       := models/tiny-llama
# genai-perf pulls numpy 2, pandas, pyarrow, ...: it gets a venv of its own (see README).
GENAI_PERF_VENV  ?= .venv-genai-perf
GENAI_PERF_VERSION ?= 0.0.16

.PHONY: test serve venv tiny-model genai-perf clean

# The virtualenv is rebuilt when requirements change; torch goes in first, on its own, so the
# CPU build is used instead of a registry build that drags in CUDA packages. nvidia-pytriton
# carries the tritonserver binary; --no-deps because its own requirements are for pytriton's
# Python API, which we do not use.
$(VENV)/.done: requirements.txt pyproject.toml scripts/setup_perf_analyzer.sh
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		f"{sys.executable} is Python {sys.version.split()[0]}: give a 3.11+ one, make test PYTHON=python3.11")'
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps nvidia-pytriton==$(PYTRITON_VERSION)
	$(PY) -m pip install -q --no-deps -e .
	bash scripts/setup_perf_analyzer.sh $(VENV)
	touch $@

venv: $(VENV)/.done

# Made once; delete the folder to make it again.
$(TINY_MODEL)/model.safetensors: | $(VENV)/.done
	$(PY) scripts/make_tiny_model.py --arch llama --out $(TINY_MODEL)

tiny-model: $(TINY_MODEL)/model.safetensors

# Two pytest workers (pytest-xdist), a test file to each at a time (module fixtures such as a
# server are made once): most of the suite waits on servers and engine processes, so two
# workers take ~55% of one's time on CI's two cores. `make test PYTEST_WORKERS=0` runs in one
# process. On a GPU machine run the GPU test files directly (they size the KV cache from free
# GPU memory, which another worker's test would share).
PYTEST_WORKERS ?= 2

test: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests

# Foreground; Ctrl-C stops the server (SIGINT: it unloads the models and exits).
serve: venv tiny-model
	$(PY) scripts/tritonserver_env.py --model-repository "$(MODEL_REPOSITORY)" \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

$(GENAI_PERF_VENV)/.done: | $(VENV)/.done
	$(PYTHON) -m venv $(GENAI_PERF_VENV)
	echo '*' > $(GENAI_PERF_VENV)/.gitignore
	$(GENAI_PERF_VENV)/bin/python -m pip install -q genai-perf==$(GENAI_PERF_VERSION)
	touch $@

genai-perf: $(GENAI_PERF_VENV)/.done

clean:
	rm -rf $(VENV) $(GENAI_PERF_VENV) models .triton

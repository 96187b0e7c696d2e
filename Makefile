# Tandem: `make up` serves the default model (SmolLM2-135M-Instruct), `make test` runs the suite.
# Both create the virtualenv (.venv) on first use; nothing else needs installing by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BUF_VERSION := 1.75.0
UV_VERSION  := 0.13.9
BUF    := .tools/node_modules/.bin/buf
export BUF_CACHE_DIR := $(CURDIR)/.tools/buf-cache

# make up knobs: MODEL=<HF folder or .gguf file> (TOKENIZER=<folder> for a GGUF), GATEWAY_PORT, HTTP_PORT (the OpenAI-compatible API;
# HTTP=0 leaves it off), SCHEDULERS=N schedulers behind the gateway (each with its own
# workers), PREFILL/DECODE worker counts (per scheduler), BOTH>0 for single-device (no
# disaggregation) workers, SPEC='<JSON>' for speculative decoding on the decode workers
# (vLLM's --speculative-config, e.g. SPEC='{"method": "ngram", "num_speculative_tokens": 4}'),
# SERVED_MODEL_NAME='name [name...]' the model's names for clients (vLLM's --served-model-name),
# PREFILL_TP/DECODE_TP/BOTH_TP the tensor-parallel size of each worker of that role and
# PREFILL_PP/DECODE_PP/BOTH_PP its pipeline stages (ranks started by the worker; prefill
# and decode may differ, e.g. PREFILL_TP=2 DECODE_TP=1, or PREFILL_TP=2 DECODE_PP=2),
# HOSTS=N the services on N hosts made of network namespaces (root; each its own address,
# KV between hosts over UCX's TCP path; `make down` removes them), METRICS_PORT_BASE=N Prometheus metrics of the gRPC services on ports N (gateway), N+1
# (scheduler), N+2... (workers); `make status` lists them (the HTTP front's GET /metrics
# is always on HTTP_PORT).
MODEL        ?=
TOKENIZER    ?=
GATEWAY_PORT ?= 50051
HTTP_PORT    ?= 8000
HTTP         ?= 1
SCHEDULERS   ?= 1
HOSTS        ?= 0
PREFILL      ?= 1
DECODE       ?= 1
BOTH         ?= 0
PREFILL_TP   ?= 1
DECODE_TP    ?= 1
BOTH_TP      ?= 1
PREFILL_PP   ?= 1
DECODE_PP    ?= 1
BOTH_PP      ?= 1
SPEC         ?=
SERVED_MODEL_NAME ?=
METRICS_PORT_BASE ?= 0
PYTEST_ARGS  ?=

.PHONY: help venv up down status test unit protos protos-check lint lint-protos model clean

help:
	@echo "make up      start gateway, scheduler, prefill + decode workers and the OpenAI-compatible"
	@echo "             HTTP API on 127.0.0.1:$(HTTP_PORT) (MODEL=<folder> to serve another, HTTP=0 without HTTP)"
	@echo "             (SCHEDULERS=2: two schedulers, each with its own workers, behind the gateway)"
	@echo "make down    stop them"
	@echo "make status  health of every service"
	@echo "make test    contracts, lint and the whole test suite"
	@echo "make unit    the pure, in-process tests only (tests/unit, under a minute)"
	@echo "make protos  regenerate common/pb from protos/"

# torch comes from pip (its configured wheel source holds the CPU build; an unpinned index
# would pull the CUDA one), then uv installs the rest against it in well under a minute
# instead of pip's ~2 (pip again if uv cannot run here). --compile-bytecode, as pip does:
# where PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile every module
# it imports from source, each time (the services' imports took 2-3x as long).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --quiet torch==2.13.0 uv==$(UV_VERSION)
	$(PY) -m uv pip install --python $(PY) --quiet --compile-bytecode -e ".[dev]" \
		|| $(PY) -m pip install --quiet --quiet -e ".[dev]"
	$(PY) -m kernels.cpu_ops || echo "C++ CPU kernels unavailable: workers use the torch fallback"
	$(PY) -m devtools.default_model fetch
	touch $(STAMP)

venv: $(STAMP)

$(BUF):
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION)

protos: $(STAMP)
	$(PY) protos/generate.py

protos-check: $(STAMP)
	$(PY) protos/generate.py --check

lint-protos: $(BUF)
	cd protos && ../$(BUF) lint

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports --no-cache

model: $(STAMP)
	$(PY) -m devtools.default_model build

test: $(STAMP) $(BUF) protos-check lint-protos lint
	TANDEM_BUF=$(CURDIR)/$(BUF) $(PY) -m pytest --durations=30 $(PYTEST_ARGS)

unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

up: $(STAMP)
	$(PY) -m services.stack up $(if $(MODEL),--model "$(MODEL)") \
		$(if $(TOKENIZER),--tokenizer "$(TOKENIZER)") --gateway-port $(GATEWAY_PORT) \
		$(if $(filter 0,$(HTTP)),--no-http,--http-port $(HTTP_PORT)) \
		--schedulers $(SCHEDULERS) --prefill $(PREFILL) --decode $(DECODE) --both $(BOTH) \
		$(if $(filter-out 0,$(HOSTS)),--hosts $(HOSTS)) \
		--prefill-tp $(PREFILL_TP) --decode-tp $(DECODE_TP) --both-tp $(BOTH_TP) \
		--prefill-pp $(PREFILL_PP) --decode-pp $(DECODE_PP) --both-pp $(BOTH_PP) \
		$(if $(SPEC),--speculative-config '$(SPEC)') \
		$(if $(SERVED_MODEL_NAME),--served-model-name $(SERVED_MODEL_NAME)) \
		--metrics-port-base $(METRICS_PORT_BASE)

down:
	@if [ -x $(PY) ]; then $(PY) -m services.stack down; else echo "nothing to stop"; fi

status: $(STAMP)
	$(PY) -m services.stack status

clean: down
	rm -rf $(VENV) .tools .tandem

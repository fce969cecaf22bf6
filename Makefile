# One virtual environment holds the project and its dev tools.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?=

SERVE_TARGETS := serve-perception serve-llm serve-tts serve-codec

.PHONY: install demo test lint protos goldens clean $(SERVE_TARGETS)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# One offline turn on the bundled question; the demo checkpoint (random weights) unless MODEL=DIR is given.
demo: $(STAMP)
	$(BIN)/orchestrator offline examples/question.wav --output-audio response.wav --force $(if $(MODEL),--model $(MODEL))

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

protos: $(STAMP)
	$(BIN)/python -m tools.gen_protos

# Needs the reference's own environment in .ref (see tests/parity/README.md).
goldens:
	.ref/bin/python tests/parity/make_goldens.py

# One network service in the foreground (make serve-codec PORT=50054); the demo checkpoint unless MODEL=DIR. A static
# pattern rule: make never matches a phony target against an implicit `serve-%` rule, so that one did nothing.
$(SERVE_TARGETS): serve-%: $(STAMP)
	$(BIN)/python -m services.$* $(if $(MODEL),--model $(MODEL)) --port $(or $(PORT),0)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

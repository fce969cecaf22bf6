# One virtual environment holds the project and its dev tools.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?=

.PHONY: install demo test lint protos goldens clean serve-perception serve-llm serve-tts serve-codec

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

serve-%: $(STAMP)
	$(BIN)/python -m services.$* --model $(MODEL) --port $(or $(PORT),0)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The two quickstart commands: `make train` and `make test`.
# Both install into ./.venv first. torch==2.13.0 is pinned here (not in
# pyproject.toml, which declares torch>=2.4) so that this machine takes its
# local CPU build instead of downloading a CUDA one.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test install
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test,cli]'
	touch $@

train: install
	$(VENV)/bin/infinity train

test: install
	$(PY) -m pytest -q

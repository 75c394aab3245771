# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.xirang-installed
export PYTHONWARNINGS ?= ignore

.PHONY: demo test venv reference clean

venv: $(STAMP)

$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test,megatron,plots]"
	touch $(STAMP)

# A real DeepSpeed training run on 2 CPU ranks with a preset, then the memory it saved.
demo: $(STAMP)
	$(VENV)/bin/deepspeed --num_gpus 2 examples/train_gpt.py --ds-config configs/demo.json --steps 30

test: $(STAMP)
	$(PY) -m pytest

reference: $(STAMP)
	$(PY) -m xirang_ds.config.reference --write README.md

clean:
	rm -rf $(VENV) build *.egg-info

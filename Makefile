# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.xirang-installed
export PYTHONWARNINGS ?= ignore
# The shared corpus beside the checkout when present; otherwise the bench trains on stdlib docstrings.
DEMO_DATA := $(if $(wildcard ../shared/data/tinyshakespeare.txt),--data ../shared/data/tinyshakespeare.txt,)

.PHONY: demo test venv bench-env reference clean

venv: $(STAMP)

$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test,megatron,plots]"
	touch $(STAMP)

# A real DeepSpeed training run on 2 CPU ranks with a preset, then the memory it saved against
# plain DeepSpeed (the same ds_config without the block), side by side.
demo: $(STAMP)
	$(VENV)/bin/deepspeed --num_gpus 2 examples/train_gpt.py --ds-config configs/demo.json --steps 30
	$(VENV)/bin/xirang-ds bench --model gpt-small --ds-config configs/demo.json --world-size 2 --steps 10 $(DEMO_DATA)

# torchao and bitsandbytes for the peers' rows of benchmarks/results_table.py and the optimizer_states
# benchmarks (without them those rows are left out); not needed by `make test`.
bench-env: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[bench]"

test: $(STAMP)
	$(PY) -m pytest

reference: $(STAMP)
	$(PY) -m xirang_ds.config.reference --write docs/config.md

clean:
	rm -rf $(VENV) build *.egg-info

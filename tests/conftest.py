"""Test setup: CPU first. GPU tests carry ``@pytest.mark.gpu`` and are skipped without CUDA."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_DATA = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                           "tinyshakespeare.txt"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "distributed: spawns 2 CPU ranks over gloo")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def corpus_path():
    """tinyshakespeare beside the checkout, else None (the stdlib docstrings corpus is used)."""
    return SHARED_DATA if os.path.isfile(SHARED_DATA) else None

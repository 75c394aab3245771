"""The categories every tracked byte belongs to, and the order that settles a storage with two roles."""
from __future__ import annotations

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ACTIVATIONS = "activations"
COMM_BUFFERS = "comm_buffers"
TEMPORARIES = "temporaries"
MEMORY_POOL = "memory_pool"
HOST = "host"

CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATES, ACTIVATIONS, COMM_BUFFERS, MEMORY_POOL, TEMPORARIES, HOST)
"""Category keys as they appear in JSON output, in display order."""

DEVICE_CATEGORIES = CATEGORIES[:-1]
"""Categories that occupy device memory; ``host`` is what a plugin moved off the device."""

PRIORITY = {HOST: 8, PARAMETERS: 7, MEMORY_POOL: 6, OPTIMIZER_STATES: 5, COMM_BUFFERS: 4, GRADIENTS: 3,
            ACTIVATIONS: 2, TEMPORARIES: 1}
"""A storage marked twice keeps the higher role. ZeRO binds ``param.grad`` to slices of its
reduction bucket, so the bucket is a communication buffer first; a weight saved for backward is a
parameter, not an activation. The memory pool's reservation is one storage holding optimizer
states and activation payloads as views: it is counted once, as ``memory_pool``, whatever its
blocks hold (the pool's own `stats` split its bytes in use by lifetime)."""

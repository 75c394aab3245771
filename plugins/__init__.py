"""Built-in plugins of xirang_ds, one module per section of the ``"xirang"`` block.

Installed as ``xirang_ds.plugins`` (setup.py ``package_dir``). Importing a module registers its
plugin; no module here imports deepspeed at import time.
"""

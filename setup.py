"""Packaging for xirang_ds.

The built-in plugins live in the top-level ``plugins/`` folder of the repository and are installed
as ``xirang_ds.plugins`` through ``package_dir``; this holds for wheels and editable installs alike.
"""
from setuptools import find_packages, setup

setup(
    name="xirang_ds",
    version="0.1.0",
    description="Cut the device memory of large-model training: plugins for DeepSpeed and Megatron-core.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["xirang_ds", "xirang_ds.*"])
    + ["xirang_ds.plugins"] + [f"xirang_ds.plugins.{p}" for p in find_packages(where="plugins")],
    package_dir={"xirang_ds.plugins": "plugins"},
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.16,<0.21",
        "pyyaml>=5.4",
    ],
    extras_require={
        "megatron": ["megatron-core>=0.12,<0.20"],
        "plots": ["matplotlib>=3.5"],
        "bench": ["torchao>=0.10", "bitsandbytes>=0.45"],
        "test": ["pytest>=7", "matplotlib>=3.5", "transformers>=4.40", "accelerate>=0.30"],
    },
    entry_points={"console_scripts": ["xirang-ds = xirang_ds.cli:main"]},
)

"""A source checkout imports as the installed package does, with no editable install's finder."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import sys
# what a plain (non-editable) install or none leaves: no editable finder, the checkout first on the path
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                    and "__editable__" not in type(f).__module__]
sys.path.insert(0, sys.argv[1])
import xirang_ds.plugins.precision.kernels as kernels
import xirang_ds.plugins.activations as activations
print(kernels.__file__)
print(activations.__file__)
"""


def test_the_checkout_finds_its_plugins_without_an_editable_finder(tmp_path):
    # the GPU check ran from the checkout over a plain install and failed: "No module named 'xirang_ds.plugins'"
    done = subprocess.run([sys.executable, "-c", PROBE, ROOT], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [os.path.join(ROOT, "plugins", "precision", "kernels.py"),
                                   os.path.join(ROOT, "plugins", "activations", "__init__.py")]

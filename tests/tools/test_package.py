"""Packaging promises: light import, console script, CLI exit codes, config reference in docs/config.md."""
import json
import os
import subprocess
import sys

import pytest

from xirang_ds.cli import main
from xirang_ds.config import reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_pulls_in_neither_deepspeed_nor_megatron():
    code = ("import sys, xirang_ds; xirang_ds.load_config({'xirang': {'monitor': {'enabled': True}}}); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plugins_installed_as_subpackage():
    import xirang_ds.plugins.monitor as monitor
    import xirang_ds.plugins.profiler as profiler

    assert os.path.dirname(profiler.__file__) == os.path.join(ROOT, "plugins", "profiler")
    assert os.path.dirname(monitor.__file__) == os.path.join(ROOT, "plugins", "monitor")


def test_console_script_validates(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"xirang": {"preset": "conservative"}}))
    exe = os.path.join(os.path.dirname(sys.executable), "xirang-ds")
    out = subprocess.run([exe, "validate", str(path), "--show-resolved"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    resolved = json.loads(out.stdout.split("\n", 1)[1])
    assert resolved["xirang"]["preset"] == "conservative"
    assert resolved["xirang"]["monitor"]["enabled"] is True


@pytest.mark.parametrize("content, fragment", [
    ({"xirang": {"monitor": {"warn_at": 1.5}}}, "xirang.monitor.warn_at: must be between 0 and 1; got 1.5"),
    ({"xirang": {"preset": "fast"}}, "xirang.preset: must be one of"),
    ({"xirang": "balanced"}, "xirang: must be an object"),
    ("{not json", "JSON syntax error"),
])
def test_cli_bad_input_exits_2(tmp_path, capsys, content, fragment):
    path = tmp_path / "c.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["validate", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_cli_missing_file_exits_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.json")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_cli_no_block(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text("{}")
    assert main(["validate", str(path)]) == 0
    assert "plain DeepSpeed" in capsys.readouterr().out


def test_config_reference_is_current():
    assert not reference.update(os.path.join(ROOT, "docs", "config.md"), check=True), \
        "docs/config.md's config reference is stale: run python -m xirang_ds.config.reference --write docs/config.md"


def test_every_field_has_a_docstring():
    import dataclasses
    import typing

    from xirang_ds.config.sections import block_type

    seen = set()

    def visit(cls):
        if cls in seen:
            return
        seen.add(cls)
        docs = reference.field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
        for hint in typing.get_type_hints(cls).values():
            for arg in (hint, *typing.get_args(hint)):
                if dataclasses.is_dataclass(arg):
                    visit(arg)

    visit(block_type())

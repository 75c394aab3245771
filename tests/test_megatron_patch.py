"""The Megatron-LM patch (``patches/``) and the megatron-core names the integration reads.

Always: the patch only inserts calls into xirang_ds, each hunk carries exactly one upstream line (its
anchor, removed and re-added), and every name it imports exists with the arguments it is called with.

With a Megatron-LM clone (``MEGATRON_LM_DIR``, a work tree or a bare repository; skipped without
one): the patch applies at the pinned commit and at the refs docs/megatron.md says it works on,
Megatron-LM's ``pretrain`` and ``setup_model_and_optimizer`` there still have what the inserted calls
use, an anchor that moved makes the check fail (while a pure insertion would have applied), and the
names in ``megatron_compat.UPSTREAM_NAMES`` are in the source of every tag from core_v0.12.0 to
core_v0.19.0.
"""
import ast
import inspect
import os
import re
import subprocess
import tempfile

import pytest

from xirang_ds.integration import megatron as xm
from xirang_ds.integration.megatron_compat import UPSTREAM_NAMES

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.1.patch")
CHECK = os.path.join(ROOT, "patches", "check.sh")
PINNED = "55ac7082517c3878ae653c07c09c534b8aed49f6"
WORKS_ON = ("core_v0.16.0", "core_v0.16.1", "core_v0.17.0", "core_v0.17.1")
"""Megatron-LM tags where the patch applies and the inserted calls find what they use."""
APPLIES_BUT_REFUSED = ("core_v0.18.0", "core_v0.19.0")
"""Tags where the lines still match but pretrain() no longer takes the providers: wrap_pretrain
raises its TypeError there (tests/test_megatron_config.py)."""
DOES_NOT_APPLY = ("core_v0.15.0", "core_v0.14.0")
COMPAT_TAGS = ("core_v0.12.0", "core_v0.13.0", "core_v0.14.0", "core_v0.15.0", "core_v0.16.0", "core_v0.16.1",
               "core_v0.17.0", "core_v0.18.0", "core_v0.19.0")


def _hunks(text):
    """[(file, header, removed lines, added lines)] of a unified diff."""
    hunks, current_file = [], None
    for block in re.split(r"^(?=@@ |diff --git )", text, flags=re.M):
        if block.startswith("diff --git"):
            current_file = block.split()[3][2:]
        elif block.startswith("@@ "):
            lines = block.splitlines()
            removed = [line[1:] for line in lines[1:] if line.startswith("-")]
            added = [line[1:] for line in lines[1:] if line.startswith("+")]
            context = [line for line in lines[1:] if line.startswith(" ")]
            assert not context, f"hunk {lines[0]} has context lines"
            hunks.append((current_file, lines[0], removed, added))
    return hunks


def test_patch_names_its_pinned_commit_and_only_inserts_calls():
    text = open(PATCH, encoding="utf-8").read()
    assert f"Pinned: NVIDIA/Megatron-LM tag core_v0.16.1, commit {PINNED}" in text
    hunks = _hunks(text)
    assert {h[0] for h in hunks} == {"pretrain_gpt.py", "megatron/training/training.py"}
    for file, header, removed, added in hunks:
        assert len(removed) == 1, f"{file} {header}: one anchor line, removed and re-added"
        assert removed[0] in added, f"{file} {header}: the anchor must come back unchanged"
        inserted = [line.strip() for line in added if line != removed[0]]
        assert len(inserted) == 2, inserted
        imported = re.fullmatch(r"from xirang_ds\.integration\.megatron import (\w+)(?: as (\w+))?(?:\s+#.*)?",
                                inserted[0])
        assert imported, f"{file}: the first inserted line imports from xirang_ds: {inserted[0]}"
        name = imported.group(2) or imported.group(1)
        assert re.fullmatch(rf"\w+ = {name}\([\w, ]*\)(?:\s+#.*)?", inserted[1]), \
            f"{file}: the second inserted line calls {name}: {inserted[1]}"


def test_patch_calls_exist_with_their_arguments():
    added = [line.strip() for _, _, _, a in _hunks(open(PATCH, encoding="utf-8").read()) for line in a]
    imports = [re.match(r"from (\S+) import (\w+)(?: as (\w+))?", line) for line in added]
    imported = {m.group(3) or m.group(2): getattr(__import__(m.group(1), fromlist=[m.group(2)]), m.group(2))
                for m in imports if m}
    assert set(imported) == {"wrap_pretrain", "xirang_prepare_optimizer"}
    assert imported["wrap_pretrain"] is xm.wrap_pretrain
    assert imported["xirang_prepare_optimizer"] is xm.prepare_optimizer
    calls = {line.split("=", 1)[1].split("#")[0].strip() for line in added if "= " in line and "import" not in line}
    assert "wrap_pretrain(pretrain)" in calls and "xirang_prepare_optimizer(optimizer, model)" in calls
    inspect.signature(xm.wrap_pretrain).bind("pretrain")
    inspect.signature(xm.prepare_optimizer).bind("optimizer", "model")


# with a Megatron-LM clone ----------------------------------------------------------------------------
def _megatron_lm():
    path = os.environ.get("MEGATRON_LM_DIR")
    if not path:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM clone (work tree or bare) to check the patch")
    if subprocess.run(["git", "-C", path, "rev-parse", "--git-dir"], capture_output=True).returncode:
        pytest.fail(f"MEGATRON_LM_DIR={path} is not a git repository")
    return path


def _check(repo, *refs):
    return subprocess.run(["bash", CHECK, repo, *refs], capture_output=True, text=True)


def _show(repo, ref, path):
    return subprocess.run(["git", "-C", repo, "show", f"{ref}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def _refs_present(repo, refs):
    present = [r for r in refs if not subprocess.run(["git", "-C", repo, "rev-parse", "-q", "--verify",
                                                      f"{r}^{{commit}}"], capture_output=True).returncode]
    if not present:
        pytest.skip(f"none of {refs} in {repo}")
    return present


def test_patch_applies_at_the_pinned_commit():
    repo = _megatron_lm()
    result = _check(repo)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{PINNED} ({PINNED}): applies" in result.stdout


def test_patch_applies_and_fits_where_documented():
    repo = _megatron_lm()
    for ref in _refs_present(repo, WORKS_ON):
        result = _check(repo, ref)
        assert result.returncode == 0, result.stdout
        tree = ast.parse(_show(repo, ref, "megatron/training/training.py"))
        functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        params = [a.arg for a in functions["pretrain"].args.args]
        assert {"model_provider", "extra_args_provider"} <= set(params), ref
        setup = functions["setup_model_and_optimizer"]
        assigned = {t.id for n in ast.walk(setup) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        assert {"model", "optimizer", "opt_param_scheduler"} <= assigned, ref
    for ref in _refs_present(repo, APPLIES_BUT_REFUSED):
        tree = ast.parse(_show(repo, ref, "megatron/training/training.py"))
        pretrain = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "pretrain")
        assert "extra_args_provider" not in [a.arg for a in pretrain.args.args], ref


def test_patch_does_not_apply_where_documented():
    repo = _megatron_lm()
    for ref in _refs_present(repo, DOES_NOT_APPLY):
        result = _check(repo, ref)
        assert result.returncode == 1 and "does not apply" in result.stdout, ref


def test_a_moved_anchor_fails_the_check_where_a_pure_insertion_would_not():
    """The anchor is what makes the check able to fail: against the pinned files with one anchor
    line edited, the patch is refused, while the same insertions without anchors still apply."""
    repo = _megatron_lm()
    text = open(PATCH, encoding="utf-8").read()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "init", "-q", tmp], check=True)
        for path in ("pretrain_gpt.py", "megatron/training/training.py"):
            content = _show(repo, PINNED, path)
            if path == "pretrain_gpt.py":
                content = content.replace("maybe_wrap_for_inprocess_restart(pretrain)",
                                          "maybe_wrap_for_inprocess_restart(pretrain, moved=True)")
            os.makedirs(os.path.dirname(os.path.join(tmp, path)) or tmp, exist_ok=True)
            with open(os.path.join(tmp, path), "w", encoding="utf-8") as f:
                f.write(content)
        anchored = subprocess.run(["git", "-C", tmp, "apply", "--check", "--unidiff-zero", PATCH],
                                  capture_output=True, text=True)
        assert anchored.returncode != 0 and "pretrain_gpt.py" in anchored.stderr
        pure = re.sub(r"@@ -(\d+) \+\d+,3 @@\n-(.*)\n\+\2\n", lambda m: f"@@ -{m.group(1)},0 +{int(m.group(1)) + 1},2 @@\n",
                      text)
        assert pure.count("@@ -") == 2 and pure != text
        pure_path = os.path.join(tmp, "pure.patch")
        with open(pure_path, "w", encoding="utf-8") as f:
            f.write(pure)
        loose = subprocess.run(["git", "-C", tmp, "apply", "--check", "--unidiff-zero", pure_path],
                               capture_output=True, text=True)
        assert loose.returncode == 0, loose.stderr


def test_megatron_core_names_at_every_checked_tag():
    repo = _megatron_lm()
    missing = []
    for ref in _refs_present(repo, COMPAT_TAGS):
        for path, needles in UPSTREAM_NAMES.items():
            source = _show(repo, ref, path)
            missing.extend(f"{ref}:{path}: {n!r}" for n in needles if n not in source)
    assert not missing, "megatron-core moved names xirang reads:\n" + "\n".join(missing)

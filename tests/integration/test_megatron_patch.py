"""The Megatron-LM patch (``patches/``) and the megatron-core names the integration reads.

Always: the patch only inserts calls into xirang_ds, each hunk carries exactly one upstream line (its
anchor, removed and re-added), and every name it imports exists with the arguments it is called with.

With a Megatron-LM clone (``MEGATRON_LM_DIR``, a work tree or a bare repository; skipped without
one): the patch applies at the pinned commit and at the refs docs/megatron.md says it works on,
Megatron-LM's ``pretrain`` and ``setup_model_and_optimizer`` there still have what the inserted calls
use, an anchor that moved makes the check fail (while a pure insertion would have applied), and the
names in ``xirang_ds.compat.megatron.UPSTREAM_NAMES`` are in the source of every tag from core_v0.12.0 to
core_v0.19.0 and of main at d98e8a64.

With the upstream files in ``../shared/megatron-lm/`` (or ``XIRANG_MEGATRON_FILES``; skipped without
them; no clone needed, so CI runs it): each file's blob id is the one MANIFEST.tsv gives, and at each
tag there (core_v0.16.0 to core_v0.19.0) the patch applies, or not, as docs/megatron.md's table says
(``APPLIES_AT``), fully where it does, and ``pretrain`` takes the providers only at ``WORKS_ON``.
"""
import ast
import csv
import inspect
import os
import re
import subprocess
import tempfile

import pytest

from xirang_ds.compat.megatron import UPSTREAM_NAMES
from xirang_ds.integration import megatron as xm

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.1.patch")
CHECK = os.path.join(ROOT, "patches", "check.sh")
PINNED = "55ac7082517c3878ae653c07c09c534b8aed49f6"
WORKS_ON = ("core_v0.16.0", "core_v0.16.1", "core_v0.17.0", "core_v0.17.1")
"""Megatron-LM tags where the patch applies and the inserted calls find what they use."""
APPLIES_BUT_REFUSED = ("core_v0.18.0", "core_v0.19.0")
"""Tags where this patch's lines still match but pretrain() no longer takes the providers: wrap_pretrain
raises MegatronVersionError there naming patches/megatron-lm-core_v0.19.0.patch, the one for those tags
(tests/integration/test_megatron_lm_versions.py)."""
DOES_NOT_APPLY = ("core_v0.15.0", "core_v0.14.0")
COMPAT_TAGS = ("core_v0.12.0", "core_v0.13.0", "core_v0.14.0", "core_v0.15.0", "core_v0.16.0", "core_v0.16.1",
               "core_v0.17.0", "core_v0.18.0", "core_v0.19.0",
               "d98e8a64ddf34856e74b24714e3bedb2f5a39553")  # main, 2026-08-22 (megatron-core 0.20.0 in tree)


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


# with the upstream files in ../shared (no clone) -----------------------------------------------------
APPLIES_AT = {"core_v0.16.0": True, "core_v0.16.1": True, "core_v0.17.0": True, "core_v0.17.1": True,
              "core_v0.18.2": True, "core_v0.19.0": True}
"""docs/megatron.md's "Versions" table, "applies" column for this patch: the tags in ../shared/megatron-lm/MANIFEST.tsv and whether
the patch applies there (``git apply --check --unidiff-zero``)."""
FILES_ENV = "XIRANG_MEGATRON_FILES"


def _megatron_files():
    """The folder of upstream files: $XIRANG_MEGATRON_FILES, else ../shared/megatron-lm of the checkout."""
    path = os.environ.get(FILES_ENV)
    if path:
        if not os.path.isfile(os.path.join(path, "MANIFEST.tsv")):
            pytest.fail(f"{FILES_ENV}={path} has no MANIFEST.tsv")
        return path
    path = os.path.normpath(os.path.join(ROOT, "..", "shared", "megatron-lm"))
    if not os.path.isfile(os.path.join(path, "MANIFEST.tsv")):
        pytest.skip(f"no Megatron-LM files at {path} (its MANIFEST.tsv); set {FILES_ENV} to such a folder")
    return path


def _manifest(folder):
    """{tag: {"commit": upstream commit, "blobs": {path: blob id}}} from the folder's MANIFEST.tsv."""
    tags = {}
    with open(os.path.join(folder, "MANIFEST.tsv"), encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            entry = tags.setdefault(row["tag"], {"commit": row["commit"], "blobs": {}})
            assert entry["commit"] == row["commit"], f"MANIFEST.tsv: {row['tag']} has two commits"
            entry["blobs"][row["path"]] = row["blob"]
    return tags


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=x", "-c", "user.email=x", *args], cwd=cwd,
                          capture_output=True, text=True)


def _tag_repo(folder, tag, paths, tmp):
    """A git repository in tmp holding the tag's files, committed (copied by content: the shared
    copies are read-only)."""
    for path in paths:
        os.makedirs(os.path.dirname(os.path.join(tmp, path)) or tmp, exist_ok=True)
        with open(os.path.join(folder, tag, path), "rb") as src, open(os.path.join(tmp, path), "wb") as dst:
            dst.write(src.read())
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-q", "-m", tag)):
        done = _git(tmp, *args)
        assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr}"
    return tmp


def test_megatron_files_match_the_manifest():
    folder = _megatron_files()
    tags = _manifest(folder)
    assert set(tags) == set(APPLIES_AT), f"MANIFEST.tsv's tags {sorted(tags)} are not APPLIES_AT's"
    assert tags["core_v0.16.1"]["commit"] == PINNED, "the manifest's core_v0.16.1 is not the pinned commit"
    patched = {h[0] for h in _hunks(open(PATCH, encoding="utf-8").read())}
    wrong = []
    for tag, entry in sorted(tags.items()):
        assert set(entry["blobs"]) == patched, f"{tag}: the manifest lists {sorted(entry['blobs'])}"
        for path, blob in sorted(entry["blobs"].items()):
            found = _git(os.path.join(folder, tag), "hash-object", path)
            if found.returncode or found.stdout.strip() != blob:
                wrong.append(f"{tag}/{path}: manifest {blob}, git hash-object {found.stdout.strip() or found.stderr}")
    assert not wrong, "files in " + folder + " differ from upstream:\n" + "\n".join(wrong)


def test_applies_at_table_covers_the_pinned_tag():
    assert APPLIES_AT["core_v0.16.1"], "the patch must apply at the tag it pins"
    assert set(WORKS_ON) & set(APPLIES_AT) <= {t for t, applies in APPLIES_AT.items() if applies}


@pytest.mark.parametrize("tag", sorted(APPLIES_AT))
def test_patch_applies_at_each_shared_tag_as_documented(tag):
    folder = _megatron_files()
    entry = _manifest(folder)[tag]
    where = f"{tag} ({entry['commit']})"
    hunks = _hunks(open(PATCH, encoding="utf-8").read())
    with tempfile.TemporaryDirectory() as tmp:
        repo = _tag_repo(folder, tag, sorted(entry["blobs"]), tmp)
        check = _git(repo, "apply", "--check", "--unidiff-zero", PATCH)
        script = _check(repo, "HEAD")                      # patches/check.sh, the index route, on the same files
        if not APPLIES_AT[tag]:
            assert check.returncode != 0, f"{where}: the patch applies; docs/megatron.md says it does not"
            assert "patch does not apply" in check.stderr, f"{where}: git apply failed otherwise: {check.stderr}"
            assert "does not apply" in script.stdout, f"{where}: check.sh says {script.stdout}"
            return
        assert check.returncode == 0, f"{where}: the patch does not apply: {check.stderr}"
        assert script.returncode == 0 and "applies" in script.stdout, f"{where}: check.sh says {script.stdout}"
        originals = {path: open(os.path.join(repo, path), encoding="utf-8").read() for path in entry["blobs"]}
        applied = _git(repo, "apply", "--unidiff-zero", PATCH)
        assert applied.returncode == 0, f"{where}: git apply: {applied.stderr}"
        numstat = _git(repo, "diff", "--numstat").stdout.split("\n")
        assert sorted(line for line in numstat if line) == sorted(f"2\t0\t{p}" for p in entry["blobs"]), \
            f"{where}: each file gains two lines and loses none: {numstat}"
        for path, header, removed, added in hunks:
            lines = originals[path].splitlines()
            assert lines.count(removed[0]) == 1, f"{where}: {path}: the anchor of {header} is not one line there"
            text = open(os.path.join(repo, path), encoding="utf-8").read()
            assert "\n".join(added) + "\n" in text, f"{where}: {path}: {header} not inserted at its anchor"
        assert "pretrain = wrap_pretrain(pretrain)" in open(os.path.join(repo, "pretrain_gpt.py")).read(), where
        training = open(os.path.join(repo, "megatron/training/training.py")).read()
        assert "optimizer = xirang_prepare_optimizer(optimizer, model)" in training, where


@pytest.mark.parametrize("tag", sorted(APPLIES_AT))
def test_pretrain_takes_the_providers_only_where_documented(tag):
    """WORKS_ON: the inserted calls find what they use; elsewhere wrap_pretrain refuses (MegatronVersionError)."""
    folder = _megatron_files()
    source = open(os.path.join(folder, tag, "megatron", "training", "training.py"), encoding="utf-8").read()
    pretrain = next(f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef) and f.name == "pretrain")
    params = {a.arg for a in pretrain.args.args}
    takes = {"model_provider", "extra_args_provider"} <= params
    said = "takes" if tag in WORKS_ON else "does not take"
    assert takes == (tag in WORKS_ON), \
        f"{tag}: pretrain's parameters are {sorted(params)}; WORKS_ON (docs/megatron.md) says it {said} the providers"

"""Megatron-LM per version range: which patch fits each tag, and that its calls find what they use there.

Against the upstream files of every tag in ``../shared/megatron-lm/`` and of main in
``../shared/megatron-lm-main/`` (or the folders ``XIRANG_MEGATRON_FILES`` / ``XIRANG_MEGATRON_MAIN_FILES``
name; skipped, naming them, without), no clone needed, so CI runs it:

* `PATCH_AT` (docs/megatron.md's version table): the patch for the tag applies (``git apply --check
  --unidiff-zero``, then for real), each anchor is found exactly once, and the other patch either does
  not apply or is refused at run time with `MegatronVersionError`;
* the inserted calls find their names and signatures, read from the files with ``ast``: ``pretrain``'s
  parameters (rebuilt as an ``inspect.Signature``) are the launch shape `megatron_lm_launch` says, the
  script's own ``pretrain(...)`` call binds to them through the wrapper, ``parse_and_validate_args`` is
  imported and called with ``extra_args_provider=``, from core_v0.19 the model is built from
  ``cfg_container.model`` by a builder's ``build_distributed_models``, and ``model`` and ``optimizer``
  are bound in ``setup_model_and_optimizer`` before the training.py anchor.

With a Megatron-LM clone (``MEGATRON_LM_DIR``): ``parse_and_validate_args`` and the model config's
``pre_wrap_hooks`` in the source at core_v0.18.0 to main, and ``patches/check.sh -p`` per range.
"""
import ast
import inspect
import os
import re
import subprocess
import tempfile

import pytest

from tests.integration.test_megatron_patch import _git, _hunks, _manifest, _megatron_files, _tag_repo
from xirang_ds.compat.megatron import MegatronVersionError, megatron_lm_launch
from xirang_ds.integration import megatron as xm
from xirang_ds.integration import megatron_lm

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OLD = os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.1.patch")
NEW = os.path.join(ROOT, "patches", "megatron-lm-core_v0.19.0.patch")
MAIN_TAG = "main-20260822"
MAIN_ENV = "XIRANG_MEGATRON_MAIN_FILES"
PATCH_AT = {"core_v0.16.0": OLD, "core_v0.16.1": OLD, "core_v0.17.0": OLD, "core_v0.17.1": OLD,
            "core_v0.18.2": NEW, "core_v0.19.0": NEW, MAIN_TAG: NEW}
"""docs/megatron.md's version table: the patch for each tag of the shared files."""
LAUNCH_AT = {"core_v0.16.0": "providers", "core_v0.16.1": "providers", "core_v0.17.0": "providers",
             "core_v0.17.1": "providers", "core_v0.18.2": "config_and_provider", "core_v0.19.0": "config_builder",
             MAIN_TAG: "config_builder"}
"""The shape of ``pretrain`` at each tag (`xirang_ds.compat.megatron.LAUNCHES`)."""
FILES = ("pretrain_gpt.py", "megatron/training/training.py")


def _main_files():
    path = os.environ.get(MAIN_ENV) or os.path.normpath(os.path.join(ROOT, "..", "shared", "megatron-lm-main"))
    if not os.path.isfile(os.path.join(path, "MANIFEST.tsv")):
        pytest.skip(f"no Megatron-LM main files at {path} (its MANIFEST.tsv); set {MAIN_ENV} to such a folder")
    return path


def _folder(tag):
    """(folder, manifest entry) holding the tag's files; main has a folder of its own."""
    folder = _main_files() if tag == MAIN_TAG else _megatron_files()
    return folder, _manifest(folder)[tag]


def _read(tag, path):
    folder, _ = _folder(tag)
    with open(os.path.join(folder, tag, path), encoding="utf-8") as f:
        return f.read()


def _function(source, name):
    found = [f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef) and f.name == name]
    assert len(found) == 1, f"{len(found)} functions named {name}"
    return found[0]


def _signature(fn):
    """``inspect.Signature`` of an ``ast.FunctionDef`` (defaults as their source text)."""
    kind = inspect.Parameter
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [kind.empty] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    params = [kind(a.arg, kind.POSITIONAL_ONLY if a in args.posonlyargs else kind.POSITIONAL_OR_KEYWORD, default=d)
              for a, d in zip(positional, defaults)]
    if args.vararg:
        params.append(kind(args.vararg.arg, kind.VAR_POSITIONAL))
    params += [kind(a.arg, kind.KEYWORD_ONLY, default=kind.empty if d is None else ast.unparse(d))
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(kind(args.kwarg.arg, kind.VAR_KEYWORD))
    return inspect.Signature(params)


def _stub(fn):
    """A callable with the upstream function's signature, recording what it is called with."""
    calls = []

    def stub(*args, **kwargs):
        calls.append(inspect.signature(stub).bind(*args, **kwargs).arguments)

    stub.__signature__ = _signature(fn)
    stub.calls = calls
    return stub


def _main_block_calls(source, name):
    """The calls of ``name`` in the script's ``if __name__ == "__main__":`` block."""
    main = [n for n in ast.parse(source).body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert len(main) == 1
    return [c for c in ast.walk(main[0]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
            and c.func.id == name]


def test_patch_at_covers_the_shared_tags_and_main():
    assert set(PATCH_AT) == set(_manifest(_megatron_files())) | {MAIN_TAG}
    assert _manifest(_main_files())[MAIN_TAG]["commit"] == "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
    text = open(NEW, encoding="utf-8").read()
    assert "Pinned: NVIDIA/Megatron-LM tag core_v0.19.0, commit 5be9626709af2722333bf54797c954c09edeada3" in text


def test_new_patch_only_inserts_calls_into_xirang():
    hunks = _hunks(open(NEW, encoding="utf-8").read())
    assert [h[0] for h in hunks] == list(FILES)
    for file, header, removed, added in hunks:
        assert len(removed) == 1 and removed[0] in added, f"{file} {header}: one anchor, re-added unchanged"
        inserted = [line.strip() for line in added if line != removed[0]]
        assert len(inserted) == 2 and inserted[0].startswith("from xirang_ds.integration.megatron"), inserted
    imports = {m.group(3) or m.group(2): getattr(__import__(m.group(1), fromlist=[m.group(2)]), m.group(2))
               for line in (a.strip() for h in hunks for a in h[3])
               for m in [re.match(r"from (\S+) import (\w+)(?: as (\w+))?", line)] if m}
    assert imports == {"wrap_launch": megatron_lm.wrap_launch, "xirang_prepare_optimizer": xm.prepare_optimizer}
    inspect.signature(megatron_lm.wrap_launch).bind("pretrain", "parse_and_validate_args")


@pytest.mark.parametrize("tag", sorted(PATCH_AT))
def test_the_patch_for_each_tag_applies_with_each_anchor_once(tag):
    folder, entry = _folder(tag)
    patch = PATCH_AT[tag]
    other = NEW if patch == OLD else OLD
    with tempfile.TemporaryDirectory() as tmp:
        repo = _tag_repo(folder, tag, sorted(entry["blobs"]), tmp)
        originals = {p: open(os.path.join(repo, p), encoding="utf-8").read() for p in FILES}
        for path, header, removed, added in _hunks(open(patch, encoding="utf-8").read()):
            assert originals[path].splitlines().count(removed[0]) == 1, f"{tag}: {path}: anchor of {header}"
        other_check = _git(repo, "apply", "--check", "--unidiff-zero", other)
        if other == NEW:  # the core_v0.18+ anchor is not in 0.16-0.17's pretrain_gpt.py
            assert other_check.returncode != 0 and "pretrain_gpt.py" in other_check.stderr, tag
        applied = _git(repo, "apply", "--unidiff-zero", patch)
        assert applied.returncode == 0, f"{tag}: {os.path.basename(patch)}: {applied.stderr}"
        numstat = sorted(line for line in _git(repo, "diff", "--numstat").stdout.splitlines() if line)
        assert numstat == sorted(f"2\t0\t{p}" for p in FILES), f"{tag}: {numstat}"
        script = open(os.path.join(repo, "pretrain_gpt.py"), encoding="utf-8").read()
        compile(script, "pretrain_gpt.py", "exec")  # the patched script still parses
        if patch == NEW:  # wrapped before the arguments are parsed, after the in-process-restart wrapper
            lines = script.splitlines()
            at = lines.index("    pretrain, parse_and_validate_args = wrap_launch(pretrain, parse_and_validate_args)")
            assert lines[at + 1] == "    args = parse_and_validate_args("
            assert any("maybe_wrap_for_inprocess_restart(pretrain)" in line for line in lines[:at])


@pytest.mark.parametrize("tag", sorted(PATCH_AT))
def test_pretrain_shape_read_from_the_files_is_the_one_the_patch_serves(tag):
    """``pretrain``'s parameters from training.py, as a signature: `megatron_lm_launch` finds the tag's shape,
    the wrapper of the tag's patch takes it, and the other wrapper refuses it with MegatronVersionError."""
    pretrain = _stub(_function(_read(tag, "megatron/training/training.py"), "pretrain"))
    assert megatron_lm_launch(pretrain) == LAUNCH_AT[tag]
    parse = _stub(ast.parse("def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, "
                            "args_defaults={}): pass").body[0])
    if PATCH_AT[tag] == OLD:
        xm.wrap_pretrain(pretrain)
        with pytest.raises(MegatronVersionError, match="apply patches/megatron-lm-core_v0.16.1.patch"):
            megatron_lm.wrap_launch(pretrain, parse)
    else:
        megatron_lm.wrap_launch(pretrain, parse)
        with pytest.raises(MegatronVersionError, match=r"megatron-core .*apply patches/megatron-lm-core_v0.19.0.patch"):
            xm.wrap_pretrain(pretrain)


@pytest.mark.parametrize("tag", sorted(t for t, p in PATCH_AT.items() if p == NEW))
def test_the_scripts_calls_bind_through_the_wrappers(tag):
    """pretrain_gpt.py's own ``parse_and_validate_args(...)`` and ``pretrain(...)`` calls, with their argument
    names read from the script, go through `wrap_launch` to upstream's signature, and reach the model."""
    script = _read(tag, "pretrain_gpt.py")
    imported = {a.name for n in ast.walk(ast.parse(script)) if isinstance(n, ast.ImportFrom)
                and n.module == "megatron.training.arguments" for a in n.names}
    assert "parse_and_validate_args" in imported, tag
    (parse_call,) = _main_block_calls(script, "parse_and_validate_args")
    assert "extra_args_provider" in [k.arg for k in parse_call.keywords], tag
    (pretrain_call,) = _main_block_calls(script, "pretrain")
    training = _read(tag, "megatron/training/training.py")
    pretrain = _stub(_function(training, "pretrain"))
    parse = _stub(ast.parse("def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, "
                            "args_defaults={}): pass").body[0])

    class Args:
        xirang_config = "ds_config.json"

    class ModelConfig:
        def __init__(self):
            self.pre_wrap_hooks = []

    class Container:
        def __init__(self):
            self.model, self.ddp = ModelConfig(), object()

    wrapped, wrapped_parse = megatron_lm.wrap_launch(pretrain, parse, get_args=lambda: Args)
    wrapped_parse(**{k.arg: None for k in parse_call.keywords})
    parser = parse.calls[0]["extra_args_provider"](__import__("argparse").ArgumentParser())
    assert parser.parse_args([]).xirang_config is None  # --xirang-config joins Megatron's arguments
    container = Container()
    positional = [container] + [f"arg{i}" for i in range(1, len(pretrain_call.args))]
    wrapped(*positional, **{k.arg: k.arg for k in pretrain_call.keywords})
    (bound,) = pretrain.calls
    if LAUNCH_AT[tag] == "config_and_provider":
        assert isinstance(bound["model_provider"], xm.ModelProvider), tag
    else:
        assert "model_provider" not in bound, f"{tag}: pretrain_gpt.py passes no model provider from core_v0.19"
        assert [type(h) for h in container.model.pre_wrap_hooks] == [megatron_lm.PreWrapHook]
        setup = ast.unparse(_function(training, "setup_model_and_optimizer"))
        assert ".get_builder_cls()" in setup and ".build_distributed_models(" in setup, tag
        assert "gpt_config_from_args" in ast.unparse(pretrain_call.args[0]) or \
            "gpt_config_from_args(args" in script, f"{tag}: the container carries a model config"


@pytest.mark.parametrize("tag", sorted(PATCH_AT))
def test_model_and_optimizer_are_bound_before_the_training_anchor(tag):
    training = _read(tag, "megatron/training/training.py")
    setup = _function(training, "setup_model_and_optimizer")
    anchor = "        opt_param_scheduler = get_optimizer_param_scheduler(optimizer)"
    line = training.splitlines().index(anchor) + 1
    assert setup.lineno < line <= setup.end_lineno, f"{tag}: the anchor is not in setup_model_and_optimizer"
    bound = {t.id for n in ast.walk(setup) if isinstance(n, ast.Assign) and n.lineno < line
             for t in ast.walk(n.targets[0]) if isinstance(t, ast.Name)}
    assert {"model", "optimizer"} <= bound, f"{tag}: {sorted(bound)}"


# with a Megatron-LM clone ----------------------------------------------------------------------------
NEW_REFS = ("core_v0.18.0", "core_v0.18.2", "core_v0.19.0", "d98e8a64ddf34856e74b24714e3bedb2f5a39553")


def test_parse_args_and_pre_wrap_hooks_in_the_clone():
    repo = os.environ.get("MEGATRON_LM_DIR")
    if not repo:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM clone (work tree or bare) to read arguments.py")
    for ref in NEW_REFS:
        shown = subprocess.run(["git", "-C", repo, "show", f"{ref}:megatron/training/arguments.py"],
                               capture_output=True, text=True)
        if shown.returncode:
            pytest.skip(f"{ref} not in {repo}")
        parse = _signature(_function(shown.stdout, "parse_and_validate_args"))
        assert "extra_args_provider" in parse.parameters, ref
        base = subprocess.run(["git", "-C", repo, "show", f"{ref}:megatron/training/models/base.py"],
                              capture_output=True, text=True)
        if ref.startswith("core_v0.18"):
            continue  # 0.18 builds the model through the provider
        assert base.returncode == 0 and "pre_wrap_hooks: list[" in base.stdout, ref


def test_check_sh_takes_the_patch_for_each_range_in_the_clone():
    """``patches/check.sh -p``: the core_v0.18+ patch applies at core_v0.18.0 to main and not at
    core_v0.17.1; without ``-p`` the 0.16.1 patch is checked, as before."""
    repo = os.environ.get("MEGATRON_LM_DIR")
    if not repo:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM clone (work tree or bare) to run patches/check.sh")
    check = os.path.join(ROOT, "patches", "check.sh")
    present = [r for r in (*NEW_REFS, "core_v0.17.1") if not subprocess.run(
        ["git", "-C", repo, "rev-parse", "-q", "--verify", f"{r}^{{commit}}"], capture_output=True).returncode]
    if "core_v0.17.1" not in present or len(present) < 2:
        pytest.skip(f"the clone lacks some of {NEW_REFS} and core_v0.17.1")
    new = subprocess.run(["bash", check, "-p", os.path.basename(NEW), repo, *[r for r in present if r in NEW_REFS]],
                         capture_output=True, text=True)
    assert new.returncode == 0 and new.stdout.count(": applies") == len(present) - 1, new.stdout + new.stderr
    old = subprocess.run(["bash", check, "-p", os.path.basename(NEW), repo, "core_v0.17.1"], capture_output=True,
                         text=True)
    assert old.returncode == 1 and "does not apply" in old.stdout, old.stdout
    default = subprocess.run(["bash", check, repo], capture_output=True, text=True)
    assert default.returncode == 0 and "55ac7082517c3878ae653c07c09c534b8aed49f6" in default.stdout
    bad = subprocess.run(["bash", check, "-p", "nope.patch", repo], capture_output=True, text=True)
    assert bad.returncode == 2 and "megatron-lm-core_v0.19.0.patch" in bad.stderr


# docs/megatron.md's version table ------------------------------------------------------------------------
def _versions_table():
    text = open(os.path.join(ROOT, "docs", "megatron.md"), encoding="utf-8").read()
    section = text.split("### Versions", 1)[1].split("\n### ", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    assert rows[0] == ["Megatron-LM", "applies", "checked", "ran on CPU", "ran on GPU"], rows[0]
    return rows[1:]


def test_versions_table_names_the_patch_of_each_tag():
    rows = _versions_table()
    covered = {}
    for row in rows:
        for tag in PATCH_AT:
            short = tag.replace("main-20260822", "main d98e8a64")
            if row[0].startswith(short) or f", {short}" in row[0]:
                covered[tag] = row[1]
    assert set(covered) == set(PATCH_AT), f"tags without a row: {set(PATCH_AT) - set(covered)}"
    for tag, cell in covered.items():
        patch = os.path.basename(PATCH_AT[tag]).replace("megatron-lm-core_v", "").replace(".patch", "")
        assert cell.startswith(f"{patch} patch:"), (tag, cell)


def test_every_cell_of_the_versions_table_is_backed_by_a_test_or_a_committed_result():
    """Each cell names a test that exists (file::function, or ::function / [param] of the file named
    before it in the row) or a committed path, unless it says no / not yet."""
    for row in _versions_table():
        for cell in row[1:]:
            tests = re.findall(r"`(?:(test_\w+\.py))?::(test_\w+)", cell)
            paths = re.findall(r"`((?:benchmarks|tools)/[\w./-]+)`", cell)
            if not tests and not paths and "[" not in cell:
                assert cell.startswith(("no", "not yet")), f"{row[0]}: unbacked cell {cell!r}"
                continue
            current = None
            for file, name in tests:
                current = file or current
                assert current, f"{row[0]}: {name} without a file in {cell!r}"
                source = open(os.path.join(ROOT, "tests", "integration", current), encoding="utf-8").read()
                assert re.search(rf"^def {name}\(", source, flags=re.M), f"{row[0]}: no {current}::{name}"
            for path in paths:
                assert os.path.exists(os.path.join(ROOT, path.rstrip("/"))), f"{row[0]}: no {path}"


# refusals of the core_v0.18+ glue -----------------------------------------------------------------------
def _pretrain_019():
    return _stub(ast.parse("def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, "
                           "forward_step_func, model_provider=None, store=None): pass").body[0])


def test_wrap_launch_refuses_a_parse_without_extra_args_provider():
    parse = _stub(ast.parse("def parse_and_validate_args(ignore_unknown_args=False): pass").body[0])
    with pytest.raises(MegatronVersionError, match=r"parse_and_validate_args\(ignore_unknown_args\) \(megatron-core "
                                                   r".*\) takes no extra_args_provider"):
        megatron_lm.wrap_launch(_pretrain_019(), parse)


def test_wrapped_pretrain_refuses_what_cannot_reach_the_model():
    class Args:
        xirang_config = "ds_config.json"

    pretrain = _pretrain_019()
    wrapped = megatron_lm.wrap_config_pretrain(pretrain, get_args=lambda: Args)

    class NoModel:
        model = None

    with pytest.raises(MegatronVersionError, match="neither a model config .* nor a model_provider"):
        wrapped(NoModel(), "datasets", "encoder_or_decoder", "forward")

    class OldModelConfig:  # a model config without the hook list
        pass

    class Container:
        model = OldModelConfig()

    with pytest.raises(MegatronVersionError, match="OldModelConfig, megatron-core .* has no pre_wrap_hooks list"):
        wrapped(Container(), "datasets", "encoder_or_decoder", "forward")
    assert pretrain.calls == []  # nothing ran
    Args.xirang_config = None  # without the flag: pretrain as it was, nothing added
    wrapped(NoModel(), "datasets", "encoder_or_decoder", "forward")
    assert len(pretrain.calls) == 1


def test_a_provider_at_019_is_wrapped_when_no_model_config_is_given():
    class Args:
        xirang_config = "ds_config.json"

    pretrain = _pretrain_019()

    class NoModel:
        model = None

    megatron_lm.wrap_config_pretrain(pretrain, get_args=lambda: Args)(
        NoModel(), "datasets", "encoder_or_decoder", "forward", model_provider=lambda: None)
    assert isinstance(pretrain.calls[0]["model_provider"], xm.ModelProvider)

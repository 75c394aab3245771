"""The README is a front door (STYLE.md): at most 250 lines, and every relative link in it (and every
``#anchor``, in the README or in the page it points to) leads somewhere that exists."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lowercased, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` ... for repeats)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: pathlib.Path) -> list[str]:
    broken = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked here (no network in tests)
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    return broken


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}): move detail to docs/"


def test_every_link_in_the_readme_resolves():
    assert LINK.findall(README.read_text(encoding="utf-8")), "the scan found no link"
    assert not broken_links(README), broken_links(README)


def test_the_anchor_rule_matches_githubs():
    assert {"measuring-memory-in-your-own-script", "limits-in-short", "where-the-code-lives"} <= anchors(README)


def test_every_link_in_the_docs_resolves():
    """What left the README for docs/ keeps its links working there."""
    broken = {str(p.relative_to(ROOT)): b for p in sorted((ROOT / "docs").glob("*.md")) if (b := broken_links(p))}
    assert not broken, broken


def test_every_plugin_folder_has_a_short_readme_with_its_figure():
    """Each plugin's README names its section, where its parts live and its one current figure with the
    command that made it (or says why it has none); its links resolve."""
    folders = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").exists())
    assert len(folders) >= 8
    for folder in folders:
        readme = folder / "README.md"
        assert readme.exists(), f"{folder.relative_to(ROOT)} has no README.md"
        text = readme.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 40, f"{readme.relative_to(ROOT)}: keep it short; detail goes to docs/"
        assert "## Current figure" in text and "config.py" in text, readme.relative_to(ROOT)
        assert not broken_links(readme), broken_links(readme)

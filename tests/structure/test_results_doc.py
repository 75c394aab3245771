"""docs/results.md is what ``benchmarks/results_doc.py`` generates from the committed JSONs now, so
it cannot go stale; every JSON it names is committed."""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_doc  # noqa: E402


def test_results_doc_is_current():
    assert (ROOT / "docs" / "results.md").read_text(encoding="utf-8") == results_doc.render(), \
        "docs/results.md is stale: run python benchmarks/results_doc.py"


def test_every_json_it_names_exists():
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(benchmarks/results/[^`\s]+\.json)`", text))
    assert len(named) > 20
    assert not [p for p in named if not (ROOT / p).exists()]

"""A pytest plugin for the GPU check: one record per test as soon as it finishes (and one per
collection error), appended to ``$XIRANG_GPU_RECORDS``, so a pytest killed by its step's limit keeps
every result it reached (its junit XML is written only at exit).

    python -m pytest -p pytest_records -m gpu ...
"""
from __future__ import annotations

import os

from xirang_ds.bench import append_jsonl


def _path() -> str | None:
    return os.environ.get("XIRANG_GPU_RECORDS")


def pytest_collectreport(report):
    if report.failed and _path():
        append_jsonl(_path(), {"kind": "test", "test": report.nodeid, "outcome": "collection error",
                                 "detail": str(report.longrepr)[-2000:]})


def pytest_collection_finish(session):
    """Records how many tests will run, and stops the run when the tests would test the checkout
    instead of the installed package (``$XIRANG_GPU_SITE``)."""
    import pytest

    import xirang_ds

    where = os.path.realpath(xirang_ds.__file__)
    if _path():
        append_jsonl(_path(), {"kind": "collected", "tests": len(session.items), "xirang_ds": where})
    site = os.environ.get("XIRANG_GPU_SITE")
    if site and not where.startswith(os.path.realpath(site) + os.sep):
        pytest.exit(f"xirang_ds imported from {where}, not from the installed package in {site}", returncode=3)


def pytest_runtest_logreport(report):
    if not _path():
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "skipped" if report.skipped else report.outcome
        detail = None
        if report.skipped and isinstance(report.longrepr, tuple):
            detail = report.longrepr[2]
        elif report.failed:
            detail = str(report.longrepr)[-2000:]
        append_jsonl(_path(), {"kind": "test", "test": report.nodeid, "outcome": outcome,
                                 "duration_s": round(report.duration, 3), "detail": detail})

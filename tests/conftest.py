"""The whole suite runs in parallel (pytest-xdist: `-n` and `--dist loadgroup` in pyproject's addopts),
since most tests wait on timers and processes rather than compute. This decides which tests share a worker:

- the real-vLLM tier is one group: its engines share the session's venv, tiny models and the `spec_engine`,
  and two CPU engines booting side by side on a 2-core machine each take as long as both one after the other;
- a test using a module- or class-scoped fixture (a router, a sim engine booted once for its module) runs on
  the worker that set it up, so the fixture is set up once, not once per worker;
- every other test goes wherever a worker is free.

The tier's measurements and progress lines are made on the worker that runs it; they reach the terminal from
here (xdist's controller collects nothing, so tests/integration/conftest.py is not loaded on it).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

SHARED_SCOPES = ("module", "class", "package")


def xdist_group(item: pytest.Item) -> str | None:
    path = item.nodeid.split("::", 1)[0]
    if path.startswith("tests/integration/"):
        return "vllm"
    fixtures = getattr(item, "_fixtureinfo", None)
    for defs in (fixtures.name2fixturedefs.values() if fixtures else ()):
        if any(d.scope in SHARED_SCOPES for d in defs):
            return path
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the marks into scheduling groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# -- the real-vLLM tier's report, from the worker that ran it ---------------------------------------------

REPORTS: dict[str, Any] = {}


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # on an xdist worker: hand the tier's measurements to the controller
        from tests.integration.harness import REPORT
        workeroutput["vllm_report"] = json.dumps(REPORT)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent when run without it
def pytest_testnodedown(node: Any, error: Any) -> None:
    REPORTS.update(json.loads(getattr(node, "workeroutput", {}).get("vllm_report", "{}")))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORTS:
        terminalreporter.section("vLLM CPU tier measurements")
        for key, value in REPORTS.items():
            terminalreporter.line(f"{key}: {json.dumps(value)}")

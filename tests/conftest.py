"""The whole suite runs in parallel (pytest-xdist, `-n` in pyproject's addopts), since most tests wait on
timers and processes rather than compute. `Scheduling` decides which tests share a worker:

- the real-vLLM tier is one unit, first: its engines share the session's venv, tiny models and the
  `spec_engine`, and CPU engines booting side by side on a 2-core machine starve each other (tried: with
  the tier spread over four workers the load reached 16 and the run slowed to a crawl); it is the longest
  unit, so it starts first and the others fill in beside it;
- every other module is a unit of its own, so a module-scoped router or sim engine is set up once.

xdist's own `--dist loadgroup` cannot say this under pytest 9.2: it tags node ids, which pytest no longer
lets a plugin rewrite. The tier's measurements and progress lines are made on the worker that runs it; they
reach the terminal from here (xdist's controller collects nothing, so tests/integration/conftest.py is
not loaded on it).
"""

from __future__ import annotations

import collections
import json
from typing import Any

import pytest

VLLM_TIER = "tests/integration/"


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "the real-vLLM tier" if path.startswith(VLLM_TIER) else path


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # an xdist hook, absent when run without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        """xdist's by-module scheduling, with the real-vLLM tier as one unit, in the workers' order."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # the order is the one below, not xdist's (most tests first)
    return Scheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker (whose collection the controller schedules from, in order): the vLLM tier first,
    as it takes longest, then the other units with the most tests first."""
    if not hasattr(config, "workerinput"):
        return  # a run in one process keeps pytest's order: the fast tiers first
    sizes = collections.Counter(unit_of(item.nodeid) for item in items)
    items.sort(key=lambda item: (not item.nodeid.startswith(VLLM_TIER), -sizes[unit_of(item.nodeid)]))


# -- the real-vLLM tier's report, from the worker that ran it ---------------------------------------------

REPORTS: dict[str, Any] = {}


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # on an xdist worker: hand the tier's measurements to the controller
        from tests.integration.harness import REPORT
        workeroutput["vllm_report"] = json.dumps(REPORT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    REPORTS.update(json.loads(getattr(node, "workeroutput", {}).get("vllm_report", "{}")))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORTS:
        terminalreporter.section("vLLM CPU tier measurements")
        for key, value in REPORTS.items():
            terminalreporter.line(f"{key}: {json.dumps(value)}")

"""Run the chaos matrix and the load scenarios, and write their figures into docs/reliability.md.

    .venv/bin/python bench/reliability_report.py [--no-docs] [--select EXPR]

The scenarios are ordinary tests (tests/component/test_chaos.py, test_load.py); this runs
them with HOTSWAP_CHAOS_REPORT / HOTSWAP_RELIABILITY_REPORT set and renders what they recorded
between the generated-section markers of docs/reliability.md (with --no-docs: prints it only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness as h  # bench/harness.py: the repo root, the commit a report names

ROOT = h.REPO
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- generated:begin (bench/reliability_report.py) -->", "<!-- generated:end -->"


def run_tests(env: dict[str, str], select: str) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/component/test_chaos.py", "tests/component/test_load.py", *(["-k", select] if select else [])]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, **env}).returncode


def render(chaos: list[dict], load: list[dict], seconds: float, code: int) -> str:
    out = [BEGIN, "",
           f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} ({os.cpu_count()} cores), "
           f"Python {platform.python_version()}, commit {h.git_rev()}; {seconds:.0f} s; pytest exit code {code}. "
           f"`{h.command_line()}`", "",
           "### Chaos matrix", "",
           "| fault (aimed at b) | sent | answered | errored (well-formed) | hung | b answered / errored | errors seen |",
           "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in chaos:
        b = r["by_model"].get("b", {"answered": 0, "errored": 0})
        errors = ", ".join(f"{k} ×{v}" for k, v in sorted(r["errors"].items())) or "—"
        out.append(f"| {r['scenario']} | {r['sent']} | {r['answered']} | {r['errored']} | {r['hung']} | "
                   f"{b['answered']} / {b['errored']} | {errors} |")
    total = {k: sum(r[k] for r in chaos) for k in ("sent", "answered", "errored", "hung")}
    out += ["", f"All scenarios: {total['sent']} sent = {total['answered']} answered + {total['errored']} errored "
                f"+ {total['hung']} hung. Every scenario also checked that the models not hit (a, c) had no errors "
                "and that b answered again afterwards.", "", "### Load", "",
            "| scenario | sent | answered | lost | figures |", "| --- | ---: | ---: | ---: | --- |"]
    for r in load:
        figures = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.items() if k not in ("scenario", "sent", "answered", "lost"))
        out.append(f"| {r['scenario']} | {r['sent']} | {r['answered']} | {r['lost']} | {figures} |")
    return "\n".join(out + ["", END])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--select", default="", metavar="EXPR", help="only the scenarios pytest's -k EXPR picks (default: all)")
    h.add_docs_args(p, DOC)
    # The smoke: one chaos scenario (a few seconds), rendered and written like the whole matrix.
    args = h.parse(p, argv, smoke=dict(select="test_a_canary_answer_that_is_not_json_under_load"))
    with tempfile.TemporaryDirectory() as tmp:
        chaos_path, load_path = Path(tmp, "chaos.jsonl"), Path(tmp, "load.jsonl")
        started = time.monotonic()
        code = run_tests({"HOTSWAP_CHAOS_REPORT": str(chaos_path), "HOTSWAP_RELIABILITY_REPORT": str(load_path)}, args.select)
        seconds = time.monotonic() - started
        read = lambda p: [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
        section = render(read(chaos_path), read(load_path), seconds, code)
    if args.no_docs:
        print(section)
        return code
    text = args.docs.read_text()
    args.docs.write_text(text[: text.index(BEGIN)] + section + text[text.index(END) + len(END):])
    print(f"wrote {args.docs} (pytest exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

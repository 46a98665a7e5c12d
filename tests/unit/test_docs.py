"""The docs say what the code does: the README's roster reference is the schema's."""

from pathlib import Path

from config.reference import BEGIN, END, render

ROOT = Path(__file__).parents[2]


def test_the_readme_roster_reference_is_generated_from_the_schema():
    readme = (ROOT / "README.md").read_text()
    assert BEGIN in readme and END in readme
    embedded = readme[readme.index(BEGIN): readme.index(END) + len(END)]
    assert embedded == render(), "README.md is stale: paste `python -m config.reference` between the markers"


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/run" in readme
    assert ".venv/bin/python -m pytest" in ci and ".venv/bin/python -m pytest" in readme

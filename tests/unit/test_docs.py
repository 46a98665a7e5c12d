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


def test_ci_says_each_stage_and_the_readme_says_what_it_installs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = ci.split("# --- the README's test command (keep the two identical) ---\n")[1].strip()
    assert command == ".venv/bin/python -m pytest" and f"and runs `{command}`." in readme, "README and .ci/run differ"
    stages = [line for line in ci.splitlines() if line.startswith("stage ")]
    assert [s.split('"')[1].split(":")[0] for s in stages] == ["1/4", "2/4", "3/4", "4/4"], stages
    for tool in ("prometheus", "chromium", "haproxy"):
        assert tool in stages[1] and f"`{tool}`" in readme.split("## How placement")[0], tool
    assert "apt-get" in stages[1] and "`apt-get`" in readme
    assert ".venv/bin/python -m pytest tests/unit" in readme, "the fast loop"
    assert ".venv/bin/pip install openai" in readme and ".venv/bin/python - <<'EOF'" in readme, "the SDK example runs as written"

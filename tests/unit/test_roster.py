"""The roster: defaults, validation messages an operator can act on, and the CLI around them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from config import EXAMPLES, RosterError, RosterFile, parse_roster

ENV = {"KEY_A": "sk-client-secret", "ADMIN": "sk-admin-secret"}


def load(text: str, environ=ENV):
    return parse_roster(textwrap.dedent(text), "roster.yaml", environ)


def errors(text: str, environ=ENV) -> list[str]:
    with pytest.raises(RosterError) as info:
        load(text, environ)
    return [str(issue) for issue in info.value.issues]


MINIMAL = """
models:
  - name: a
    model: /models/a
"""


def test_a_minimal_roster_gets_every_default():
    roster = load(MINIMAL)
    (m,) = roster.models
    assert (roster.listen.host, roster.listen.port) == ("127.0.0.1", 8080)
    assert m.group is None and m.sleep_level == "auto" and m.draft_restore == "none"
    assert (m.devices, m.pin, m.weights_gb, m.gpu_share) == ([0], False, None, 0.9)
    assert m.launcher == ["vllm", "serve"] and m.args == [] and m.managed
    assert (m.gate.min_acceptance_ratio, m.gate.min_acceptance_length, m.gate.on_fail) == (0.5, 1.2, "restart")
    assert m.gate.max_tokens == 64 and m.gate.output_check == "exact"


def test_speculative_turns_draft_restore_to_reload():
    roster = load("""
        models:
          - name: a
            model: /m/a
            speculative: {num_speculative_tokens: 2}
          - name: b
            model: /m/b
            speculative: {num_speculative_tokens: 2}
            draft_restore: preserve
    """)
    assert [m.draft_restore for m in roster.models] == ["reload", "preserve"]


def test_defaults_merge_into_every_model_and_the_model_wins():
    roster = load("""
        defaults:
          group: gpu0
          sleep_level: 1
          env: {OMP_NUM_THREADS: "4", A: "1"}
          args: [--max-model-len, "4096"]
          gate: {max_tokens: 32, on_fail: refuse}
        models:
          - name: a
            model: /m/a
            env: {A: "2"}
            args: "--dtype float16"
            gate: {on_fail: allow}
          - name: b
            model: /m/b
            sleep_level: 2
            group: gpu1
    """)
    a, b = roster.models
    assert a.group == "gpu0" and a.sleep_level == 1
    assert a.env == {"OMP_NUM_THREADS": "4", "A": "2"}
    assert a.args == ["--max-model-len", "4096", "--dtype", "float16"]
    assert (a.gate.max_tokens, a.gate.on_fail) == (32, "allow")
    assert (b.group, b.sleep_level, b.gate.on_fail) == ("gpu1", 2, "refuse")


def test_env_references_resolve_and_secrets_stay_out_of_the_printout():
    roster = load("""
        auth:
          api_keys: ["${KEY_A}"]
          admin_key: "${ADMIN}"
        models:
          - name: a
            model: ${MODEL_DIR:-/default}/a
            env: {HF_TOKEN: "${KEY_A}", OMP_NUM_THREADS: "1"}
    """)
    assert roster.auth.api_keys == ["sk-client-secret"] and roster.auth.admin_key == "sk-admin-secret"
    assert roster.models[0].model == "/default/a"
    shown = json.dumps(roster.redacted())
    assert "secret" not in shown
    assert roster.redacted()["models"][0]["env"] == {"HF_TOKEN": "***", "OMP_NUM_THREADS": "1"}


def test_numbers_and_booleans_in_argv_lists_are_taken_as_written():
    roster = load("""
        defaults:
          args: [--swap-space, 4]
        models:
          - name: a
            model: /m/a
            launcher: [python, -m, engines.sim, serve, --speed, 2.50]
            args: [--gpu-memory-utilization, 0.85, --max-model-len, 4096, --enforce-eager, true,
                   --x, 0.10, --y, 1.0e-3, --z, 1e-3, --w, 0x1F, --v, yes, --rev, 2024-01-01]
          - name: b
            command: [my-engine, --port, "{port}", --util, 0.9, --quiet, false]
    """)
    a, b = roster.models
    assert a.launcher == ["python", "-m", "engines.sim", "serve", "--speed", "2.50"]
    assert a.args == ["--swap-space", "4", "--gpu-memory-utilization", "0.85", "--max-model-len", "4096",
                      "--enforce-eager", "true", "--x", "0.10", "--y", "1.0e-3", "--z", "1e-3", "--w", "0x1F",
                      "--v", "yes", "--rev", "2024-01-01"]
    assert b.command == ["my-engine", "--port", "{port}", "--util", "0.9", "--quiet", "false"]


def test_numbers_in_argv_built_in_python_become_their_text():
    from config.schema import ModelSpec

    spec = ModelSpec(name="a", model="/m/a", args=["--gpu-memory-utilization", 0.85, "--n", 4096, "--b", True])
    assert spec.args == ["--gpu-memory-utilization", "0.85", "--n", "4096", "--b", "true"]


def test_the_schema_accepts_numbers_in_args():
    schema = RosterFile.model_json_schema()
    jsonschema.validate(yaml.safe_load("models: [{name: a, model: m, args: [--gpu-memory-utilization, 0.85, --n, 4]}]"), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(yaml.safe_load("models: [{name: a, model: m, args: [--x, [1]]}]"), schema)


def test_flags_spelled_with_underscores_are_the_same_flags_to_vllm():
    assert spec_with_args("--api_key", "k").engine_api_key == "k"
    assert spec_with_args("--api_key=k").engine_api_key == "k"
    with pytest.raises(ValueError, match="--disable-log-stats removes"):
        spec_with_args("--disable_log_stats")


def spec_with_args(*args: str):
    from config.schema import ModelSpec

    return ModelSpec(name="a", model="/m/a", args=list(args))


def test_a_command_engine_runs_with_the_flags_its_command_says_not_its_args():
    (m,) = load("""
        models:
          - name: own
            command: [my-vllm, --port, "{port}", --gpu-memory-utilization, 0.3, --api-key=engine-key, --load-format, dummy,
                      --scheduling-policy, priority]
            args: [--gpu-memory-utilization, 0.8, --api-key, unused]
        """).models
    assert (m.gpu_share, m.engine_api_key, m.reloads_weights, m.flag("--scheduling-policy")) == (0.3, "engine-key", False, "priority")
    (m,) = load("models: [{name: a, model: /m/a, args: [--api-key, first, --api-key=last, --gpu-memory-utilization, 0.5]}]").models
    assert (m.gpu_share, m.engine_api_key) == (0.5, "last"), "the last of a flag wins, as in vLLM's argparse"


def test_an_error_in_appended_args_points_at_whoever_wrote_the_item():
    found = errors("""
        defaults:
          args: [--a, "1", --b, "2"]
        models:
          - name: a
            model: /m/a
            args: [--c, {x: 1}]
    """)
    assert found == ["roster.yaml:7:17: models[0].args[1]: each item is one argument: a string, number or boolean (found a mapping)"]


def test_kill_grace_is_one_roster_setting():
    assert load(MINIMAL).swap.kill_grace_s == 15
    assert load("swap: {kill_grace_s: 0.5}\n" + textwrap.dedent(MINIMAL)).swap.kill_grace_s == 0.5
    assert errors("swap: {kill_grace_s: 0}\n" + textwrap.dedent(MINIMAL)) == [
        "roster.yaml:1:22: swap.kill_grace_s: must be greater than 0 (found 0)"]


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param("""
            models:
              - name: a
                model: /m/a
                args: [--max-model-len, [4096]]
            """, "roster.yaml:5:29: models[0].args[1]: each item is one argument: a string, number or boolean (found a list)", id="nested-list-in-args"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                launcher: [vllm, {serve: 1}]
            """, "roster.yaml:5:22: models[0].launcher[1]: each item is one argument: a string, number or boolean (found a mapping)", id="mapping-in-launcher"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                args: [--served_model_name, x]
            """, "roster.yaml:5:11: models[0].args: --served-model-name is set by the router", id="router-owned-flag-underscores"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                sleep_level: 3
            """, "roster.yaml:5:18: models[0].sleep_level: must be 'auto', 0, 1 or 2 (found 3)", id="sleep-level"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                sleep_levl: 1
            """, "roster.yaml:5:5: models[0].sleep_levl: unknown key 'sleep_levl'; did you mean 'sleep_level'?", id="unknown-key"),
        pytest.param("""
            swap:
              max_hold: 3
            models: [{name: a, model: /m/a}]
            """, "roster.yaml:3:3: swap.max_hold: unknown key 'max_hold'; did you mean 'max_hold_s'?", id="unknown-section-key"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                gate: {on_fial: refuse}
            """, "roster.yaml:5:12: models[0].gate.on_fial: unknown key 'on_fial'; did you mean 'on_fail'?", id="unknown-nested-key"),
        pytest.param("""
            models: [{name: a, model: /m/a}]
            modles: []
            """, "roster.yaml:3:1: modles: unknown key 'modles'; did you mean 'models'?", id="unknown-top-level"),
        pytest.param("""
            models:
              - name: a
            """, "roster.yaml:3:5: models[0]: set exactly one of model, command, url (found none of them)", id="no-source"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                url: http://127.0.0.1:9000
            """, "roster.yaml:3:5: models[0]: set exactly one of model, command, url (found model, url)", id="two-sources"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                args: [--dtype, float16, --port=9000]
            """, "roster.yaml:5:11: models[0].args: --port is set by the router", id="router-owned-flag"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                args: "--enable-sleep-mode"
            """, "roster.yaml:5:11: models[0].args: --enable-sleep-mode is set by the router", id="router-owned-flag-string"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                speculative: {num_speculative_tokens: 2}
                args: [--disable-log-stats]
            """, "roster.yaml:6:11: models[0].args: --disable-log-stats removes the spec-decode counters the gate reads", id="stats-off-with-gate"),
        pytest.param("""
            models:
              - name: a
                model: /m/${NOT_SET}
            """, "roster.yaml:4:12: models[0].model: environment variable NOT_SET is not set (referenced as ${NOT_SET})", id="unset-env"),
        pytest.param("""
            auth:
              api_keys: [sk-literal]
            models: [{name: a, model: /m/a}]
            """, "roster.yaml:3:14: auth.api_keys[0]: write secrets as ${ENV_VAR}", id="literal-secret"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                draft_restore: reload
            """, "roster.yaml:5:20: models[0].draft_restore: 'reload' needs speculative", id="restore-without-draft"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                gate: {output_check: "prefix:x"}
            """, "roster.yaml:5:26: models[0].gate.output_check: must be 'exact', 'off' or 'prefix:N'", id="output-check"),
        pytest.param("""
            models:
              - name: a
                command: [my-engine, --listen, "{host}"]
            """, "roster.yaml:4:14: models[0].command: unknown placeholder(s) ['host']", id="command-placeholder"),
        pytest.param("""
            defaults:
              model: /m/shared
            models: [{name: a, model: /m/a}]
            """, "roster.yaml:3:3: defaults.model: 'model' identifies one engine; set it on each model, not in defaults", id="identity-in-defaults"),
        pytest.param("""
            defaults:
              sleep_level: 4
            models: [{name: a, model: /m/a}, {name: b, model: /m/b}]
            """, "roster.yaml:3:16: defaults.sleep_level: must be 'auto', 0, 1 or 2 (found 4)", id="bad-default-blamed-once"),
        pytest.param("""
            models:
              - name: a
                model: /m/a
                model: /m/b
            """, "roster.yaml:5:5: models[0].model: duplicate key (the later one would silently win)", id="duplicate-yaml-key"),
    ],
)
def test_each_mistake_is_reported_at_its_line_and_column(text, expected):
    found = errors(text)
    assert len(found) == 1, found
    assert found[0].startswith(expected), found


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param("", "roster.yaml:1:1: roster: file is empty", id="empty"),
        pytest.param("# only a comment\n", "roster.yaml:1:1: roster: file is empty", id="comment-only"),
        pytest.param("- a\n- b\n", "roster.yaml:1:1: roster: must be a mapping with `models:`", id="a-list"),
        pytest.param("models: [\n  {name: a\n", "roster.yaml:3:1: yaml: syntax error", id="yaml-syntax"),
        pytest.param("listen: {port: 1}\n", "roster.yaml:1:1: models: needs at least one model", id="no-models"),
        pytest.param("models: []\n", "roster.yaml:1:1: models: needs at least one model", id="empty-models"),
    ],
)
def test_a_broken_file_says_what_is_wrong_with_it(text, expected):
    found = errors(text)
    assert found and found[0].startswith(expected), found


def test_clashes_across_models_point_at_the_second_one():
    found = errors("""
        listen: {port: 8080}
        models:
          - name: a
            aliases: [alpha]
            model: /m/a
            port: 9001
            group: gpu0
            default: true
          - name: alpha
            model: /m/b
            port: 9001
            group: gpu0
            default: true
          - name: c
            aliases: [a]
            model: /m/c
            port: 8080
    """)
    assert found == [
        "roster.yaml:10:11: models[1].name: 'alpha' is already used by models[0].aliases[0]; names and aliases must be unique",
        "roster.yaml:12:11: models[1].port: port 9001 is already taken by models[0].port",
        "roster.yaml:14:14: models[1].default: group 'gpu0' already has its default model at models[0].default",
        "roster.yaml:16:15: models[2].aliases[0]: 'a' is already used by models[0].name; names and aliases must be unique",
        "roster.yaml:18:11: models[2].port: port 8080 is already taken by listen.port",
    ]


def test_every_error_in_a_file_is_reported_together_in_file_order():
    found = errors("""
        listen: {port: 0}
        queue: {max_waiting: -1}
        models:
          - name: a
            model: /m/a
            sleep_level: 9
          - name: b
            url: ftp://elsewhere
          - name: a
            model: /m/c
    """)
    assert [f.split(": ")[1] for f in found] == [
        "listen.port", "queue.max_waiting", "models[0].sleep_level", "models[1].url", "models[2].name",
    ]
    assert [int(f.split(":")[1]) for f in found] == [2, 3, 7, 9, 10]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_either_loads_or_raises_roster_error(text):
    try:
        parse_roster(text, "fuzz.yaml", {})
    except RosterError as exc:
        assert exc.issues and all(str(i).startswith("fuzz.yaml:") for i in exc.issues)


@settings(max_examples=150, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["models", "name", "model", "url", "command", "port", "args", "gate", "defaults", "speculative", "aliases", "x"]), inner, max_size=4),
    max_leaves=20,
))
def test_any_yaml_shape_either_loads_or_raises_roster_error(data):
    text = yaml.safe_dump(data)
    try:
        parse_roster(text, "fuzz.yaml", {})
    except RosterError as exc:
        assert exc.issues


# -- the CLI, as an operator runs it -------------------------------------------------------

def hotswap(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, timeout=60, env=env)


def test_a_vllm_flag_written_as_a_model_key_is_answered_with_the_args_line_to_write_instead():
    found = errors("""
        defaults:
          max-model-len: 4096
        models:
          - name: chat
            model: /m/chat
            gpu_memory_utilization: 0.85
            enforce_eager: true
            compilation_config: {level: 3}
            speculative_config: {num_speculative_tokens: 3}
        """)
    assert found == [
        "roster.yaml:3:3: defaults.max-model-len: unknown key 'max-model-len': `--max-model-len` is a vLLM flag, and "
        "vLLM's flags go in args: write `args: [--max-model-len, 4096]`",
        "roster.yaml:7:5: models[0].gpu_memory_utilization: unknown key 'gpu_memory_utilization': `--gpu-memory-utilization` "
        "is a vLLM flag, and vLLM's flags go in args: write `args: [--gpu-memory-utilization, 0.85]`",
        "roster.yaml:8:5: models[0].enforce_eager: unknown key 'enforce_eager': `--enforce-eager` is a vLLM flag, and "
        "vLLM's flags go in args: write `args: [--enforce-eager]`",
        "roster.yaml:9:5: models[0].compilation_config: unknown key 'compilation_config': `--compilation-config` is a vLLM "
        """flag, and vLLM's flags go in args: write `args: [--compilation-config, '{"level": 3}']`""",
        # the router writes --speculative-config itself, from a key of its own
        "roster.yaml:10:5: models[0].speculative_config: unknown key 'speculative_config'; did you mean 'speculative'?",
    ]
    assert errors("swap:\n  gpu_memory_utilization: 0.5\nmodels: [{name: a, model: /m/a}]\n")[0].startswith(
        "roster.yaml:2:3: swap.gpu_memory_utilization: unknown key 'gpu_memory_utilization'; known keys: "), "not a model's key"


def test_check_resolved_prints_the_resolved_roster_and_exits_0():
    run = hotswap("check", "--config", str(EXAMPLES / "demo.yaml"))
    assert run.returncode == 0, run.stderr
    printed = yaml.safe_load(run.stdout)
    assert [m["name"] for m in printed["models"]] == ["chat-small", "chat-spec", "chat-fragile"]
    assert printed["models"][1]["draft_restore"] == "reload"


def test_check_prints_every_error_and_exits_2(tmp_path: Path):
    roster = tmp_path / "bad.yaml"
    roster.write_text("models:\n  - name: a\n    model: /m\n    sleep_level: 5\n  - name: a\n    url: http://x:1\n")
    run = hotswap("check", "--config", str(roster))
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.splitlines()
    assert lines[0] == f"{roster}:4:18: models[0].sleep_level: must be 'auto', 0, 1 or 2 (found 5)"
    assert lines[1] == f"{roster}:5:11: models[1].name: 'a' is already used by models[0].name; names and aliases must be unique"
    assert "2 errors" in lines[2]


def test_check_refuses_a_name_or_alias_the_agent_line_and_the_front_rule_cannot_carry(tmp_path: Path):
    roster = tmp_path / "names.yaml"
    roster.write_text('models:\n  - name: my model\n    model: /m\n    aliases: [ok, "tab\\there", "bell\\a"]\n')
    run = hotswap("check", "--config", str(roster))
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.splitlines()
    rule = "names and aliases are one word, without whitespace or control characters"
    assert lines[0].startswith(f"{roster}:2:11: models[0].name: 'my model' has a space at position 2: {rule}"), lines
    assert lines[1].startswith(f"{roster}:4:19: models[0].aliases[1]: 'tab\\there' has '\\t' at position 3: {rule}"), lines
    assert lines[2].startswith(f"{roster}:4:32: models[0].aliases[2]: 'bell\\x07' has '\\x07' at position 4: {rule}"), lines


def test_check_of_a_missing_file_exits_2():
    run = hotswap("check", "--config", "/nonexistent/roster.yaml")
    assert run.returncode == 2 and "/nonexistent/roster.yaml:1:1: roster: cannot read file" in run.stderr


def test_check_refuses_an_infinite_body_limit_that_serve_would_crash_on(tmp_path: Path):
    roster = tmp_path / "inf.yaml"
    roster.write_text("listen:\n  max_body_mb: .inf\nmodels: [{name: a, model: /m/a}]\n")
    run = hotswap("check", "--config", str(roster))
    assert run.returncode == 2 and run.stdout == "", run.stdout
    assert run.stderr.splitlines()[0] == f"{roster}:2:16: listen.max_body_mb: must be a finite number (found inf)"


@pytest.mark.parametrize("text, expected", [
    pytest.param("swap: {min_active_s: .nan}", "roster.yaml:1:22: swap.min_active_s: must be a finite number (found nan)",
                 id="nan-in-a-section"),
    pytest.param("queue: {stream_keepalive_s: -.inf}", "roster.yaml:1:29: queue.stream_keepalive_s: must be a finite number",
                 id="optional-float"),
    pytest.param("gpus: [{index: 0, memory_gb: .inf}]", "roster.yaml:1:30: gpus[0].memory_gb: must be a finite number",
                 id="a-gpu"),
    pytest.param("defaults: {weights_gb: .Inf}", "roster.yaml:1:24: defaults.weights_gb: must be a finite number",
                 id="a-default"),
    pytest.param("defaults: {gate: {midlife_window_s: .inf}}", "roster.yaml:1:37: defaults.gate.midlife_window_s: must be a "
                 "finite number", id="a-nested-default"),
])
def test_no_float_key_takes_infinity_or_nan(text, expected):
    found = errors(text + "\nmodels: [{name: a, model: /m/a}]\n")
    assert len(found) == 1 and found[0].startswith(expected), found


def test_help_describes_every_command():
    text = hotswap("--help").stdout
    for command in ("serve", "check", "schema", "status"):
        assert command in text
    assert "--demo" in hotswap("serve", "--help").stdout


def test_schema_validates_every_example_and_rejects_a_typo():
    run = hotswap("schema")
    assert run.returncode == 0
    schema = json.loads(run.stdout)
    assert schema == RosterFile.model_json_schema()
    for example in sorted(EXAMPLES.glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(example.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"models": [{"name": "a", "model": "m", "sleep_levl": 1}]}, schema)


def test_a_loaded_roster_knows_where_each_model_key_was_written():
    text = """
        defaults:
          launcher: [my-vllm, serve]
        models:
          - name: a
            model: /m/a
          - name: b
            model: /m/b
            launcher: [other, serve]
    """
    roster = load(text)
    assert roster.locate(("models", 0, "launcher", 0)) == ("defaults.launcher[0]", 3, 14)
    assert roster.locate(("models", 1, "launcher")) == ("models[1].launcher", 9, 15)
    assert roster.locate(("models", 1, "sleep_level")) == ("models[1].sleep_level", 7, 5)  # a schema default: at its model
    assert roster == load(text)  # two loads of one file are still equal


def test_the_node_section_names_this_node_from_the_environment_and_points_at_typos():
    roster = parse_roster("node: {name: '${POD_NAME}', labels: {zone: a}}\nmodels: [{name: a, model: m}]\n", "r.yaml",
                          {"POD_NAME": "hotswap-1"})
    assert (roster.node.name, roster.node.labels) == ("hotswap-1", {"zone": "a"})
    assert parse_roster("models: [{name: a, model: m}]\n", "r.yaml", {}).node.name is None  # the host name, at run time
    assert errors("node:\n  nme: a\nlisten: {drain_notice_s: -1}\nmodels: [{name: a, model: m}]\n") == [
        "roster.yaml:2:3: node.nme: unknown key 'nme'; did you mean 'name'?",
        "roster.yaml:3:26: listen.drain_notice_s: must be greater than or equal to 0 (found -1)",
    ]


def test_sleep_level_2_is_refused_for_a_load_format_whose_loader_cannot_reload_weights():
    [error] = errors("""
        models:
          - name: tz
            model: /m/tz
            sleep_level: 2
            args: [--load-format, tensorizer]
        """)
    assert "models[0].args" in error and ":6:" in error, error
    assert "vLLM 0.32 cannot do for --load-format tensorizer" in error and "set sleep_level: 1, or auto" in error
    [error] = errors("""
        defaults:
          sleep_level: 2
        models:
          - name: sharded
            command: [vllm, serve, /m/s, --port, "{port}", --load-format=sharded_state]
        """)
    assert "--load-format sharded_state" in error, error
    assert error.startswith("roster.yaml:6:14: models[0].command: "), "where the flag was written, not args (which it has none of)"
    [error] = errors("""
        models:
          - name: dummy
            sleep_level: 2
            command: "vllm serve /m/d --port {port} --load-format dummy"
            args: [--max-model-len, "4096"]
        """)
    assert error.startswith("roster.yaml:5:14: models[0].command: ") and "--load-format dummy" in error, error
    for fine in ("sleep_level: 1", "sleep_level: auto"):
        roster = load(f"""
            models:
              - name: tz
                model: /m/tz
                {fine}
                args: [--load-format, tensorizer]
            """)
        assert not roster.models[0].reloads_weights
    assert load("models:\n  - name: st\n    model: /m/st\n    sleep_level: 2\n    args: [--load-format, safetensors]\n").models[0].reloads_weights


def test_node_peers_are_base_urls_of_other_nodes():
    roster = parse_roster("node: {peers: ['http://10.0.0.2:8080', 'https://b.example/hotswap/']}\nmodels: [{name: a, model: m}]\n",
                          "r.yaml", {})
    assert roster.node.peer_urls() == ["http://10.0.0.2:8080", "https://b.example/hotswap"]
    assert parse_roster("models: [{name: a, model: m}]\n", "r.yaml", {}).node.peer_urls() == []  # no peers: as before
    assert errors("node:\n  peers:\n    - http://b:8080\n    - b:8080\nmodels: [{name: a, model: m}]\n") == [
        "roster.yaml:4:7: node.peers[1]: URL scheme should be 'http' or 'https' (found 'b:8080')"]
    assert errors("node:\n  peers: [http://b:8080, 'http://b:8080/']\nmodels: [{name: a, model: m}]\n") == [
        "roster.yaml:2:10: node.peers: peers[1] 'http://b:8080' is listed twice"]
    for creds in ("ops:hunter2@", ":hunter2@"):  # a password alone is credentials too, and never shown
        [error] = errors(f"node:\n  peers: ['http://{creds}b:8080']\nmodels: [{{name: a, model: m}}]\n")
        assert "without query or credentials" in error and "hunter2" not in error, error


def test_an_agent_beyond_loopback_needs_an_agent_key_written_as_an_env_reference(tmp_path: Path):
    models = "models: [{name: a, model: m}]\n"
    assert errors("listen: {host: 0.0.0.0}\nnode: {agent_port: 8081}\n" + models) == [
        "roster.yaml:2:20: node.agent_port: an agent on 0.0.0.0 would tell anyone who reaches it which models this node "
        "serves: set node.agent_key: ${ENV_VAR} (HAProxy sends it on its agent-send line, docs/multi-node.md), or listen on loopback"]
    assert errors("node: {agent_port: 8081, agent_key: literal-key}\n" + models) == [
        "roster.yaml:1:37: node.agent_key: write secrets as ${ENV_VAR} and set them in the environment, never in the file"]
    assert load("node: {agent_port: 8081}\n" + models).node.agent_key is None  # loopback: no key needed
    keyed = load("listen: {host: 0.0.0.0}\nnode: {agent_port: 8081, agent_key: '${AGENT}'}\n" + models, {"AGENT": "ag-key-1"})
    assert keyed.node.agent_key == "ag-key-1" and keyed.redacted()["node"]["agent_key"] == "***"
    assert errors("node: {agent_port: 8081, agent_key: '${AGENT}'}\n" + models, {"AGENT": "two words"})[0].endswith(
        "node.agent_key: must be one word, without whitespace or control characters: it is the first word of the agent-check line")

    roster = tmp_path / "roster.yaml"
    roster.write_text("node: {agent_port: 8081}\n" + models)
    run = hotswap("serve", "--config", str(roster), "--host", "0.0.0.0")
    assert run.returncode == 2 and f"{roster}: node.agent_port: with --host an agent on 0.0.0.0 would tell anyone" in run.stderr

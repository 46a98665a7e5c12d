"""`hotswap check` refuses placements no scheduling can satisfy, each at its file:line:col.

Pinned models are always awake; a model's share is its --gpu-memory-utilization (vLLM's 0.9 when unset).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from config import RosterError, parse_roster

REPO = Path(__file__).resolve().parents[2]
HOTSWAP = [sys.executable, "-m", "router.cli"]


def load(text: str):
    return parse_roster(textwrap.dedent(text), "roster.yaml", {})


def errors(text: str) -> list[str]:
    with pytest.raises(RosterError) as info:
        load(text)
    return [str(issue) for issue in info.value.issues]


# -- devices and gpus: ----------------------------------------------------------------------

def test_a_device_gpus_does_not_list_is_refused_where_it_is_written():
    assert errors("""
        gpus:
          - {index: 0, memory_gb: 141}
          - {index: 1, memory_gb: 141}
        models:
          - name: a
            model: /m/a
            devices: [1, 3]
        """) == ["roster.yaml:8:18: models[0].devices[1]: GPU 3 is not in gpus: (known: 0, 1)"]


def test_a_device_from_defaults_is_refused_once_in_defaults():
    assert errors("""
        gpus: [{index: 0, memory_gb: 80}]
        defaults:
          devices: [2]
        models:
          - {name: a, model: /m/a, args: [--gpu-memory-utilization, 0.4]}
          - {name: b, model: /m/b, args: [--gpu-memory-utilization, 0.4]}
        """) == ["roster.yaml:4:13: defaults.devices[0]: GPU 2 is not in gpus: (known: 0)"]


def test_without_gpus_any_index_is_taken_as_written():
    assert load("models: [{name: a, model: /m/a, devices: [7]}]").models[0].devices == [7]


def test_a_broken_gpus_entry_is_the_only_error_not_every_device_after_it():
    assert errors("""
        gpus:
          - {index: 0, memory_gb: 80}
          - {index: 1}
        models:
          - {name: a, model: /m/a, devices: [1]}
        """) == ["roster.yaml:4:5: gpus[1].memory_gb: is required"]


# -- a share that can never fit beside the pinned models -------------------------------------

def test_a_share_that_never_fits_beside_the_pinned_models_is_refused_at_its_value():
    assert errors("""
        models:
          - name: chat
            model: /m/chat
            pin: true
            args: [--gpu-memory-utilization, 0.3]
          - name: embed
            model: /m/embed
            pin: true
            args: [--gpu-memory-utilization=0.1]
          - name: big
            model: /m/big
            args: [--max-model-len, 8192, --gpu-memory-utilization, 0.7]
        """) == [
        "roster.yaml:13:61: models[2].args[3]: 'big' takes 0.7 (--gpu-memory-utilization) of GPU 0 when awake, "
        "but the pinned models there always hold 0.4 (chat: 0.3, embed: 0.1): 1.1 > 1.0, so it could never wake; "
        "lower its --gpu-memory-utilization to at most 0.6, or unpin one of them",
    ]


def test_vllms_default_share_is_refused_at_the_model_and_says_it_is_the_default():
    assert errors("""
        models:
          - {name: chat, model: /m/chat, pin: true, devices: [0, 1], args: [--gpu-memory-utilization, 0.25]}
          - name: big
            model: /m/big
            devices: [1]
        """) == [
        "roster.yaml:4:5: models[1]: 'big' sets no --gpu-memory-utilization in args, so vLLM takes its default 0.9 "
        "of GPU 1 when awake, but the pinned models there always hold 0.25 (chat: 0.25): 1.15 > 1.0, so it could never "
        "wake; lower its --gpu-memory-utilization to at most 0.75, or unpin one of them",
    ]


def test_a_share_set_in_defaults_is_refused_in_defaults():
    # args append: chat's own 0.5 comes after the default 0.6 and wins; big keeps the default's.
    assert errors("""
        defaults:
          args: [--gpu-memory-utilization, 0.6]
        models:
          - {name: chat, model: /m/chat, pin: true, args: [--gpu-memory-utilization, 0.5]}
          - {name: big, model: /m/big, args: [--max-model-len, 4096]}
        """) == [
        "roster.yaml:3:36: defaults.args[1]: 'big' takes 0.6 (--gpu-memory-utilization) of GPU 0 when awake, "
        "but the pinned models there always hold 0.5 (chat: 0.5): 1.1 > 1.0, so it could never wake; "
        "lower its --gpu-memory-utilization to at most 0.5, or unpin one of them",
    ]


def test_a_device_full_of_pinned_models_leaves_no_room():
    found = errors("""
        models:
          - {name: chat, model: /m/chat, pin: true, args: [--gpu-memory-utilization, 1.0]}
          - {name: embed, model: /m/embed, args: "--gpu-memory-utilization 0.05"}
        """)
    assert found == [
        "roster.yaml:4:42: models[1].args[1]: 'embed' takes 0.05 (--gpu-memory-utilization) of GPU 0 when awake, "
        "but the pinned models there always hold 1 (chat: 1): 1.05 > 1.0, so it could never wake; "
        "move it to another GPU, or unpin one of them",
    ]


@pytest.mark.parametrize("roster", [
    pytest.param("""
        models:
          - {name: a, model: /m/a, pin: true, args: [--gpu-memory-utilization, 0.1]}
          - {name: b, model: /m/b, pin: true, args: [--gpu-memory-utilization, 0.2]}
          - {name: c, model: /m/c, args: [--gpu-memory-utilization, 0.7]}
        """, id="exactly-1.0-fits-float-sums-and-all"),
    pytest.param("""
        models:
          - {name: a, model: /m/a}
          - {name: b, model: /m/b}
          - {name: c, model: /m/c}
        """, id="unpinned-models-take-turns"),
    pytest.param("""
        models:
          - {name: a, model: /m/a, pin: true, devices: [0]}
          - {name: b, model: /m/b, devices: [1]}
        """, id="a-pinned-model-on-another-gpu"),
    pytest.param("""
        models:
          - {name: a, model: /m/a, pin: true, group: g, args: [--gpu-memory-utilization, 0.3]}
          - {name: b, model: /m/b, pin: true, group: h, args: [--gpu-memory-utilization, 0.3]}
        """, id="pinned-in-different-groups"),
])
def test_placements_that_can_be_satisfied_load(roster):
    load(roster)


def test_a_command_engines_share_is_read_from_its_command():
    # Its args never reach the engine; what it runs with is what its command says.
    assert errors("""
        models:
          - {name: chat, model: /m/chat, pin: true, args: [--gpu-memory-utilization, 0.1]}
          - {name: own, command: [my-vllm, --port, "{port}", --gpu-memory-utilization, 0.95], args: [--gpu-memory-utilization, 0.1]}
        """) == [
        "roster.yaml:4:80: models[1].command[4]: 'own' takes 0.95 (--gpu-memory-utilization) of GPU 0 when awake, "
        "but the pinned models there always hold 0.1 (chat: 0.1): 1.05 > 1.0, so it could never wake; "
        "lower its --gpu-memory-utilization to at most 0.9, or unpin one of them",
    ]
    load("""
        models:
          - {name: a, pin: true, command: [my-vllm, --port, "{port}", --gpu-memory-utilization=0.3]}
          - {name: b, pin: true, command: "my-vllm --port {port} --gpu-memory-utilization 0.3"}
        """)
    assert errors("""
        models:
          - {name: a, command: [my-vllm, --port, "{port}", --gpu-memory-utilization, 1.5]}
        """) == ["roster.yaml:3:24: models[0].command: --gpu-memory-utilization must be in (0, 1]: "
                 "the fraction of each of the model's devices it uses when awake (found 1.5)"]


def test_a_share_the_schema_refuses_gets_only_the_schemas_message():
    assert errors("""
        models:
          - {name: a, model: /m/a, pin: true, args: [--gpu-memory-utilization, 0.5]}
          - {name: b, model: /m/b, args: [--gpu-memory-utilization, 1.5]}
        """) == ["roster.yaml:4:34: models[1].args: --gpu-memory-utilization must be in (0, 1]: "
                 "the fraction of each of the model's devices it uses when awake (found 1.5)"]


# -- pinned models ---------------------------------------------------------------------------

def test_pinned_models_that_overcommit_a_device_are_refused_at_the_pin_that_tips_it():
    assert errors("""
        models:
          - name: chat
            model: /m/chat
            pin: true
            devices: [0, 1]
            args: [--gpu-memory-utilization, 0.5]
          - name: embed
            model: /m/embed
            pin: true
            devices: [1]
            args: [--gpu-memory-utilization, 0.3]
          - name: rerank
            model: /m/rerank
            pin: true
            devices: [1]
            args: [--gpu-memory-utilization, 0.3]
        """) == [
        "roster.yaml:15:10: models[2].pin: pinned models need 1.1 of GPU 1 (chat: 0.5, embed: 0.3, rerank: 0.3), "
        "more than 1.0; pinned models are always awake, so their --gpu-memory-utilization on one GPU must add up to at most 1.0",
    ]


def test_pin_in_defaults_is_refused_in_defaults():
    assert errors("""
        defaults:
          pin: true
        models:
          - {name: a, model: /m/a}
          - {name: b, model: /m/b}
        """) == [
        "roster.yaml:3:8: defaults.pin: pinned models need 1.8 of GPU 0 (a: 0.9, b: 0.9), more than 1.0; "
        "pinned models are always awake, so their --gpu-memory-utilization on one GPU must add up to at most 1.0",
    ]


def test_two_pinned_models_in_one_group_are_refused_at_the_second_ones_group():
    assert errors("""
        models:
          - {name: chat, model: /m/chat, pin: true, group: gpu0, args: [--gpu-memory-utilization, 0.3]}
          - {name: code, model: /m/code, group: gpu0, args: [--gpu-memory-utilization, 0.3]}
          - {name: embed, model: /m/embed, pin: true, group: gpu0, args: [--gpu-memory-utilization, 0.1]}
        """) == [
        "roster.yaml:4:41: models[1].group: 'code' shares group 'gpu0' with 'chat' (models[0]), which is pinned: "
        "a group keeps one model awake at a time and a pinned model is always awake, so it could never wake; "
        "move it to another group or unpin that one",
        "roster.yaml:5:54: models[2].group: 'embed' and 'chat' (models[0]) are both pinned in group 'gpu0'; "
        "a group keeps one model awake at a time and a pinned model is always awake: unpin one or move it to another group",
    ]


# -- CUDA_VISIBLE_DEVICES is the router's ----------------------------------------------------

def test_cuda_visible_devices_in_env_is_refused_where_it_is_written():
    assert errors("""
        models:
          - name: a
            model: /m/a
            env:
              HF_HOME: /models/hf
              CUDA_VISIBLE_DEVICES: "1"
        """) == ["roster.yaml:6:7: models[0].env: CUDA_VISIBLE_DEVICES is set by the router from `devices`; "
                 "list the GPU indexes there instead"]


# -- through the real CLI --------------------------------------------------------------------

def test_hotswap_check_prints_each_placement_error_at_its_line_and_exits_2(tmp_path: Path):
    roster = tmp_path / "roster.yaml"
    roster.write_text(textwrap.dedent("""\
        gpus:
          - {index: 0, memory_gb: 141}
        models:
          - name: chat
            model: /m/chat
            pin: true
            args: [--gpu-memory-utilization, 0.6]
          - name: embed
            model: /m/embed
            pin: true
            args: [--gpu-memory-utilization, 0.5]
          - name: big
            model: /m/big
            devices: [1]
        """))
    run = subprocess.run([*HOTSWAP, "check", "--config", str(roster)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.splitlines() == [
        f"{roster}:10:10: models[1].pin: pinned models need 1.1 of GPU 0 (chat: 0.6, embed: 0.5), more than 1.0; "
        "pinned models are always awake, so their --gpu-memory-utilization on one GPU must add up to at most 1.0",
        f"{roster}:14:15: models[2].devices[0]: GPU 1 is not in gpus: (known: 0)",
        f"{roster}: 2 errors; nothing was started",
    ]

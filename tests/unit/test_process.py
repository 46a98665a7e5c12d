"""Engine processes: the argv the router composes."""

from __future__ import annotations

import pytest

import engines.process
from config import RosterError, parse_roster
from config.schema import ROUTER_OWNED_FLAGS, ModelSpec
from engines.process import ROUTER_FLAG_VALUES, compose_argv


def spec(**fields) -> ModelSpec:
    return ModelSpec(name="a", model="/m/a", aliases=["alpha"], **fields)


SPECS = {
    "reload": spec(speculative={"num_speculative_tokens": 3}),
    "preserve": spec(speculative={"num_speculative_tokens": 3}, draft_restore="preserve"),
    "none": spec(speculative={"num_speculative_tokens": 3}, draft_restore="none"),
    "no-draft": spec(),
}


def router_flags(model: ModelSpec) -> list[str]:
    """The flags compose_argv puts between the model and the operator's args."""
    argv = compose_argv(model, 9000)
    owned = argv[len(model.launcher) + 1: len(argv) - len(model.args)]
    return [part for part in owned if part.startswith("--")]


def test_every_router_owned_flag_has_a_value_rule_and_every_rule_a_flag():
    assert set(ROUTER_FLAG_VALUES) == set(ROUTER_OWNED_FLAGS)


@pytest.mark.parametrize("name", SPECS)
def test_every_flag_the_router_emits_is_router_owned_and_refused_in_args(name):
    flags = router_flags(SPECS[name].model_copy(update={"args": ["--dtype", "half"]}))
    assert flags and set(flags) <= set(ROUTER_OWNED_FLAGS), flags
    for flag in flags:
        with pytest.raises(RosterError, match=f"{flag} is set by the router"):
            parse_roster(f"models: [{{name: a, model: /m/a, args: [{flag}, x]}}]\n", "roster.yaml", {})


def test_the_specs_cover_each_draft_restore():
    assert "--worker-extension-cls" in router_flags(SPECS["reload"])
    assert "--sleep-preserve-parameter-names" in router_flags(SPECS["preserve"])
    assert not {"--worker-extension-cls", "--sleep-preserve-parameter-names"} & set(router_flags(SPECS["none"]))
    assert "--speculative-config" not in router_flags(SPECS["no-draft"])


def test_a_router_owned_flag_without_a_value_rule_fails_loudly(monkeypatch):
    monkeypatch.setattr(engines.process, "ROUTER_OWNED_FLAGS", (*ROUTER_OWNED_FLAGS, "--new-flag"))
    with pytest.raises(RuntimeError, match="--new-flag has no value rule"):
        compose_argv(SPECS["reload"], 9000)

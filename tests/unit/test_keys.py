"""Scoped keys: what the roster refuses, and what each key may use."""

from __future__ import annotations

import pytest

from config import RosterError, parse_roster
from router.keys import KeyTable

MODELS = "models:\n  - {name: chat-a, model: m, aliases: [fast]}\n  - {name: embed, model: e}\n"
ENV = {"K1": "k1-secret", "K2": "k2-secret"}


def errors(auth: str) -> list[str]:
    with pytest.raises(RosterError) as refused:
        parse_roster(auth + MODELS, "r.yaml", ENV)
    return [str(i) for i in refused.value.issues]


def table(auth: str) -> KeyTable:
    return KeyTable(parse_roster(auth + MODELS, "r.yaml", ENV).auth)


def test_each_refusal_says_where_and_never_shows_a_key():
    assert errors("auth:\n  keys:\n    - {key: k1-secret, models: ['*']}\n") == [
        "r.yaml:3:13: auth.keys[0].key: write secrets as ${ENV_VAR} and set them in the environment, never in the file"]
    assert errors("auth:\n  keys:\n    - {key: '${K1}'}\n") == [
        "r.yaml:3:7: auth.keys[0]: grants nothing: give it models: [...] (globs over model names; '*' for all), admin: true "
        "and/or metrics: true"]
    repeated = errors("auth:\n  admin_key: '${K1}'\n  keys:\n    - {key: '${K1}', models: [embed]}\n")
    assert repeated == ["r.yaml:4:5: auth.keys: keys[0].key is the same key as admin_key: one key has one scope; remove one of them"]
    assert "k1-secret" not in repeated[0]
    assert errors("auth:\n  keys:\n    - {key: '${K1}', models: [a], name: x}\n    - {key: '${K2}', admin: true, name: x}\n") == [
        "r.yaml:3:5: auth.keys: keys[1].name 'x' is already the name of keys[0]; names must be unique"]


def test_a_key_may_use_a_model_when_one_of_its_names_matches_a_glob():
    keys = table("auth:\n  keys:\n    - {key: '${K1}', models: ['fa*']}\n    - {key: '${K2}', admin: true}\n")
    team, ops = keys.identify(b"k1-secret"), keys.identify(b"k2-secret")
    assert team.name == "keys[0]" and team.may_use(["chat-a", "fast"]) and not team.may_use(["embed"])
    assert ops.admin and not ops.may_use(["chat-a", "fast"]) and not team.admin
    assert keys.client_auth and keys.admin_auth
    assert keys.identify(b"") is None and keys.identify(b"k1-secre") is None and keys.identify(b"k1-secret ") is None


def test_the_shorthands_are_keys_for_everything_and_for_admin():
    keys = table("auth:\n  api_keys: ['${K1}']\n  admin_key: '${K2}'\n")
    assert keys.identify(b"k1-secret").name == "api_keys[0]" and keys.identify(b"k1-secret").may_use(["anything"])
    assert keys.identify(b"k2-secret").name == "admin_key" and not keys.identify(b"k2-secret").may_use(["anything"])
    only_admin = table("auth:\n  admin_key: '${K2}'\n")
    assert not only_admin.client_auth and only_admin.admin_auth, "an admin key alone leaves /v1 open, as before"


def test_a_key_has_a_class_interactive_unless_the_roster_says_batch_and_a_typo_is_refused_where_it_is():
    keys = table("auth:\n  keys:\n    - {key: '${K1}', models: ['*'], class: batch}\n    - {key: '${K2}', models: ['*']}\n")
    assert keys.identify(b"k1-secret").klass == "batch" and keys.identify(b"k2-secret").klass == "interactive"
    [refused] = errors("auth:\n  keys:\n    - {key: '${K1}', models: ['*'], class: bulk}\n")
    assert refused.startswith("r.yaml:3:") and "auth.keys[0].class" in refused and "'interactive' or 'batch'" in refused
    printed = parse_roster("auth:\n  keys:\n    - {key: '${K1}', models: ['*'], class: batch}\n" + MODELS, "r.yaml", ENV).redacted()
    assert printed["auth"]["keys"][0]["class"] == "batch" and "klass" not in printed["auth"]["keys"][0]


def test_the_class_header_lowers_a_key_class_never_raises_it_and_anything_else_is_a_400():
    from types import SimpleNamespace

    from router.errors import APIError
    from router.keys import Grant
    from router.keys import request_class

    def klass(key_class: str, header=None) -> str:
        request = SimpleNamespace(headers={} if header is None else {"X-Hotswap-Class": header})
        return request_class(request, Grant("k", ("*",), klass=key_class))

    assert klass("interactive") == "interactive" and klass("batch") == "batch"
    assert klass("interactive", "batch") == "batch" and klass("interactive", " Batch ") == "batch"
    assert klass("batch", "interactive") == "batch", "a header never raises a key's class"
    for bad in ("urgent", "", "0"):
        with pytest.raises(APIError) as refused:
            klass("interactive", bad)
        assert refused.value.status == 400 and refused.value.code == "invalid_header"

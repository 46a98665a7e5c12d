"""A peer's /v1/models is read as a model list or refused as one: whatever a peer answers, the
hand-off sees a Listing or pydantic's ValidationError (which skips that peer), never another
exception (which was a 500 for every request passed on, issue 34 item 3)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.fleet.listings import parse

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
CARD = st.fixed_dictionaries({}, optional={"id": JSON | st.text(max_size=8), "state": JSON | st.sampled_from(["awake", "sleeping"]),
                                           "wake_estimate_s": JSON, "node": JSON | st.fixed_dictionaries({"name": JSON})})
LISTING = JSON | st.fixed_dictionaries({"data": JSON | st.lists(CARD | JSON, max_size=4)})


@settings(max_examples=400, deadline=None)
@given(LISTING)
def test_any_json_a_peer_answers_is_a_listing_or_a_validation_error(document):
    try:
        listing = parse(json.dumps(document).encode())
    except ValidationError:
        return
    assert all(isinstance(name, str) and isinstance(awake, bool) and estimate >= 0
               for name, (awake, estimate) in listing.models.items())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_bytes_that_are_not_json_are_a_validation_error(body):
    try:
        parse(body)
    except ValidationError:
        pass


@pytest.mark.parametrize("document, where", [({"data": 5}, "data"),
                                             ({"data": [{"id": "m", "wake_estimate_s": "soon"}]}, "wake_estimate_s"),
                                             ({"data": [{"id": "m", "wake_estimate_s": -1}]}, "wake_estimate_s"),
                                             ({"object": "list"}, "data"), ([], "")])
def test_the_reviews_bad_listings_are_refused(document, where):
    with pytest.raises(ValidationError) as caught:
        parse(json.dumps(document).encode())
    assert where in ".".join(str(p) for p in caught.value.errors()[0]["loc"])


def test_a_well_formed_listing_says_which_models_are_awake_and_the_node():
    listing = parse(json.dumps({"object": "list", "data": [
        {"id": "a", "state": "awake", "wake_estimate_s": 0, "node": {"name": "node-b", "labels": {}}, "extra": 1},
        {"id": "b", "state": "sleeping", "wake_estimate_s": 4.5}, {"id": "c"}]}).encode())
    assert listing.models == {"a": (True, 0.0), "b": (False, 4.5), "c": (False, 0.0)} and listing.node == "node-b"


def test_a_peer_that_keeps_failing_stays_backed_off_at_the_most_and_never_overflows():
    from router.fleet.listings import BACKOFF_MAX_S, PeerHealth

    health = PeerHealth("http://10.0.0.9:8080")
    for _ in range(2000):  # a decommissioned peer left in node.peers, asked for weeks
        health.failed("did not answer (ServerTimeoutError)", now=100.0)
    assert health.skipped(100.0 + BACKOFF_MAX_S - 1) and not health.skipped(100.0 + BACKOFF_MAX_S + 1)

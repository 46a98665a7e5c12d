"""What a client is told of an engine's failure: the step and the cause, never where the engine listens."""

from __future__ import annotations

import pytest

from router.errors import for_clients


@pytest.mark.parametrize("text", [
    "cannot connect to http://127.0.0.1:38719 ([Errno 111] Connect call failed ('127.0.0.1', 38719))",
    "TLS with https://engine.internal:8443/v1 failed",
    "port 10.0.0.7:8000 answered",
    "[fd00::7]:8000 refused",
    "localhost:8001 refused",
])
def test_a_failure_told_to_a_client_names_no_engine_address(text):
    shown = for_clients(text)
    assert "<engine address>" in shown and not any(a in shown for a in ("127.0.0.1", "38719", "engine.internal", "10.0.0.7",
                                                                          "fd00", "localhost:8001")), shown
    assert for_clients("reload_weights failed: no answer within 600 s") == "reload_weights failed: no answer within 600 s"

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
    "Connect call failed ('::1', 8000, 0, 0)",
    "Cannot connect to host engine-a.internal:8443 ssl:default",
])
def test_a_failure_told_to_a_client_names_no_engine_address(text):
    shown = for_clients(text)
    assert "<engine address>" in shown and not any(a in shown for a in ("127.0.0.1", "38719", "engine.internal", "10.0.0.7",
                                                                          "fd00", "localhost:8001", "'::1'", "engine-a")), shown
    assert for_clients("reload_weights failed: no answer within 600 s") == "reload_weights failed: no answer within 600 s"
    assert for_clients("swap.drain_timeout_s=30 s ran out; HTTP 500: boom") == "swap.drain_timeout_s=30 s ran out; HTTP 500: boom"

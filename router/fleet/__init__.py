"""The fleet: what this node says to the others in front of and beside it — the card a front reads
in /v1/models (`card`), HAProxy's agent-check on `node.agent_port` (`Agent`). A front (HAProxy, an Inference Extension endpoint picker) or a peer node
reads these; nothing here proxies a request (that is `router.proxy`).

Imports nothing of `router.proxy`, `router.admin` or `router.cli` (tests/unit/test_layout.py).
"""

from router.fleet.agent import Agent
from router.fleet.node import card

__all__ = ["Agent", "card"]

"""The fleet: what this node says to the others in front of and beside it — the card a front reads
in /v1/models (`card`, and the `X-Hotswap-Node` of every answer), the vLLM series an Inference
Extension endpoint picker scrapes (`ModelServerMetrics`, GET /metrics/model-server), and what it asks
of its peers: the hand-off of a request for a model it does not serve, and the rest of a paused
answer where its model is awake (`Peers`, which the proxy's endpoint calls; `PeerFailed`). A front
(HAProxy, the endpoint picker) or a peer node reads these.

Imports nothing of `router.proxy`, `router.admin` or `router.cli` (tests/unit/test_layout.py).
"""

from router.fleet.agent import Agent
from router.fleet.model_server import MODEL_SERVER_KEY, ModelServerMetrics, serve_model_server
from router.fleet.node import card, names_its_answers
from router.fleet.peers import PEERS_KEY, PeerFailed, Peers

__all__ = ["Agent", "MODEL_SERVER_KEY", "ModelServerMetrics", "PEERS_KEY", "PeerFailed", "Peers", "card", "names_its_answers", "serve_model_server"]

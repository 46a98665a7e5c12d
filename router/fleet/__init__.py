"""The fleet: what this node says to the others in front of and beside it — the card a front reads
in /v1/models (`card`), and the vLLM series an Inference Extension endpoint picker scrapes
(`ModelServerMetrics`, GET /metrics/model-server). A front (HAProxy, the endpoint picker) or a peer
node reads these; nothing here proxies a request (that is `router.proxy`).

Imports nothing of `router.proxy`, `router.admin` or `router.cli` (tests/unit/test_layout.py).
"""

from router.fleet.model_server import MODEL_SERVER_KEY, ModelServerMetrics, serve_model_server
from router.fleet.node import card

__all__ = ["MODEL_SERVER_KEY", "ModelServerMetrics", "card", "serve_model_server"]

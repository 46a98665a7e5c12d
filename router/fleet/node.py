"""What a front (a load balancer in front of several hotswap nodes) reads about this node.

Every model card in /v1/models carries `node: {name, labels}`, so a front that lists models
across nodes can tell where each model lives and where it is already awake; /ready says when
the node is draining for shutdown. The contract is written out in docs/multi-node.md.
"""

from __future__ import annotations

import socket

from config.schema import Roster


def card(roster: Roster) -> dict:
    # The host name is the pod name in Kubernetes, so an unset name still tells nodes apart.
    return {"name": roster.node.name or socket.gethostname(), "labels": dict(roster.node.labels)}

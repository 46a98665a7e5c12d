"""What a front (a load balancer in front of several hotswap nodes) reads about this node.

Every model card in /v1/models carries `node: {name, labels}`, so a front that lists models
across nodes can tell where each model lives and where it is already awake; /ready says when
the node is draining for shutdown. The contract is written out in docs/multi-node.md.
"""

from __future__ import annotations

import socket
from typing import Callable

from config.schema import Roster
from router.auth import known_caller


def card(roster: Roster) -> dict:
    # The host name is the pod name in Kubernetes, so an unset name still tells nodes apart.
    return {"name": roster.node.name or socket.gethostname(), "labels": dict(roster.node.labels)}


NODE_HEADER = "X-Hotswap-Node"


def names_its_answers(roster_of: Callable[[], Roster]):
    """An on_response_prepare hook: every answer to a known caller (`router.auth.known_caller`) says which node
    gave it, unless a peer's answer relayed through this node already does (a front passes the header on, so a
    client can tell where it was served). A caller without a key (a 401, a probe) learns no node name."""

    named: list = [None, ""]  # the roster the name was read from, and the name: read once per roster, not per answer

    async def stamp(request, response) -> None:
        if known_caller(request):
            roster = roster_of()
            if roster is not named[0]:
                named[:] = [roster, card(roster)["name"]]
            response.headers.setdefault(NODE_HEADER, named[1])

    return stamp

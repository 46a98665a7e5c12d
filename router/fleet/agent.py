"""HAProxy's agent-check, answered from each model's state on this node (`node.agent_port`).

The front lists every node twice in a model's backend: a primary line that asks `"<model>\\n"` and a
`backup` line (`option allbackups`) that asks `"<model> backup\\n"`. HAProxy uses backup lines only
while no primary line is usable, so:

- primary: `ready` where the model is awake, `drain` where it is not (parked, waking, booting): while
  any node has it awake, requests go there and nowhere else wakes;
- backup: `ready NN%` wherever it could be woken, NN higher the cheaper the wake (this node's
  estimate, `router.scheduling.estimates`): with none awake, the cheapest wake takes the traffic;
- `down` for a model this node does not serve, or whose engine failed; `drain` on both lines while
  the node drains for shutdown. Neither is chosen.

HAProxy connects, sends one line, reads one reply line (words: `up`, `down`, `ready`, `drain`,
`NN%`, and `#` before a free-text description it shows in its stats) and closes. docs/multi-node.md.

With `node.agent_key` the line starts with it (`<key> <model>[ backup]`): the agent listens where any
client may reach it, and which names a node serves is for the front only. A line without the right
key is answered exactly as a name this node does not serve, so it tells the caller nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import TYPE_CHECKING, Optional

from engines.states import State

if TYPE_CHECKING:
    from router.live import Router

log = logging.getLogger("hotswap")

MAX_LINE = 512  # a model name and " backup"; anything longer is not HAProxy's agent
READ_TIMEOUT_S = 2.0  # HAProxy sends its line as soon as it connects
WAKEABLE = (State.COLD, State.BOOTING, State.DRAINING, State.SLEEPING, State.WAKING, State.VERIFYING)


NOT_SERVED = "down #not served on this node"


def keyed(key: Optional[str], line: str) -> Optional[list[str]]:
    """The line's words after the key (all of them without one), or None when the key is not the right one."""
    words = line.split()
    if key is None:
        return words
    if not words or not hmac.compare_digest(words[0].encode(), key.encode()):
        return None
    return words[1:]


def reply(router: "Router", line: str) -> str:
    """The agent's answer (without its newline) to one `agent-send` line."""
    key = router.roster.node.agent_key
    words = keyed(key, line)
    if words is None:
        return NOT_SERVED
    if not 1 <= len(words) <= 2 or (len(words) == 2 and words[1] != "backup"):
        first = "<key> <model>" if key else "<model>"
        return f"down #expected '{first}' or '{first} backup'"
    engine = router.by_name.get(words[0])
    if engine is None and words[0] in router.virtuals:  # the member a request for it would go to now
        engine = router.virtuals.pick(words[0], router.placement)
    if engine is None or engine.retiring:
        return NOT_SERVED
    if router.draining:
        return "drain #node draining for shutdown"
    if engine.state is State.FAILED:
        return "down #engine failed"
    if engine.state is State.AWAKE:
        return "up ready 100% #awake"
    if len(words) == 1:
        return f"up drain #{engine.state.value}"
    seconds = wake_estimate(router, engine.name, engine.state, engine.sleep_level)
    return f"up ready {wake_weight(seconds)}% #{engine.state.value}, wakes in ~{seconds:.1f} s"


def wake_estimate(router: "Router", name: str, state: State, level: Optional[int]) -> float:
    costs = router.placement.costs
    if state in (State.COLD, State.BOOTING):
        return costs.boot_s(name)
    return costs.wake_s(name, level)


def wake_weight(seconds: float) -> int:
    """1..100, halving by the time a wake takes 1 s: a 0.2 s wake outweighs a 10 s one 9 to 1."""
    return max(1, min(100, round(100 / (1 + max(seconds, 0.0)))))


class Agent:
    """The TCP server HAProxy's agent-check connects to; started and stopped with the router (`router.daemon`)."""

    def __init__(self, router: "Router", host: str, port: int) -> None:
        self.router, self.host, self.port = router, host, port
        self._server: Optional[asyncio.base_events.Server] = None
        self._refused_logged = False  # a front without the key asks every second: said once, until one has it

    async def start(self) -> None:
        """Raises OSError when the port cannot be bound."""
        self._server = await asyncio.start_server(self._answer, self.host, self.port, limit=MAX_LINE)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def _note_key(self, line: str, peer) -> None:
        if keyed(self.router.roster.node.agent_key, line) is not None:
            self._refused_logged = False
        elif not self._refused_logged:
            self._refused_logged = True
            log.warning("agent-check: a line from %s without the right node.agent_key, answered as an unknown name (is "
                        "HOTSWAP_AGENT_KEY in HAProxy's environment the roster's node.agent_key?)", peer)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), READ_TIMEOUT_S)
            except asyncio.IncompleteReadError as exc:  # the line without its newline, then EOF
                line = exc.partial
            except asyncio.LimitOverrunError:
                line = b""
            except asyncio.TimeoutError:
                return
            text = line.decode("utf-8", "replace")
            self._note_key(text, writer.get_extra_info("peername"))
            writer.write(reply(self.router, text).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (ConnectionError, asyncio.TimeoutError):
            pass  # the front went away; it asks again at its next agent-inter
        except Exception:  # noqa: BLE001 -- one bad answer must not take the agent down
            log.exception("agent-check: answering %s failed", writer.get_extra_info("peername"))
        finally:
            writer.close()

"""The model roster: schema, loading and validation. Depends on nothing else in hotswap."""

from pathlib import Path

from config.loader import Issue, RosterError, exposed_agent, load_roster, parse_roster
from config.schema import Gate, ModelSpec, Roster, RosterFile

EXAMPLES = Path(__file__).parent / "examples"
DEMO_ROSTER = EXAMPLES / "demo.yaml"

__all__ = ["DEMO_ROSTER", "EXAMPLES", "Gate", "Issue", "ModelSpec", "Roster", "RosterError", "RosterFile", "exposed_agent", "load_roster", "parse_roster"]

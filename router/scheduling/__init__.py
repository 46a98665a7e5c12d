"""Who is awake: the decision function and its loop (`scheduler`, waking ahead of demand in `ahead`), the actions that carry it out,
the shared state and leases (`state`), the placement ledger, wake-cost estimates, sizing,
roster-change decisions, backoff, and the last hour's history (`history`, for /admin/timeline and /ui). The rest of the router uses the names exported here.

Imports nothing of `router.proxy`, `router.admin` or `router.cli` (tests/unit/test_layout.py).
"""

from router.scheduling.estimates import Demand
from router.scheduling.history import KEEP_S as HISTORY_KEEP_S, Events, History, SwapRecord
from router.scheduling.placement import Capacity, devices_view, most_awake, never_fits
from router.scheduling.scheduler import Scheduler
from router.scheduling.sizing import Preview, Sleep, capacity, level1_weights, preview, simulated_roster
from router.scheduling.state import Decision, Lease, Plan, Waiter

__all__ = ["Capacity", "Decision", "Demand", "Events", "HISTORY_KEEP_S", "History", "Lease", "Plan", "Preview", "Scheduler",
           "Sleep", "SwapRecord", "Waiter", "capacity", "devices_view", "level1_weights", "most_awake", "never_fits", "preview",
           "simulated_roster"]

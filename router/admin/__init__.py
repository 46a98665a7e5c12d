"""Operators: the /admin/* handlers and /ui (`handlers`), the status serializer (`status`) that
`hotswap status`, /ui and scripts read, the /ui page (`ui`), hot reload (`reload`), LoRA
administration (`lora`), engine logs (`logs`: tail and follow), and the activity log (`activity`,
its SQLite file `activity_file`) that the proxy records each request in. The rest of the router
uses the names exported here.

Imports nothing of `router.cli` (tests/unit/test_layout.py).
"""

from router.admin.activity import ActivityLog
from router.admin.activity_file import ActivityFileError
from router.admin.handlers import (RELOADS_KEY, admin_action, admin_activity, admin_drill, admin_hold, admin_lora,
                                   admin_reload, admin_status,
                                   admin_timeline, status_page)
from router.admin.logs import FOLLOWERS_KEY as LOG_FOLLOWERS_KEY, LogFollowers, engine_log
from router.admin.reload import Reloads

__all__ = ["ActivityFileError", "ActivityLog", "LOG_FOLLOWERS_KEY", "LogFollowers", "RELOADS_KEY", "Reloads", "admin_action", "admin_activity",
           "admin_drill", "admin_hold",
           "admin_lora", "admin_reload", "admin_status", "admin_timeline", "engine_log", "status_page"]

"""`hotswap trial`: evidence on the operator's own hardware (issue 57). A client of a router, its own by
default (`own_router`): it drives each model through its rungs (`run`), reads the machine (`machine`), and
writes the report in a stable format (`report`)."""

from router.trial.run import Options, command_line, parse_levels, run

__all__ = ["Options", "command_line", "parse_levels", "run"]

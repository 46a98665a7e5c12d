"""`hotswap` command line: serve, check, schema, status, activity, reload."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

import yaml

from config import DEMO_ROSTER, Issue, Roster, RosterError, RosterFile, exposed_agent, load_roster
from config.virtual import scope_warnings
from engines.process import compose_argv

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_ROSTER = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for `cat` and friends cut off by `| head`

T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotswap",
        description="One OpenAI-compatible endpoint in front of several vLLM engines that share GPUs: "
        "routes by `model`, parks idle engines in vLLM sleep, wakes the one a request needs, "
        "and refuses to promote a woken engine whose speculative-decoding acceptance collapsed.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the router",
        description="Boot every engine in the roster (one group member at a time), record each "
        "engine's cold-boot baseline, then serve the OpenAI API. SIGTERM/SIGINT drain and stop.",
    )
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="ROSTER.yaml", help="the model roster")
    source.add_argument("--demo", action="store_true", help=f"the built-in demo roster ({DEMO_ROSTER.name}: simulated engines, no GPU)")
    serve.add_argument("--simulate", action="store_true",
                       help="a dry run without a GPU: every engine of the roster runs as the simulator (engines/sim), "
                       "with the roster's own shares, devices, levels and sizes")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port")
    serve.add_argument("--log-dir", type=Path, help="engine logs (default: $XDG_STATE_HOME/hotswap/logs)")

    check = commands.add_parser(
        "check",
        help="validate a roster and print it resolved",
        description="Validate a roster. Prints the resolved roster (defaults applied, secrets masked) "
        "and exits 0, or prints every error as file:line:col: field: message and exits 2. "
        "Warnings (an engine program not on PATH) go to stderr and leave the exit code 0.",
    )
    check.add_argument("--config", metavar="ROSTER.yaml", required=True)

    commands.add_parser(
        "schema",
        help="print the roster's JSON Schema",
        description="Print the roster's JSON Schema, for editor completion and validation.",
    )

    # What every command that calls a running router's admin API takes.
    a_router = argparse.ArgumentParser(add_help=False)
    a_router.add_argument("--url", default="http://127.0.0.1:8080", help="the router (default %(default)s)")
    a_router.add_argument("--admin-key", help="admin key (default: $HOTSWAP_ADMIN_KEY)")

    commands.add_parser(
        "status",
        parents=[a_router],
        help="show a running router's engines",
        description="Print a running router's groups, engines, states, queues and last swaps.",
    )

    activity = commands.add_parser(
        "activity",
        parents=[a_router],
        help="show a running router's recent requests",
        description="Print a running router's activity log (GET /admin/activity): one line per proxied request, "
        "oldest first: key name, model, engine, status, how it got its engine (awake at once, or the swap it "
        "waited for), queue wait, first byte, total, tokens and acceptance. --follow prints new ones until Ctrl-C.",
    )
    activity.add_argument("--model", help="only requests for this model (as asked, or the engine that served)")
    activity.add_argument("--limit", type=int, default=20, help="how many of the newest to show first (default %(default)s)")
    activity.add_argument("--follow", action="store_true", help="keep printing new requests until Ctrl-C")

    commands.add_parser(
        "reload",
        parents=[a_router],
        help="make a running router re-read its roster",
        description="Ask a running router to re-read its --config file (as SIGHUP does). Prints what changed "
        "and exits 0; if the file is invalid, prints every error as file:line:col: field: message, changes "
        "nothing and exits 2; exits 1 when the router cannot be reached or refuses.",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _writing_stdout(build_parser().parse_args, argv)  # --help prints
    if args.command == "serve":
        return cmd_serve(args)  # logs to stderr: a broken pipe in there is a real error, not a reader gone
    handler = {"check": cmd_check, "schema": cmd_schema, "status": cmd_status, "activity": cmd_activity,
               "reload": cmd_reload}[args.command]
    return _writing_stdout(handler, args)


def _writing_stdout(command: Callable[..., T], *args: Any) -> T:
    """Run a command that prints to stdout. When the reader goes away (`hotswap schema | head -1`)
    it ends quietly with exit 141, as a Unix tool killed by SIGPIPE does, not with a traceback."""
    try:
        try:
            return command(*args)
        finally:
            sys.stdout.flush()  # here, not at exit, where a broken pipe is past catching
    except BrokenPipeError:
        # Python flushes stdout once more at exit: give that flush nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise SystemExit(EXIT_BROKEN_PIPE) from None


def _load(path: str) -> Optional[Roster]:
    try:
        return load_roster(path)
    except RosterError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        noun = "error" if len(exc.issues) == 1 else "errors"
        print(f"{path}: {len(exc.issues)} {noun}; nothing was started", file=sys.stderr)
        return None


def cmd_check(args: argparse.Namespace) -> int:
    roster = _load(args.config)
    if roster is None:
        return EXIT_BAD_ROSTER
    yaml.safe_dump(roster.redacted(), sys.stdout, sort_keys=False)
    sys.stdout.flush()  # the roster, then the warnings, also when both go to one file
    warnings = check_warnings(roster)
    for warning in warnings:
        print(warning, file=sys.stderr)
    if warnings:
        noun = "warning" if len(warnings) == 1 else "warnings"
        print(f"{args.config}: {len(warnings)} {noun}; the roster is valid", file=sys.stderr)
    return EXIT_OK


def check_warnings(roster: Roster) -> list[Issue]:
    """What is valid but will not work here, or not as written: a managed engine's program (launcher[0] or
    command[0]) that is not on PATH; a key's glob that matches a virtual model but not all its members
    (`config.virtual.scope_warnings`). One warning per place in the file, so a launcher set in
    `defaults` is reported once."""
    found: dict[tuple[str, int, int], Issue] = {}
    for i, model in enumerate(roster.models):
        if not model.managed:
            continue
        key = "command" if model.command is not None else "launcher"
        program = compose_argv(model, 0)[0]  # placeholders filled; python/python3 are the router's own
        if shutil.which(program) is not None:
            continue
        written = (model.command or model.launcher)[0]
        field, _, _ = roster.locate(("models", i, key)) or (f"models[{i}].{key}", 1, 1)
        _, line, col = roster.locate(("models", i, key, 0)) or ("", 1, 1)
        if os.sep in program:
            message = f"{written!r} is not an executable file"
        else:
            what = "vLLM" if program == "vllm" else "it"
            message = f"{written!r} is not on PATH (install {what} in this environment, or set {key} to its full path)"
        found.setdefault((field, line, col), Issue(roster.source, line, col, field, message))
    issues = list(found.values())
    names_of = {name: m.names for m in roster.models for name in m.names}
    for path, message in scope_warnings(roster.auth.keys, roster.virtual_models, names_of):
        field, line, col = roster.locate(path) or (".".join(map(str, path)), 1, 1)
        issues.append(Issue(roster.source, line, col, field, message))
    return sorted(issues)


def cmd_schema(args: argparse.Namespace) -> int:
    json.dump(RosterFile.model_json_schema(), sys.stdout, indent=2)
    print()
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    roster = _load(str(DEMO_ROSTER) if args.demo else args.config)
    if roster is None:
        return EXIT_BAD_ROSTER
    problem = exposed_agent(args.host, roster.node) if args.host else None
    if problem:  # the roster was checked against its own listen.host
        print(f"{roster.source}: node.agent_port: with --host {problem}", file=sys.stderr)
        return EXIT_BAD_ROSTER
    from router.daemon import run  # imported late: `check` and `schema` need no event loop

    return run(roster, host=args.host, port=args.port, log_dir=args.log_dir, simulate=args.simulate)


def cmd_status(args: argparse.Namespace) -> int:
    from router.cli.status import show

    return show(args.url, args.admin_key)


def cmd_activity(args: argparse.Namespace) -> int:
    from router.cli.activity import show

    return show(args.url, args.admin_key, args.model, args.limit, args.follow)


def cmd_reload(args: argparse.Namespace) -> int:
    from router.cli.reload import reload

    return reload(args.url, args.admin_key)


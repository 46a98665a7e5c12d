"""`hotswap` command line: serve, check, schema, status, activity, reload, trial."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

from config import DEMO_ROSTER, Roster, RosterError, RosterFile, exposed_agent, load_roster
from router.cli.admin_api import KEY_ENV
from router.cli.where import DEFAULT_URL, URL_ENV, NoRouterURL, router_url

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
        help="validate a roster and tell what serve will do with it",
        description="Validate a roster, and tell what `serve` will do with it. Prints every error as "
        "file:line:col: field: message and exits 2; else prints the resolved roster (defaults applied, secrets "
        "masked) and exits 0; the roster ends in YAML comments giving the placement per GPU (who can be awake "
        "together, who takes turns) and the level each model would sleep at under the host-RAM budget. Warnings go "
        "to stderr and leave the exit code 0: what serve would warn of (a checkpoint it cannot size), and what will "
        "not run here (an engine program not on PATH).",
    )
    check.add_argument("--config", metavar="ROSTER.yaml", required=True)

    commands.add_parser(
        "schema",
        help="print the roster's JSON Schema",
        description="Print the roster's JSON Schema, for editor completion and validation.",
    )

    # What every command that calls a running router's admin API takes.
    a_router = argparse.ArgumentParser(add_help=False)
    where = a_router.add_mutually_exclusive_group()
    where.add_argument("--url", help=f"the router (default: ${URL_ENV}, else {DEFAULT_URL})")
    where.add_argument("--config", metavar="ROSTER.yaml", help="the router serving this roster: the URL of its listen:")
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
    trial = commands.add_parser(
        "trial",
        help="measure every sleep and wake of the roster's models on this machine, and report",
        description="For each model: its cold boot and baseline, then --cycles rounds through every rung it may use "
        "(KV park, Level 1 within the host budget, Level 2 where it can reload): each sleep's and wake phase's time, the "
        "GPU memory freed and taken back, the host RAM held, the gate's verdict and a generation timed against the cold "
        "baseline; --drill adds one Level-2 wake without the draft reload (vLLM #52479) for the gate to refuse. Runs on a "
        "router of its own on loopback (stopped at the end) unless --url names a running one. Prints a table, writes "
        "--report (Markdown) and --json; exits 1 when a wake was refused, acceptance collapsed (the drill's aside) or a "
        "step failed (docs/operators.md, \"Trying it on your GPU\").",
    )
    trial.add_argument("--url", help="a running router that serves this roster (default: start one of the trial's own on "
                       "a free loopback port, and stop it at the end)")
    trial.add_argument("--admin-key", help="admin key (default: $HOTSWAP_ADMIN_KEY, else the roster's)")
    trial.add_argument("--config", metavar="ROSTER.yaml", required=True, help="the roster (with --url: the one that router runs)")
    trial.add_argument("--models", help="comma-separated model names (default: every model in the roster)")
    trial.add_argument("--cycles", type=int, default=2, help="rounds through the rungs per model (default %(default)s)")
    trial.add_argument("--levels", default="kv,1,2", help="the rungs to drive, of kv, 1, 2 (default %(default)s)")
    trial.add_argument("--drill", action="store_true", help="one Level-2 wake without the draft reload, for the gate to refuse")
    trial.add_argument("--tokens", type=int, default=64, help="tokens of each timed generation (default %(default)s)")
    trial.add_argument("--api-key", help="client key for the generations (default: from the roster's auth)")
    trial.add_argument("--report", type=Path, metavar="trial.md", help="write the Markdown report here")
    trial.add_argument("--json", type=Path, metavar="trial.json", help="write the JSON report here")
    trial.add_argument("--log-dir", type=Path, help="the trial router's log and its engines' logs (default: a temporary folder)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _writing_stdout(build_parser().parse_args, argv)  # --help prints
    if args.command == "serve":
        return cmd_serve(args)  # logs to stderr: a broken pipe in there is a real error, not a reader gone
    handler = {"check": cmd_check, "schema": cmd_schema, "status": cmd_status, "activity": cmd_activity,
               "reload": cmd_reload, "trial": cmd_trial}[args.command]
    if args.command in ("status", "activity", "reload"):  # a client of a running router: which one
        try:
            args.url = router_url(args.url, args.config)
        except NoRouterURL as exc:
            print(f"hotswap {args.command}: {exc}", file=sys.stderr)
            return EXIT_BAD_ROSTER
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
    from router.cli.check import cmd_check as check  # imported late: it reads the scheduler's code, serve's too

    return check(args, roster)


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



def cmd_trial(args: argparse.Namespace) -> int:
    from router import trial

    try:
        levels = trial.parse_levels(args.levels)
    except ValueError as exc:
        print(f"hotswap trial: --levels: {exc}", file=sys.stderr)
        return EXIT_BAD_ROSTER
    if args.cycles < 1 or args.tokens < 1:
        print("hotswap trial: --cycles and --tokens must be at least 1", file=sys.stderr)
        return EXIT_BAD_ROSTER
    roster = _load(args.config)
    if roster is None:
        return EXIT_BAD_ROSTER
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    unknown = [m for m in models or [] if m not in {spec.name for spec in roster.models}]
    if unknown:
        print(f"hotswap trial: --models: not in {args.config}: {', '.join(unknown)} (its models: "
              f"{', '.join(spec.name for spec in roster.models)})", file=sys.stderr)
        return EXIT_BAD_ROSTER
    return trial.run(trial.Options(
        roster=roster, config=args.config, models=models, cycles=args.cycles, levels=levels, drill=args.drill,
        report=args.report, json=args.json, url=args.url, admin_key=args.admin_key or os.environ.get(KEY_ENV), api_key=args.api_key, tokens=args.tokens,
        log_dir=args.log_dir, command=trial.command_line(sys.argv[1:])))

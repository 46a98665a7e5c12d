"""Which router `hotswap status`, `activity` and `reload` ask, and what they say when nothing answers there."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from router.cli.where import NoRouterURL, router_url

REPO = Path(__file__).resolve().parents[2]


def roster(tmp_path: Path, listen: str) -> str:
    path = tmp_path / "roster.yaml"
    path.write_text(f"{listen}models: [{{name: a, model: /m/a}}]\n")
    return str(path)


def test_the_router_is_named_by_url_else_by_the_rosters_listen_else_by_hotswap_url_else_the_default(tmp_path):
    env = {"HOTSWAP_URL": "http://gpu-box:9000"}
    assert (router_url("http://r:1", None, env), router_url("http://r:1", None, env).origin) == ("http://r:1", "from --url")
    on_all = roster(tmp_path, "listen: {host: 0.0.0.0, port: 8181}\n")
    assert router_url(None, on_all, env) == "http://127.0.0.1:8181", "bound to every address: reached over loopback"
    assert router_url(None, on_all, env).origin == f"from listen: in {on_all}"
    assert router_url(None, roster(tmp_path, "listen: {host: '::', port: 8182}\n"), env) == "http://[::1]:8182"
    assert router_url(None, roster(tmp_path, "listen: {host: 10.0.0.7}\n"), env) == "http://10.0.0.7:8080"
    assert router_url(None, None, env) == "http://gpu-box:9000" and router_url(None, None, env).origin == "from $HOTSWAP_URL"
    assert (router_url(None, None, {}), router_url(None, None, {}).origin) == ("http://127.0.0.1:8080", "the default")


def test_only_listen_is_read_so_a_secret_unset_in_this_shell_does_not_stop_status(tmp_path):
    path = roster(tmp_path, "listen: {port: 8183}\nauth: {admin_key: '${NOT_SET_HERE}'}\n")
    assert router_url(None, path, {}) == "http://127.0.0.1:8183"


def test_a_roster_whose_listen_cannot_be_read_is_said_with_where(tmp_path):
    with pytest.raises(NoRouterURL, match=r"roster.yaml: listen.port: Input should be less than or equal to 65535"):
        router_url(None, roster(tmp_path, "listen: {port: 99999}\n"), {})
    with pytest.raises(NoRouterURL, match=r"/nowhere.yaml:1:1: roster: cannot read file"):
        router_url(None, "/nowhere.yaml", {})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


@pytest.mark.parametrize("command", ["status", "activity", "reload"])
def test_a_refused_connection_says_which_url_was_tried_where_it_came_from_and_how_to_name_another(command, tmp_path):
    port = closed_port()
    run = subprocess.run([sys.executable, "-m", "router.cli", command], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "HOTSWAP_URL": f"http://127.0.0.1:{port}"})
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == (f"hotswap {command}: cannot reach a router at http://127.0.0.1:{port} (from $HOTSWAP_URL): nothing "
                          "listens there (connection refused). Is the router running there? To ask another, name it with "
                          "--url URL, HOTSWAP_URL=URL, or --config ROSTER.yaml (its listen:)\n")


def test_status_with_a_roster_it_cannot_read_exits_2_naming_the_file(tmp_path):
    run = subprocess.run([sys.executable, "-m", "router.cli", "status", "--config", str(tmp_path / "gone.yaml")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.startswith(f"hotswap status: {tmp_path}/gone.yaml:1:1: roster: cannot read file")

"""`hotswap reload`: ask a running router to re-read its roster; print what changed, or every error."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Optional

from router.cli.admin_api import admin_request, refusal
from router.cli.where import unreachable

EXIT_OK, EXIT_FAILED, EXIT_BAD_ROSTER = 0, 1, 2
TIMEOUT_S = 60  # validation reads the file and sizes new models' checkpoints; applying is instant


def reload(url: str, admin_key: Optional[str]) -> int:
    request = admin_request(url, "/admin/reload", admin_key, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        refused = refusal("reload", url, exc.code, admin_key)
        if refused:
            print(refused, file=sys.stderr)
            return EXIT_FAILED
        text = exc.read().decode(errors="replace")
        try:
            body = json.loads(text)
        except ValueError:
            body = {}
        if exc.code == 422 and "errors" in body:
            for error in body["errors"]:
                print(error, file=sys.stderr)
            print(f"hotswap reload: {len(body['errors'])} error(s); nothing changed, the router serves the roster it had",
                  file=sys.stderr)
            return EXIT_BAD_ROSTER
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else None
        print(f"hotswap reload: {url} answered {exc.code}: {message or text[:300]}", file=sys.stderr)
        return EXIT_FAILED
    except (urllib.error.URLError, OSError) as exc:
        print(unreachable("reload", url, getattr(exc, "reason", exc)), file=sys.stderr)
        return EXIT_FAILED
    for line in answer["summary"]:
        print(line)
    print(f"applied {answer['source']}")
    return EXIT_OK

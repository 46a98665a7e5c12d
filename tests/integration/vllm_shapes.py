"""Check answers against vLLM's own protocol classes. Run with the vLLM venv's python:

    $HOTSWAP_VLLM_VENV/bin/python tests/integration/vllm_shapes.py < cases.json

Each case is {"name", "cls", "answer", "exact"}: `cls` is `module:Name` under
vllm.entrypoints, or a full `vllm.` or `openai.types` module path (a TypeAlias of a union works too). The answer must validate; with
`exact`, its keys (recursively) must also be exactly those vLLM itself serializes for that
class, so a field the simulator forgot or invented fails. Prints one JSON line per case.
"""

from __future__ import annotations

import importlib
import json
import sys

from pydantic import BaseModel, TypeAdapter


def keys(value, path="$"):
    """The set of key paths in a JSON value (list elements merged)."""
    out = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(f"{path}.{k}")
            out |= keys(v, f"{path}.{k}")
    elif isinstance(value, list):
        for v in value:
            out |= keys(v, f"{path}[]")
    return out


def main() -> int:
    failed = 0
    for case in json.load(sys.stdin):
        module, _, name = case["cls"].partition(":")
        if not module.startswith(("vllm.", "openai.types")):
            module = "vllm.entrypoints." + module
        cls = getattr(importlib.import_module(module), name)
        result = {"name": case["name"]}
        try:
            if isinstance(cls, type) and issubclass(cls, BaseModel):
                obj = cls.model_validate(case["answer"])
                dumped = obj.model_dump(mode="json", by_alias=True, **case.get("dump", {}))
            else:
                obj = TypeAdapter(cls).validate_python(case["answer"])
                dumped = obj.model_dump(mode="json", by_alias=True, **case.get("dump", {}))
            if case.get("exact"):
                got, want = keys(case["answer"]), keys(dumped)
                if got != want:
                    result["missing"] = sorted(want - got)
                    result["extra"] = sorted(got - want)
        except Exception as exc:  # report every case, not the first failure
            result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["ok"] = not any(k in result for k in ("error", "missing", "extra"))
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Two real `vllm serve` engines on CPU that fit together, booted once for two scenarios (each boot is
a minute of CI's time on 2 cores):

- placement by memory: config/examples/vllm-cpu.yaml's two models, each given
  `--gpu-memory-utilization 0.4`, are awake at the same time, and requests alternating between them
  never park either (the CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE and ignores the
  share; the router's arithmetic is what is under test: 0.4 + 0.4 fits in one device);
- roster hot reload: a changed engine is restarted from its new entry (a new process, a new cold-boot
  baseline) while requests for the other one, through an alias the same reload added, keep being
  answered; a removed engine's process is stopped.

Each engine gets its own core: left to vLLM's automatic binding, both engines' OMP threads took core 0,
and the restarted one, booting beside the one serving, did not come up within 7 minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.integration.harness import BOOT_TIMEOUT_S, REPORT, http, poll
from tests.integration.live_router import LiveRouter
from tests.support import pid_alive

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "examples" / "vllm-cpu.yaml"
PROMPT = "The router wakes the model and"


def roster() -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["swap"].update(min_active_s=0, boot_timeout_s=BOOT_TIMEOUT_S)
    for model in data["models"]:
        model["args"] = ["--gpu-memory-utilization", "0.4"]
        model["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return data


@pytest.fixture(scope="module")
def router(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    with LiveRouter.booted(roster(), tmp_path_factory.mktemp("two-awake"), timeout=3 * BOOT_TIMEOUT_S) as live:
        yield live


def reload(router: LiveRouter, data: dict[str, Any]) -> dict[str, Any]:
    router.proc.roster_path.write_text(yaml.safe_dump(data))
    code, body = http("POST", router.url + "/admin/reload", timeout=120)
    assert code == 200, (code, body)
    return body


def test_two_real_engines_that_fit_together_are_both_awake_and_alternating_requests_never_park_either(router: LiveRouter):
    names = [m["name"] for m in roster()["models"]]
    assert sorted(router.awake()) == sorted(names), "both booted and both stayed awake: 0.4 + 0.4 fits"
    client = router.client()
    answers: dict[str, set[str]] = {name: set() for name in names}
    for name in names * 5:
        answer = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert answer.model == name and answer.usage.completion_tokens == 8
        answers[name].add(answer.choices[0].text)
    assert all(len(texts) == 1 for texts in answers.values()), f"temperature 0 answers the same each time: {answers}"
    status = router.status()
    assert status["swaps"] == [] and sorted(router.awake()) == sorted(names)
    values = router.metrics()
    sleeps = sum(router.metric(values, "hotswap_swap_phase_duration_seconds_count", model=n, group="", phase="sleep")
                 for n in names)
    evictions = sum(v for (metric, _), v in values.items() if metric == "hotswap_evictions_total")
    assert sleeps == 0 and evictions == 0, (sleeps, evictions)
    for name in names:  # and vLLM itself was never asked to sleep
        assert not any("POST /sleep" in line for line in router.log_since(name, 0)), name
    REPORT["placement_two_awake"] = {"requests": 10, "sleeps": 0,
                                     "gpu0_planned": status["placement"]["devices"][0]["planned"]}


def test_a_changed_real_engine_restarts_with_a_new_baseline_while_the_other_serves_on(router: LiveRouter):
    before = router.engines(router.status())
    changed = roster()
    changed["models"][0]["aliases"] = ["tiny"]
    changed["models"][1]["args"] += ["--max-num-seqs", "8"]
    body = reload(router, changed)
    assert body["changes"]["restarting"] == {"tiny-plain": ["args"]}
    assert body["changes"]["changed_in_place"] == {"tiny-spec": ["aliases"]}

    client = router.client()
    answered, failed = 0, []

    def restarted() -> bool:
        nonlocal answered
        try:  # (poll retries on exceptions: a failed request must be counted here, not retried away)
            answer = client.completions.create(model="tiny", prompt="The router", max_tokens=4, temperature=0)
            assert answer.usage.completion_tokens == 4  # served by tiny-spec, through the alias added in place
            answered += 1
        except Exception as exc:
            failed.append(repr(exc))
        plain = router.engine("tiny-plain")
        return plain["pid"] not in (None, before["tiny-plain"]["pid"]) and plain["state"] == "awake" \
            and not plain["roster_change_pending"]

    poll(restarted, 3 * BOOT_TIMEOUT_S, "tiny-plain restarted from its new entry", interval=0.2)
    assert failed == [] and answered > 0
    after = router.engines(router.status())
    assert after["tiny-spec"]["pid"] == before["tiny-spec"]["pid"], "the engine changed in place kept its process"
    assert after["tiny-plain"]["verdicts"][0]["result"] == "baseline"
    assert not pid_alive(before["tiny-plain"]["pid"])
    assert "max_num_seqs" in "\n".join(router.log_since("tiny-plain", 0)), "vLLM started with the new flag"
    assert client.completions.create(model="tiny-plain", prompt="The router", max_tokens=4).usage.completion_tokens == 4

    body = reload(router, {**changed, "models": changed["models"][:1]})
    assert body["changes"]["removed"] == ["tiny-plain"]
    poll(lambda: "tiny-plain" not in router.engines(router.status()), 120, "tiny-plain stopped and removed", interval=0.2)
    assert not pid_alive(after["tiny-plain"]["pid"])
    assert client.completions.create(model="tiny", prompt="The router", max_tokens=4).usage.completion_tokens == 4
    REPORT["reload_restart"] = {"requests_during_restart": answered, "failed": len(failed)}

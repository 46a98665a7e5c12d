"""The worker extension against one real `vllm serve` on CPU (the tiny target as its own draft).

What this proves, on real vLLM: the Level-2 draft loss is silent (text unchanged,
acceptance 3.0 -> 1.0), vLLM's own target-only `reload_weights` does not repair it, and
`hotswap_reload_draft` does (digest back to the checkpoint's, acceptance 3.0). The second
test walks the router's staged Level-2 wake through the real dev endpoints, recording
their answers. On CPU sleep is bookkeeping only, so `hotswap_discard_draft` stands in for
what Level-2 sleep does to the draft on GPU. The third proves the stand-in for a numerically
wrong wake (`hotswap_perturb_target`): canary tokens and acceptance identical, logprobs moved,
target digest changed, and scale 1.0 puts it all back.
"""

from __future__ import annotations

import pytest

from engines.vllm_worker.page_cache import drop
from tests.integration.harness import REPORT, Background, VllmServer, http, metric_samples, poll

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = "The router wakes the model and"
K = 2  # num_speculative_tokens
FULL = 1.0 + K  # the target drafting for itself accepts everything at temperature 0


def ensure_healthy_draft(engine: VllmServer) -> str:
    """Start each test from a draft that matches its checkpoint; returns its digest."""
    (result,), _ = engine.rpc("hotswap_reload_draft")
    assert result["reloaded"] is True, result
    (digest,), _ = engine.rpc("hotswap_draft_digest")
    return digest


def tokens(completion: dict) -> tuple[str, list[int]]:
    choice = completion["choices"][0]
    return choice["text"], choice.get("token_ids") or []


def test_discard_then_target_reload_then_draft_reload(spec_engine: VllmServer) -> None:
    engine = spec_engine
    report = REPORT.setdefault("draft_cycle", {})

    (digest0,), t = engine.rpc("hotswap_draft_digest")
    assert isinstance(digest0, str) and len(digest0) == 64
    (again,), _ = engine.rpc("hotswap_draft_digest")
    assert again == digest0, "the digest must be deterministic"
    report["digest_rpc_s"] = round(t, 4)

    mal, baseline = engine.canary(PROMPT)
    text0, ids0 = tokens(baseline)
    assert len(ids0) == 32
    assert mal == pytest.approx(FULL), f"baseline MAL {mal}"
    report["mal_baseline"] = mal

    # The stand-in for the Level-2 loss: the draft's private weights are gone.
    (discarded,), t = engine.rpc("hotswap_discard_draft")
    assert discarded["discarded"] is True and discarded["tensors"] > 0, discarded
    report["discard"] = {**discarded, "rpc_s": round(t, 4)}
    (digest_broken,), _ = engine.rpc("hotswap_draft_digest")
    assert digest_broken != digest0
    mal, after = engine.canary(PROMPT)
    assert mal == pytest.approx(1.0), f"MAL after discard {mal}"
    assert tokens(after) == (text0, ids0), "verification keeps the output exact: the loss is silent"
    report["mal_after_discard"] = mal

    # vLLM's documented reload restores the target only: the draft stays broken.
    (target_only,), t = engine.rpc("reload_weights")
    assert target_only is None
    report["reload_weights_rpc_s"] = round(t, 4)
    (digest,), _ = engine.rpc("hotswap_draft_digest")
    assert digest == digest_broken, "reload_weights must not have touched the draft"
    mal, after = engine.canary(PROMPT)
    assert mal == pytest.approx(1.0), f"MAL after target-only reload {mal}"
    assert tokens(after) == (text0, ids0)
    report["mal_after_target_reload"] = mal

    # The extension's draft reload repairs it, bit for bit.
    (reloaded,), t = engine.rpc("hotswap_reload_draft")
    assert reloaded["reloaded"] is True and reloaded["tensors"] > 0, reloaded
    report["reload_draft"] = {**reloaded, "rpc_s": round(t, 4)}
    (digest,), _ = engine.rpc("hotswap_draft_digest")
    assert digest == digest0, "the reloaded draft must match its checkpoint as the kernels see it"
    mal, after = engine.canary(PROMPT)
    assert mal == pytest.approx(FULL), f"MAL after draft reload {mal}"
    assert tokens(after) == (text0, ids0)
    report["mal_after_draft_reload"] = mal


def test_staged_level2_wake_through_the_dev_endpoints(spec_engine: VllmServer) -> None:
    """The router's Level-2 wake, step by step, against the real endpoints (answers recorded)."""
    engine = spec_engine
    url = engine.url
    answers = REPORT.setdefault("dev_endpoints", {})

    def call(method: str, path: str, body: object = None) -> object:
        status, answer = http(method, url + path, body)
        answers[f"{len(answers) + 1:02d} {method} {path}"] = {"status": status, "body": answer}
        assert status == 200, f"{method} {path} -> {status} {answer}"
        return answer

    digest0 = ensure_healthy_draft(engine)
    mal, baseline = engine.canary(PROMPT)
    assert mal == pytest.approx(FULL)

    assert call("POST", "/sleep?level=2&mode=wait") == {"status": "sleeping", "level": 2}
    assert call("GET", "/is_sleeping") == {"is_sleeping": True}
    answers[f"{len(answers) + 1:02d} engine_sleep_state"] = metric_samples(url, "vllm:engine_sleep_state")
    engine.rpc("hotswap_discard_draft")  # what Level 2 does to the draft on GPU

    # A generation sent to a sleeping engine is accepted and hangs: it must not finish
    # before the kv_cache wake (a bounded negative check, not a wait for something).
    pending = Background(lambda: engine.complete(PROMPT, timeout=300))
    pending.thread.join(1.0)
    assert not pending.done(), f"a request finished on a sleeping engine: {pending.result or pending.error}"

    assert call("POST", "/wake_up?tags=weights") == {"status": "sleeping", "tags": ["weights"]}
    (restored,), t = engine.rpc("hotswap_reload_draft")  # step 2: draft first ...
    assert restored["reloaded"] is True, restored
    answers[f"{len(answers) + 1:02d} hotswap_reload_draft"] = {**restored, "rpc_s": round(t, 4)}
    assert call("POST", "/collective_rpc", {"method": "reload_weights"}) == {"results": [None]}  # ... target last
    assert not pending.done(), "the request must still wait for the kv_cache wake"

    assert call("POST", "/wake_up?tags=kv_cache") == {"status": "awake", "tags": ["kv_cache"]}
    poll(pending.done, 60, "the request held while asleep to finish after the kv_cache wake")
    assert pending.error is None, pending.error
    assert tokens(pending.result) == tokens(baseline)
    assert call("GET", "/is_sleeping") == {"is_sleeping": False}
    answer = poll(lambda: (lambda a: a if a.get("success") else None)(call("POST", "/reset_prefix_cache")),
                  30, "reset_prefix_cache to succeed")
    assert answer == {"success": True}
    answers[f"{len(answers) + 1:02d} engine_sleep_state"] = metric_samples(url, "vllm:engine_sleep_state")

    (digest,), _ = engine.rpc("hotswap_draft_digest")
    assert digest == digest0
    mal, after = engine.canary(PROMPT)
    assert mal == pytest.approx(FULL), f"MAL after the staged wake {mal}"
    assert tokens(after) == tokens(baseline)
    REPORT["mal_after_staged_wake"] = mal


def canary_logprobs(engine: VllmServer, prompt: str = PROMPT, max_tokens: int = 64) -> tuple[list[int], list[float]]:
    """The gate's canary with `"logprobs": 0`: the sampled tokens and their logprobs."""
    status, body = http(
        "POST", engine.url + "/v1/completions",
        {"model": engine.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
         "logprobs": 0, "return_token_ids": True},
    )
    assert status == 200, f"completion -> {status} {body}"
    choice = body["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_perturb_target_moves_logprobs_not_tokens(spec_engine: VllmServer) -> None:
    """The stand-in for a numerically wrong wake: tokens and acceptance identical, logprobs moved, digest changed."""
    engine = spec_engine
    report = REPORT.setdefault("perturb_target", {})
    ensure_healthy_draft(engine)
    (digest0,), _ = engine.rpc("hotswap_target_digest")
    assert isinstance(digest0, str) and len(digest0) == 64
    http("POST", engine.url + "/reset_prefix_cache")
    ids0, lp0 = canary_logprobs(engine)
    assert len(ids0) == len(lp0) == 64

    (perturbed,), t = engine.rpc("hotswap_perturb_target", "1.1")
    assert perturbed["perturbed"] == "model.norm.weight" and perturbed["scale"] == 1.1, perturbed
    assert perturbed["digest_before"] == digest0 and perturbed["digest_after"] != digest0, perturbed
    assert perturbed["restored"] is False
    (digest,), _ = engine.rpc("hotswap_target_digest")
    assert digest == perturbed["digest_after"]
    (again,), _ = engine.rpc("hotswap_perturb_target", "1.1")
    assert again["digest_after"] == digest, "the scale is relative to the checkpoint, not cumulative"
    report["rpc_s"] = round(t, 4)

    http("POST", engine.url + "/reset_prefix_cache")
    ids1, lp1 = canary_logprobs(engine)
    assert ids1 == ids0, "scaling every logit keeps the argmax: the greedy tokens must not change"
    drift = sum(abs(a - b) for a, b in zip(lp0, lp1)) / len(lp0)
    assert drift > 0.01, f"the logprobs must move (mean drift {drift})"
    mal, _ = engine.canary(PROMPT)
    assert mal == pytest.approx(FULL), f"acceptance must not change: MAL {mal}"
    report["drift_at_1.1"] = round(drift, 4)

    (restored,), _ = engine.rpc("hotswap_perturb_target", "1.0")
    assert restored["restored"] is True and restored["digest_after"] == digest0, restored
    http("POST", engine.url + "/reset_prefix_cache")
    ids2, lp2 = canary_logprobs(engine)
    assert (ids2, lp2) == (ids0, lp0), "scale 1.0 restores the checkpoint bit for bit"


def test_the_host_memory_rpcs_answer_on_cpu_and_say_why_they_have_nothing_to_report(spec_engine: VllmServer) -> None:
    """On CPU there is no pinned host allocator (no CUDA): the report and the release answer "not
    available", with a reason, through a Level-1 sleep and wake, and the router then reads /proc."""
    engine = spec_engine
    report = REPORT.setdefault("host_memory", {})
    status, answer = http("POST", engine.url + "/sleep?level=1&mode=wait")
    assert status == 200, answer
    (asleep,), _ = engine.rpc("hotswap_host_memory")
    status, answer = http("POST", engine.url + "/wake_up")
    assert status == 200, answer
    (released,), t = engine.rpc("hotswap_empty_host_cache")
    report.update(asleep=asleep, released=released, release_rpc_s=round(t, 4))
    for result in (asleep, released):
        assert result["available"] is False and "no CUDA" in result["reason"], result
    mal, _ = engine.canary(PROMPT)
    assert mal == pytest.approx(FULL), "the engine serves on after the calls"


def test_the_stage_reads_the_files_vllms_loader_reads_into_the_page_cache(spec_engine: VllmServer, tiny_models) -> None:
    import os

    engine = spec_engine
    files = sorted(str(p) for p in (tiny_models / "target").glob("*.safetensors"))
    (found,), _ = engine.rpc("hotswap_weights_residency")
    assert sorted(found["files"]) == files, "the target's weight files, as vLLM's loader lists them (the draft is the same)"

    def dropped() -> bool:
        for path in files:
            drop(path)
        return engine.rpc("hotswap_weights_residency")[0][0]["resident"] < 0.5

    poll(dropped, 30, "the checkpoint's pages dropped", interval=0.2)
    (look,), _ = engine.rpc("hotswap_stage_weights", read=False)  # a wake's step when no stage runs
    assert look["files"] == len(files) and look["read_bytes"] == 0 and look["resident_before"] < 0.5, look
    assert engine.rpc("hotswap_weights_residency")[0][0]["resident"] < 0.5, "a look reads nothing in"
    (report,), staged_s = engine.rpc("hotswap_stage_weights")
    size = sum(os.path.getsize(f) for f in files)
    assert report["files"] == len(files) and report["bytes"] == size and report["read_bytes"] == size, report
    assert report["resident_before"] < 0.5, report
    (after,), _ = engine.rpc("hotswap_weights_residency")
    assert after["resident"] >= 0.98, after
    (again,), again_s = engine.rpc("hotswap_stage_weights")
    assert again["read_bytes"] == 0 and again["resident_before"] >= 0.98, "resident: it only looks"
    REPORT["stage"] = {"report": report, "rpc_s": round(staged_s, 4), "again_rpc_s": round(again_s, 4)}

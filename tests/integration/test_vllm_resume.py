"""A stream cut mid-answer on real `vllm serve` (CPU) is resumed token for token, through the real router.

One router process and one tiny engine (config/examples/vllm-cpu.yaml's tiny-plain, no draft), booted
once for the module. Each scenario asks the same greedy request twice: uncut, then cut by its own
reader after N chunks (N drawn from a seed printed on the terminal; `HOTSWAP_RESUME_SEED` replays a run).
The reader first freezes the engine where it is (`freeze`; the stream is paced by vllm_pace.py so that
the freeze lands within a token or two of chunk N), then cuts it:
- an operator's sleep with `swap.drain_timeout_s: 0`: the stream is paused at once, the engine sleeps,
  and the paused request alone wakes it again (no other request is sent);
- a SIGKILL of the engine's `vllm serve` process: the router restarts it and the restarted engine
  finishes the answer.
The client asks for `return_token_ids` itself, so the resumed answer is compared with the uncut one by
its ids as well as its text, and by test_resume.one_answer's contract (one id/created/model, one role
delta, one finish_reason, one [DONE]).

The last scenario is the measurement docs/contributors.md ("Resuming an answer") quotes: resuming from
the answer's token ids against resuming from its text (the prompt plus the text so far, re-tokenized by
vLLM), at random cut points of a few prompts, straight on the engine's port.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Optional

import aiohttp
import pytest
import yaml

from tests.component.test_resume import one_answer, text_of
from tests.integration.harness import BOOT_TIMEOUT_S, REPORT, http, poll, progress
from tests.integration.live_router import LiveRouter
from tests.integration.tiny_models import SPECIALS
from tests.support import SSEReader

REPLACEMENT = "\ufffd"

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "examples" / "vllm-cpu.yaml"
MODEL = "tiny-plain"
MAX_TOKENS = 64
# A cut stream's pace (vllm_pace.py): the reader's freeze lands within a token or two of chunk N, and a
# reader starved by a busy machine still has (MAX_TOKENS - LAST_N) * PACE_MS (1.2 s) to send it.
PACE_MS = 50
LAST_N = 40
SEED = int(os.environ.get("HOTSWAP_RESUME_SEED") or random.SystemRandom().randrange(1 << 20))
PROMPTS = ["The router wakes the model and", "A student reads the first page", "Our team builds a small house"]


def roster() -> dict[str, Any]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["swap"].update(
        min_active_s=0, max_hold_s=5, boot_timeout_s=BOOT_TIMEOUT_S,
        drain_timeout_s=0,  # an operator's sleep cuts a running stream at once
        timeouts={"sleep": 30, "stage": 60, "wake_weights": 30, "reload_draft": 60, "reload_weights": 60,
                  "wake_kv_cache": 30, "reset_prefix_cache": 30, "gate": 60},
    )
    data["queue"] = {"max_waiting": 16, "max_wait_s": BOOT_TIMEOUT_S + 120}
    data["defaults"]["gate"] = {"max_tokens": 16}
    plain = dict({m["name"]: m for m in data["models"]}[MODEL])
    # The pace instrument (vllm_pace.py), importable in the engine's Python from this folder.
    plain["args"] = ["--logits-processors", "vllm_pace:Pace"]  # after the defaults' (args append)
    plain["env"] = {"PYTHONPATH": str(Path(__file__).resolve().parent)}
    return {**data, "models": [plain]}


@pytest.fixture(scope="module")
def router(vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    progress(f"resume scenarios: seed {SEED} (HOTSWAP_RESUME_SEED={SEED} replays these cut points)")
    with LiveRouter.booted(roster(), tmp_path_factory.mktemp("resume"), timeout=2 * BOOT_TIMEOUT_S) as live:
        yield live


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    return random.Random(f"{SEED}/{request.node.name}")


# --- a client's stream, read as an SSE parser would ----------------------------------------------


def request(chat: bool, prompt: str = PROMPTS[0]) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def paced(body: dict[str, Any]) -> dict[str, Any]:
    """The same request, one token every PACE_MS at least (the logits are untouched: the same answer)."""
    return {**body, "vllm_xargs": {"hotswap_pace_ms": PACE_MS}}


class Stream:
    def __init__(self, events: list[dict[str, Any]], comments: list[bytes], done: int, paused_at: Optional[int]):
        self.events, self.comments, self.done = events, comments, done
        self.paused_at = paused_at  # data events before the pause's comment

    def ids(self) -> list[int]:
        return [i for e in self.events for c in e.get("choices", []) for i in c.get("token_ids") or []]

    def usage(self) -> list[dict[str, Any]]:
        return [e["usage"] for e in self.events if e.get("usage")]


async def stream(live: LiveRouter, path: str, body: dict[str, Any], after: Optional[int] = None,
                 cut: Optional[Callable[[], Awaitable[Any]]] = None) -> Stream:
    """The stream's data events, comments and [DONE] count. Once `after` data events are in, the reader
    freezes the engine where it is (`freeze`) and `cut()` starts (as a task: the reader goes on reading
    while it runs)."""
    sse, cutting, paused_at = SSEReader(), None, None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOOT_TIMEOUT_S + 180)) as s:
        async with s.post(live.url + path, json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            async for line in sse.lines(r):
                if line.startswith(b":") and b"paused" in line and paused_at is None:
                    paused_at = len(sse.events)
                if cut is not None and cutting is None and len(sse.events) >= (after or 0):
                    await asyncio.to_thread(freeze, live)
                    cutting = asyncio.create_task(cut())
    if cutting is not None:
        await cutting
    return Stream(sse.events, sse.comments, sse.done, paused_at)


def freeze(live: LiveRouter) -> None:
    """The test's instrument: the engine's scheduler paused with its requests kept (vLLM's own
    `/sleep?level=0&mode=keep`: PAUSED_ALL, vllm/v1/engine/core.py:921-949), so the answer stops within a
    token or two of chunk N (the stream is paced: vllm_pace.py; unpaced, a tiny model on CPU answers 64
    tokens in about 0.2 s, before the reader's freeze can reach it). Nothing of the router's is touched: its
    own sleep after a cut sends `/sleep?level=2&mode=abort`, and its wake's `wake_up?tags=kv_cache`
    resumes the scheduler (core.py:997-1020)."""
    status, answer = http("POST", live.engine_url(MODEL) + "/sleep?level=0&mode=keep", timeout=30)
    assert status == 200, answer


def vllm_serve(reaper: int) -> int:
    """The `vllm serve` process an engine's reaper runs (the pid /admin/status shows is the reaper's,
    engines/process/reaper.py; cpu_launcher execs vllm)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
            if ppid == reaper and b"vllm" in open(f"/proc/{entry}/cmdline", "rb").read():
                return int(entry)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no vllm serve below the reaper {reaper}")


def same_answer(cut: Stream, uncut: Stream, chat: bool) -> None:
    one_answer(cut.events, cut.done, chat)
    one_answer(uncut.events, uncut.done, chat)
    assert len(uncut.ids()) == MAX_TOKENS
    assert cut.ids() == uncut.ids(), "token for token the answer the uncut stream gave"
    assert text_of(cut.events, chat) == text_of(uncut.events, chat)
    assert cut.usage() == uncut.usage(), "one usage chunk counting the whole answer"


def resumed(live: LiveRouter, reason: str) -> float:
    return live.metric(live.metrics(), "hotswap_streams_resumed_total", model=MODEL, reason=reason)


# --- the scenarios ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_greedy_stream_cut_by_a_sleep_after_n_chunks_resumes_token_for_token(router: LiveRouter, rng, chat):
    path, body = request(chat)
    uncut = await stream(router, path, body)
    before = resumed(router, "drain_deadline")
    n = rng.randrange(2, LAST_N)
    progress(f"{'chat' if chat else 'completions'}: the reader puts {MODEL} to sleep after {n} chunks")

    async def sleep() -> None:
        status, answer = await asyncio.to_thread(http, "POST", router.url + f"/admin/sleep?model={MODEL}")
        assert status == 200 and answer["result"] == "sleeping", answer

    cut = await stream(router, path, paced(body), after=n, cut=sleep)
    assert any(b"paused (drain_deadline)" in c for c in cut.comments), ("the stream was not cut", cut.comments)
    progress(f"  the stream was paused after {cut.paused_at} chunks")
    same_answer(cut, uncut, chat)
    assert resumed(router, "drain_deadline") == before + 1
    assert router.awake() == [MODEL], "the paused request woke the model by itself"


async def test_an_engine_killed_mid_stream_is_restarted_and_the_restart_finishes_the_answer(router: LiveRouter, rng):
    path, body = request(True, PROMPTS[1])
    poll(lambda: router.awake() == [MODEL] or None, 120, f"{MODEL} awake")
    uncut = await stream(router, path, body)
    reaper = router.engine(MODEL)["pid"]
    pid = vllm_serve(reaper)
    n = rng.randrange(2, LAST_N)
    progress(f"chat: the reader SIGKILLs {MODEL}'s vllm serve (pid {pid}) after {n} chunks; the router restarts it")

    async def kill() -> None:
        os.kill(pid, signal.SIGKILL)

    cut = await stream(router, path, paced(body), after=n, cut=kill)
    assert any(b"paused (engine_failed)" in c for c in cut.comments), ("the stream was not cut", cut.comments)
    progress(f"  the stream was paused after {cut.paused_at} chunks")
    same_answer(cut, uncut, True)
    assert router.engine(MODEL)["pid"] != reaper
    assert resumed(router, "engine_failed") == 1


# --- the measurement: resuming from token ids against resuming from text ------------------------------

CUTS = int(os.environ.get("HOTSWAP_RESUME_CUTS", "7"))  # per prompt and endpoint: 3 prompts x 7 = 21 cuts of each


def generate(url: str, chat: bool, body: dict[str, Any]) -> dict[str, Any]:
    """One buffered greedy answer of the engine, with its ids: the answer's and its prompt's."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, answer = http("POST", url + path, {"model": MODEL, "temperature": 0, "ignore_eos": True,
                                               "return_token_ids": True, **body}, timeout=60)
    assert status == 200, answer
    choice = answer["choices"][0]
    return {"text": choice["message"]["content"] if chat else choice["text"], "ids": choice["token_ids"],
            "prompt_ids": answer["prompt_token_ids"] if chat else choice["prompt_token_ids"]}


def by_ids(url: str, chat: bool, prompt: str, prompt_ids: list[int], so_far: list[int], left: int) -> dict[str, Any]:
    """The rest from the ids: what router.proxy.continuation sends."""
    if chat:
        return generate(url, True, {"messages": [{"role": "user", "content": prompt}], "max_tokens": left,
                                    "kv_transfer_params": {"prompt_token_ids": [*prompt_ids, *so_far]}})
    return generate(url, False, {"prompt": [*prompt_ids, *so_far], "max_tokens": left})


def by_text(url: str, chat: bool, prompt: str, text: str, left: int) -> dict[str, Any]:
    """The rest from the text: the prompt plus the text so far, rendered and tokenized again by vLLM."""
    if chat:
        return generate(url, True, {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}],
                                    "continue_final_message": True, "add_generation_prompt": False, "max_tokens": left})
    return generate(url, False, {"prompt": prompt + text, "max_tokens": left})


def special_ids(url: str) -> set[int]:
    status, answer = http("POST", url + "/tokenize", {"model": MODEL, "prompt": "".join(SPECIALS), "add_special_tokens": False})
    assert status == 200 and len(answer["tokens"]) == len(SPECIALS), answer
    return set(answer["tokens"])


def seen(url: str, ids: list[int], special: set[int]) -> str:
    """The text a client streaming `ids` has: vLLM skips special tokens in answers (skip_special_tokens),
    its /detokenize does not."""
    status, answer = http("POST", url + "/detokenize", {"model": MODEL, "tokens": [i for i in ids if i not in special]})
    assert status == 200, answer
    return answer["prompt"]


async def test_measured_resuming_from_token_ids_is_exact_where_resuming_from_text_often_is_not(router: LiveRouter, rng):
    """At CUTS random cut points of each prompt's greedy answer, the rest asked for from the ids (the prompt's
    and the answer's so far) and from the text (the prompt plus the text so far). Counted: exact (the rest's
    ids are the uncut answer's), the same text, the same prompt ids after re-tokenizing; `clean` cuts are those
    whose text so far has no U+FFFD (a random model writes bytes that are no character) and no special token."""
    poll(lambda: router.awake() == [MODEL] or None, BOOT_TIMEOUT_S, f"{MODEL} awake")
    url = router.engine_url(MODEL)
    special = special_ids(url)
    tally: dict[str, dict[str, int]] = {}
    misses: list[str] = []
    for chat in (True, False):
        counts = tally.setdefault("chat" if chat else "completions", dict.fromkeys(
            ("cuts", "ids_exact", "text_exact", "text_same_text", "text_same_prompt_ids", "clean_cuts",
             "clean_text_exact"), 0))
        for prompt in PROMPTS:
            body = ({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
            full = generate(url, chat, {**body, "max_tokens": MAX_TOKENS})
            assert len(full["ids"]) == MAX_TOKENS
            for k in sorted(rng.sample(range(1, MAX_TOKENS), CUTS)):
                text = seen(url, full["ids"][:k], special)
                while not full["text"].startswith(text):  # a cut inside a character: moved to its start
                    k -= 1
                    text = seen(url, full["ids"][:k], special)
                rest_ids = by_ids(url, chat, prompt, full["prompt_ids"], full["ids"][:k], MAX_TOKENS - k)
                rest_text = by_text(url, chat, prompt, text, MAX_TOKENS - k)
                exact = rest_text["ids"] == full["ids"][k:]
                clean = REPLACEMENT not in text and not special & set(full["ids"][:k])
                counts["cuts"] += 1
                counts["ids_exact"] += rest_ids["ids"] == full["ids"][k:]
                counts["text_exact"] += exact
                counts["text_same_text"] += text + rest_text["text"] == full["text"]
                counts["text_same_prompt_ids"] += rest_text["prompt_ids"] == [*full["prompt_ids"], *full["ids"][:k]]
                counts["clean_cuts"] += clean
                counts["clean_text_exact"] += clean and exact
                if rest_ids["ids"] != full["ids"][k:]:
                    misses.append(f"{'chat' if chat else 'completions'} {prompt!r} cut at {k}")
    REPORT["resume_ids_vs_text"] = {"seed": SEED, "max_tokens": MAX_TOKENS, **tally}
    progress(f"resuming from ids vs from text (seed {SEED}): {json.dumps(tally)}")
    assert not misses, f"resuming from the token ids was not exact: {misses}"

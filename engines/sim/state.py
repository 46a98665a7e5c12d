"""The engine model: weights, draft, sleep state and the decode loop of one vLLM engine.

It reproduces what a router can observe of vLLM 0.33 sleep mode, including the
Level-2 draft bug: Level 2 discards target and draft weights, waking the weights
does not bring their contents back, `reload_weights` restores only the target, and
a draft left discarded proposes tokens that are never accepted. Verification keeps
the text correct, so the only symptoms are spec-decode counters (mean acceptance
length 1.0) and a slower decode.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from . import lm, tokenizer
from .metrics import EngineMetrics, StatsDelta
from .numerics import NumericFaults, Numerics

log = logging.getLogger("vllm.sim")

# The draft's private parameters. `--sleep-preserve-parameter-names` keeps the draft
# only when its globs cover all of them: a half-preserved draft is still broken.
DRAFT_PARAMS = tuple(
    f"draft.{n}"
    for n in (
        "model.fc.weight",
        "model.enorm.weight",
        "model.hnorm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
        "d2t",
    )
)

WAKE_TAGS = ("weights", "kv_cache")
SCHEDULING = "scheduling"  # vLLM 0.32's wake tag for level 0: resume scheduling only (v1/engine/core.py:1001-1005)


class ReleaseRefused(Exception):
    """vLLM 0.32 refuses /release_kv_cache_memory (v1/engine/core.py:1026-1036); the text is its own."""


class GenerationAborted(Exception):
    """The request was aborted by `/sleep?mode=abort`."""


@dataclass
class SpecConfig:
    num_speculative_tokens: int
    model: str | None = None
    method: str | None = None


@dataclass
class EngineConfig:
    model: str
    served_names: list[str]
    max_model_len: int = 4096
    spec: SpecConfig | None = None
    acceptance: float = 2.6  # mean acceptance length of a healthy draft
    token_rate: float = 2000.0
    prefill_rate: float = 20000.0  # prompt tokens/s
    preserve_patterns: list[str] = field(default_factory=list)
    worker_extension: str | None = None
    reset_prefix_false: int = 0
    metrics_lag_s: float = 0.0
    log_stats: bool = True
    weightless_draft: bool = False  # ngram-style proposer: nothing for sleep to discard
    load_format: str = "auto"  # vLLM's --load-format: some loaders cannot reload (routes_dev.py)
    per_request_spec_metrics: str = "none"  # --per-request-spec-decode-metrics: none | summary | detailed
    prompt_acceptance: list[tuple[str, float]] = field(default_factory=list)  # (prompt substring, MAL)
    numeric_faults: NumericFaults = field(default_factory=NumericFaults)
    max_num_seqs: int | None = None  # vLLM's --max-num-seqs: requests past it wait in the engine's queue


class Generation:
    """One request as the scheduler sees it."""

    def __init__(self, prompt: str, prompt_tokens: int, max_tokens: int, ignore_eos: bool, salt: str) -> None:
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.salt = salt
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.aborted = asyncio.Event()
        self.stats = StatsDelta(prompt_tokens=prompt_tokens)
        self.logprobs: list[float] | None = None  # each token's, when the request asks for them
        self.top_logprobs = 0  # alternatives asked for besides the sampled token
        self.token_ids: list[int] = []  # the answer's, as `return_token_ids` gives them


class SimEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.k = cfg.spec.num_speculative_tokens if cfg.spec else 0
        self.target = "loaded"
        self.draft = "loaded" if cfg.spec and not cfg.weightless_draft else "none"
        self._draft_digest = self._original_draft_digest()
        self._junk_nonce = ""
        self.level: int | None = None
        self.weights_awake = True
        self.kv_cache_awake = True
        self.kv_released = False  # the KV cache was discarded (level 0 + release): its pages come back undefined
        # Two gates, because /sleep?mode=wait must stop admitting new requests while
        # the running ones keep decoding to completion.
        self._admit = asyncio.Event()
        self._decode = asyncio.Event()
        self._admit.set()
        self._decode.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.waiting: set[Generation] = set()
        self.running: set[Generation] = set()
        # vLLM schedules at most max_num_seqs requests a step; the rest wait (vllm:num_requests_waiting).
        self._slots = asyncio.Semaphore(cfg.max_num_seqs) if cfg.max_num_seqs else None
        self._reset_false_left = 0
        self.metrics = EngineMetrics(cfg.served_names[0], self.k if cfg.spec else None, cfg.log_stats)
        self.numerics = Numerics(cfg.model, cfg.numeric_faults)

    # ---- weights -------------------------------------------------------------

    def _original_draft_digest(self) -> str:
        h = hashlib.sha256()
        src = (self.cfg.spec.model if self.cfg.spec else None) or self.cfg.model
        for name in DRAFT_PARAMS:
            h.update(f"{src}:{name}".encode())
        return h.hexdigest()

    @property
    def draft_preserved(self) -> bool:
        pats = self.cfg.preserve_patterns
        return bool(pats) and all(any(fnmatch.fnmatchcase(n, p) for p in pats) for n in DRAFT_PARAMS)

    def discard_target(self) -> None:
        self.target = "discarded"
        self._junk_nonce = os.urandom(8).hex()

    def discard_draft(self) -> int:
        if self.draft == "none":
            return 0
        self.draft = "discarded"
        self._draft_digest = hashlib.sha256(os.urandom(32)).hexdigest()
        return len(DRAFT_PARAMS)

    def reload_weights(self) -> None:
        # vLLM 0.33: iterates the target model's parameters only; the draft is untouched.
        self.target = "loaded"
        self._junk_nonce = ""
        self.numerics.reloaded()

    def reload_draft(self) -> dict:
        if self.draft == "none":
            return {"reloaded": False, "tensors": 0, "reason": "no draft model"}
        self.draft = "loaded"
        self._draft_digest = self._original_draft_digest()
        return {"reloaded": True, "tensors": len(DRAFT_PARAMS)}

    def draft_digest(self) -> str | None:
        return None if self.draft == "none" else self._draft_digest

    @property
    def expected_mal(self) -> float | None:
        if self.cfg.spec is None:
            return None
        # A junk target rejects everything the draft proposes, too.
        if self.draft == "discarded" or self.target != "loaded":
            return 1.0
        return self.cfg.acceptance

    def _acceptance_for(self, prompt: str) -> float:
        """A healthy draft's MAL for this prompt: --sim-prompt-acceptance lets one request differ
        from another on the same engine, which the engine-wide counters then mix."""
        return next((mal for needle, mal in self.cfg.prompt_acceptance if needle in prompt), self.cfg.acceptance)

    # ---- sleep / wake ---------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self.level is not None

    @property
    def sleep_state(self) -> str:
        # Level 0 only pauses scheduling; weights and KV cache stay where they are.
        return {None: "awake", 0: "awake", 1: "weights_offloaded", 2: "discard_all"}[self.level]

    @property
    def sleeping_tags(self) -> set[str]:
        """The executor's sleeping tags (vllm/v1/executor/abstract.py:127): what is unmapped now."""
        return {t for t, awake in (("weights", self.weights_awake), ("kv_cache", self.kv_cache_awake)) if not awake}

    def maps_memory(self, tags: list[str]) -> bool:
        """Whether a wake with `tags` maps memory back ([]: all), as vLLM's executor decides it: nothing
        when nothing sleeps, and nothing at all when a tag asked for does not sleep (abstract.py:394-403)."""
        tags = [t for t in tags if t != SCHEDULING] if tags else []
        asleep = self.sleeping_tags
        return bool(asleep) and all(t in asleep for t in tags)

    def release_kv_cache(self) -> None:
        """vLLM 0.32's release_kv_cache_memory (v1/engine/core.py:1021-1039): after a completed pause with
        no request left, and only while nothing sleeps yet, discard the KV cache (no copy kept)."""
        if self.level is None or self.waiting or self.running:
            raise ReleaseRefused("release_kv_cache_memory() requires a completed pause first")
        if self.sleeping_tags:
            raise ReleaseRefused("release_kv_cache_memory() requires all executor memory to be resident")
        t0 = time.monotonic()
        self.kv_cache_awake = False
        self.kv_released = True
        self.metrics.observe_sleep_op("release_kv_cache_memory", time.monotonic() - t0)
        log.info("It took %.6f seconds to discard tags {'kv_cache'}.", time.monotonic() - t0)

    async def sleep(self, level: int, mode: str) -> None:
        t0 = time.monotonic()
        self._admit.clear()
        if mode == "abort":
            self._decode.clear()
            for g in self.waiting | self.running:
                g.aborted.set()
        elif mode == "wait":
            # Already paused requests cannot drain; waiting for them would deadlock.
            if self._decode.is_set():
                await self._idle.wait()
            self._decode.clear()
        else:  # keep: in-flight requests freeze where they are and resume on wake
            self._decode.clear()
        if level == 0:  # a pause: nothing is unmapped (core.py:973-976)
            self.level = 0 if self.level is None else self.level
            log.info("Paused scheduling (level 0, mode %s).", mode)
            return
        if not self.weights_awake:  # vLLM: "Executor is already sleeping." (abstract.py:383-385)
            return
        # From level 0 too: what a release discarded stays discarded (device_allocator/cumem.py:257-262).
        self.level = level
        self.weights_awake = False
        self.kv_cache_awake = False
        if level == 2:
            self.discard_target()
            if not self.draft_preserved:
                self.discard_draft()
        dt = time.monotonic() - t0
        self.metrics.observe_sleep_op("sleep", dt)
        log.info("It took %.6f seconds to fall asleep (level %d, mode %s).", dt, level, mode)

    def wake(self, tags: list[str]) -> dict:
        t0 = time.monotonic()
        # Waking the weights maps their memory back in. After Level 1 the contents come
        # back from host RAM (nothing was discarded); after Level 2 the memory is
        # uninitialised until reload_weights / a draft reload writes it. A tag that does
        # not sleep makes the executor wake nothing (abstract.py:398-403).
        if self.maps_memory(tags):
            woken = [t for t in tags if t != SCHEDULING] or list(WAKE_TAGS)
            self.weights_awake = self.weights_awake or "weights" in woken
            self.kv_cache_awake = self.kv_cache_awake or "kv_cache" in woken
        # Scheduling resumes only once nothing sleeps (core.py:1012-1018).
        if self.weights_awake and self.kv_cache_awake and self.level is not None:
            if self.level > 0 or self.kv_released:  # a pause alone unmapped nothing; a release did (its KV pages)
                self.numerics.woke()
            self.level = None
            self.kv_released = False
            self._reset_false_left = self.cfg.reset_prefix_false
            self._admit.set()
            self._decode.set()
        self.metrics.observe_sleep_op("wake", time.monotonic() - t0)
        return {
            "status": "sleeping" if self.is_sleeping else "awake",
            "weights_awake": self.weights_awake,
            "kv_cache_awake": self.kv_cache_awake,
        }

    def reset_prefix_cache(self) -> bool:
        if self._reset_false_left > 0:
            self._reset_false_left -= 1
            return False
        return True

    # ---- decoding -------------------------------------------------------------

    async def _pass(self, gate: asyncio.Event, gen: Generation) -> None:
        """Wait for a scheduler gate, unless the request is aborted first."""
        if not gate.is_set():
            gate_w = asyncio.ensure_future(gate.wait())
            abort_w = asyncio.ensure_future(gen.aborted.wait())
            try:
                await asyncio.wait({gate_w, abort_w}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gate_w.cancel()
                abort_w.cancel()
        if gen.aborted.is_set():
            raise GenerationAborted("Request aborted: engine was put to sleep (mode=abort)")

    def _token(self, gen: Generation, context: lm.Context) -> str:
        if self.target != "loaded":
            text = lm.junk_text(self._junk_nonce, gen.prompt, gen.completion_tokens)
            context.extend(text)
            gen.token_ids.extend(tokenizer.encode(text))
            return text
        text, token_id = context.next()
        gen.token_ids.append(token_id)
        return text

    def _logprob(self, gen: Generation, pos: int) -> float:
        if self.target != "loaded":
            return -10.0 * lm.unit("junk-lp", self._junk_nonce, gen.prompt, pos)  # what uninitialised weights make of it
        return self.numerics.logprob(gen.prompt, pos, gen.salt, len(self.running) - 1)

    def embed(self, text: str) -> list[float]:
        return lm.embedding(self.cfg.model, text, self._junk_nonce if self.target != "loaded" else None)

    async def generate(self, gen: Generation) -> AsyncIterator[str]:
        """Yield token texts as the engine produces them.

        A request sent to a sleeping engine is accepted and waits for a full wake;
        vLLM never rejects it. Each decode step verifies one draft of k tokens and
        emits 1 + accepted tokens. Acceptance is deterministic (a fractional
        accumulator starting at one half, so a canary's mean acceptance length rounds
        to the configured one) and counted even past max_tokens, as vLLM does.
        """
        loop = asyncio.get_running_loop()
        self.waiting.add(gen)
        try:
            await self._pass(self._admit, gen)
            if self._slots is not None:
                await self._slots.acquire()
        finally:
            self.waiting.discard(gen)
        self.running.add(gen)
        self._idle.clear()
        try:
            limit = gen.max_tokens
            context = lm.Context(self.cfg.model, gen.prompt, gen.salt)
            acc = 0.5
            mal = self._acceptance_for(gen.prompt)
            started = loop.time()
            next_t = started + gen.prompt_tokens / self.cfg.prefill_rate  # the prefill, paid before the first token
            while gen.completion_tokens < limit:
                await self._pass(self._decode, gen)
                accepted = 0
                healthy = self.draft != "discarded" and self.target == "loaded"
                if self.cfg.spec is not None:
                    if healthy:
                        acc += mal - 1.0
                        accepted = min(int(acc), self.k)
                        acc -= accepted
                    gen.stats.drafts += 1
                    gen.stats.draft_tokens += self.k
                    gen.stats.accepted += accepted
                    if len(gen.stats.accepted_per_pos) < self.k:
                        gen.stats.accepted_per_pos = [0] * self.k
                    for p in range(accepted):
                        gen.stats.accepted_per_pos[p] += 1
                    gen.stats.observe_step(self.k, accepted, detailed=self.cfg.per_request_spec_metrics == "detailed")
                step = min(1 + accepted, limit - gen.completion_tokens)
                # A useless draft costs a forward pass per step for nothing.
                rate = self.cfg.token_rate / (2 if self.draft == "discarded" else 1)
                next_t = max(next_t, loop.time()) + step / rate
                delay = next_t - loop.time()
                await asyncio.sleep(delay if delay > 0.001 else 0)
                if gen.aborted.is_set():
                    raise GenerationAborted("Request aborted: engine was put to sleep (mode=abort)")
                if gen.stats.prefill_s is None:
                    gen.stats.prefill_s = loop.time() - started
                for _ in range(step):
                    text = self._token(gen, context)
                    if gen.logprobs is not None:
                        gen.logprobs.append(self._logprob(gen, gen.completion_tokens))
                    gen.completion_tokens += 1
                    gen.stats.generation_tokens += 1
                    if gen.completion_tokens == limit:
                        gen.finish_reason = "length"
                    elif not gen.ignore_eos and self.target == "loaded" and context.ends():
                        gen.finish_reason, limit = "stop", gen.completion_tokens
                    yield text
                    if gen.finish_reason is not None:
                        break
        finally:
            self.running.discard(gen)
            if self._slots is not None:
                self._slots.release()
            if not self.running:
                self._idle.set()
            self._publish(gen.stats)

    def _publish(self, stats: StatsDelta) -> None:
        lag = self.cfg.metrics_lag_s
        if lag > 0:
            asyncio.get_running_loop().call_later(lag, self.metrics.apply, stats)
        else:
            self.metrics.apply(stats)

    def render_metrics(self) -> bytes:
        return self.metrics.render(len(self.running), len(self.waiting), self.sleep_state)

    def state_json(self) -> dict:
        return {
            "sleeping": self.is_sleeping,
            "level": self.level,
            "weights_awake": self.weights_awake,
            "kv_cache_awake": self.kv_cache_awake,
            "target": self.target,
            "draft": self.draft,
            "mal_healthy": self.cfg.acceptance,
            "mal_expected": self.expected_mal,
            "num_speculative_tokens": self.k,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "pid": os.getpid(),
        }

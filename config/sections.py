"""The roster's router-wide sections: listen, auth (keys and their scopes), queue, swap, gpus, host, node, activity.

The models' own keys and the roster as a whole are in `config.schema`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from config.secrets import mask_url

NonEmptyStr = Annotated[str, Field(min_length=1)]
# A request's class (docs/operators.md "Request classes"): batch work never parks or preempts an
# engine with interactive demand, and waits behind interactive requests for a lease.
# Highest first: a header may only move a request down this list, and vLLM's `priority` is the index.
REQUEST_CLASSES = ("interactive", "batch")
INTERACTIVE, BATCH = REQUEST_CLASSES
RequestClass = Literal[REQUEST_CLASSES]


class Section(BaseModel):
    # No float key means anything at inf or nan (YAML's `.inf`, `.nan`): refused here once for every
    # section, model and default, where a key-by-key bound would miss the next float added.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Listen(Section):
    host: str = Field("127.0.0.1", description="Address the router binds; loopback unless you mean otherwise.")
    port: int = Field(8080, ge=1, le=65535, description="Port the router listens on (the OpenAI endpoint).")
    max_body_mb: float = Field(32, gt=0, description="Largest request body accepted (413 above).")
    client_header_timeout_s: float = Field(
        60, gt=0, description="A client must send a request's whole head within this long of connecting (or of the "
        "previous answer on a keep-alive connection); past it the connection is closed. Also how long an idle "
        "keep-alive connection stays open.")
    client_body_timeout_s: float = Field(
        60, gt=0, description="Longest pause between two arrivals of a request body's bytes while the router waits "
        "for them; past it the client gets a 408 and the connection is closed. A slow client that keeps sending is "
        "never cut.")
    drain_notice_s: float = Field(
        0, ge=0, description="On SIGTERM the router keeps listening at least this long (and until in-flight and queued "
        "requests finish), answering /ready and new requests with 503 and Retry-After, so a load balancer or Kubernetes "
        "moves traffic away before the port closes. Behind a front: its health-check interval × fall count, or more.")
    access_log: bool = Field(
        False, description="One line per request in the router's log (logger hotswap.access): client, method, path "
        "without the query, status, seconds, bytes, the key's name (never the key) and the model. Every request, "
        "401s and 404s included.")


class ApiKey(Section):
    """One client or admin key and what it may use."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)  # `klass=` from Python, `class:` in YAML

    key: NonEmptyStr = Field(description="The key, sent as `Authorization: Bearer` (or `x-api-key` on /v1/messages). Write it as ${ENV_VAR}.")
    name: Optional[NonEmptyStr] = Field(
        None, description="What logs and the per-key request metric call it (never the key itself); unset: keys[N].")
    models: list[NonEmptyStr] = Field(
        default_factory=list, description="Globs over model names and aliases this key may use (`chat-*`, `embed`, `*` for all); "
        "any other model answers 404 as if it did not exist. A LoRA adapter: by its own name or its engine's.")
    admin: bool = Field(False, description="May call /admin/* and open /ui (and read /metrics).")
    metrics: bool = Field(
        False, description="May read /metrics and /metrics/model-server, which take a key once client keys exist (unless "
        "auth.open_metrics): "
        "the key Prometheus sends as its bearer token.")
    # `class` is a Python keyword: the field is `klass`, the roster key `class`.
    klass: RequestClass = Field(
        INTERACTIVE, alias="class", description="The class of this key's requests: `batch` never parks or preempts "
        "an engine with interactive demand and is served after queued interactive requests (docs/operators.md, "
        "\"Request classes\"). A request may lower it with the header `X-Hotswap-Class: batch`, never raise it.")

    @model_validator(mode="after")
    def _grants_something(self) -> "ApiKey":
        if not self.models and not self.admin and not self.metrics:
            raise ValueError("grants nothing: give it models: [...] (globs over model names; '*' for all), admin: true "
                             "and/or metrics: true")
        return self


class Auth(Section):
    api_keys: list[NonEmptyStr] = Field(
        default_factory=list,
        description="Client keys (Bearer) that may use every model; shorthand for keys with models: ['*']. "
        "Write each as ${ENV_VAR}. No client key anywhere: no client auth.",
    )
    admin_key: Optional[NonEmptyStr] = Field(
        None, description="Key for /admin/* and /ui; shorthand for a key with admin: true. Write it as ${ENV_VAR}. "
        "No admin key anywhere: /admin is loopback-only."
    )
    keys: list[ApiKey] = Field(
        default_factory=list, description="Scoped keys: each with the models it may use and/or admin (see below).")
    open_metrics: bool = Field(
        False, description="Serve /metrics and /metrics/model-server without a key even when client keys exist (an "
        "Inference Extension endpoint picker sends none). Off: with client keys, they (which name every model and key) "
        "take an admin key or a key with metrics: true.")

    @field_validator("keys")
    @classmethod
    def _distinct(cls, keys: list[ApiKey], info: ValidationInfo) -> list[ApiKey]:
        seen_keys: dict[str, str] = {k: f"api_keys[{i}]" for i, k in enumerate(info.data.get("api_keys") or [])}
        if info.data.get("admin_key"):
            seen_keys.setdefault(info.data["admin_key"], "admin_key")
        names: dict[str, int] = {}
        for i, entry in enumerate(keys):
            if entry.key in seen_keys:  # never the key itself in a message
                raise ValueError(f"keys[{i}].key is the same key as {seen_keys[entry.key]}: one key has one scope; remove one of them")
            seen_keys[entry.key] = f"keys[{i}]"
            if entry.name is not None:
                if entry.name in names:
                    raise ValueError(f"keys[{i}].name '{entry.name}' is already the name of keys[{names[entry.name]}]; names must be unique")
                names[entry.name] = i
        return keys


class Queue(Section):
    max_waiting: int = Field(256, ge=1, description="Waiting requests per model and request class before 429 (batch ones "
                             "never fill interactive room).")
    max_wait_s: float = Field(300, gt=0, description="A waiting request gets 503 after this long.")
    batch_max_wait_s: float = Field(
        3600, gt=0, description="A waiting batch request (a key's `class: batch`, or `X-Hotswap-Class: batch`) gets 503 "
        "after this long, naming the engine whose interactive demand kept the room; batch work waits for room rather "
        "than take it from interactive users.")
    stream_keepalive_s: Optional[float] = Field(
        None, gt=0, description="A streaming request that waits for a swap gets SSE comment lines "
        "(`: waking NAME (STEP)`) this often, so proxies and UIs do not time out; unset: off.")
    stall_timeout_s: float = Field(
        60, gt=0, description="A stream whose client takes none of it for this long (it stopped reading, or vanished "
        "without closing) is cut, and its lease freed: otherwise its engine could never be parked, restarted or removed.")


class Node(Section):
    name: Optional[NonEmptyStr] = Field(
        None, description="This router's name, shown with every model in /v1/models (`node.name`) for a front that "
        "spreads models over several hotswap nodes; unset: the host name (the pod name in Kubernetes).")
    labels: dict[NonEmptyStr, str] = Field(
        default_factory=dict, description="Free-form labels shown with the name (e.g. `{zone: a}`), for a front that "
        "prefers some nodes.")
    agent_port: Optional[int] = Field(
        None, ge=1, le=65535, description="A TCP port on `listen.host` for HAProxy's `agent-check`: the front sends a "
        "model's name, this node answers from that model's state here (awake: ready; parked: drain on the primary line, a "
        "weight from its wake estimate on the backup line), so a request goes where its model is awake "
        "(docs/multi-node.md); unset: no agent. Bound at start, like `listen`: a reload does not move it.")
    agent_key: Optional[NonEmptyStr] = Field(
        None, description="A shared secret the front sends before the model on each agent-check line (`<key> <model>`; "
        "HAProxy's agent-send reads it from its environment, docs/multi-node.md), so the agent tells only the front which "
        "models are served here: a line without it is answered as an unknown name. Write it as ${ENV_VAR}. Needed for an "
        "agent on an address other than loopback.")
    peers: list[AnyHttpUrl] = Field(
        default_factory=list, description="Base URLs of the fleet's other nodes (e.g. `http://10.0.0.2:8080`). A request "
        "for a model this node does not serve is passed on to a peer whose /v1/models lists it (a front that could not "
        "read the model sends it anywhere, docs/multi-node.md); empty: such a request is a 404, as without peers.")
    peer_connections: int = Field(
        64, ge=1, description="Requests this node passes on to one peer at a time (each holds a connection to it for "
        "as long as its answer lasts); one more is answered 503 `peer_busy` with Retry-After at once, never queued. "
        "These connections are their own pool: the engines' control calls (sleep, wake, canary, metrics) never wait "
        "for them.")

    @field_validator("agent_key")
    @classmethod
    def _one_word_key(cls, key: Optional[str]) -> Optional[str]:
        if key is not None and any(c.isspace() or not c.isprintable() for c in key):  # never the key itself in a message
            raise ValueError("must be one word, without whitespace or control characters: it is the first word of the "
                             "agent-check line")
        return key

    @field_validator("peers")
    @classmethod
    def _base_urls(cls, peers: list[AnyHttpUrl]) -> list[AnyHttpUrl]:
        seen: set[str] = set()
        for i, url in enumerate(peers):
            if url.query or url.fragment or url.username or url.password:  # a password alone is `http://:pw@host`
                raise ValueError(f"peers[{i}] '{mask_url(str(url))}' must be a base URL (scheme, host, port, optional path), "
                                 "without query or credentials")
            base = str(url).rstrip("/")
            if base in seen:
                raise ValueError(f"peers[{i}] '{base}' is listed twice")
            seen.add(base)
        return peers

    def peer_urls(self) -> list[str]:
        """The peers' base URLs without a trailing slash (pydantic adds one to a bare host)."""
        return [str(url).rstrip("/") for url in self.peers]


class Activity(Section):
    """The activity log: one record per proxied request (docs/observability.md)."""

    ring: int = Field(
        10_000, ge=0, description="Records kept in memory, the newest (what GET /admin/activity, `hotswap activity` and "
        "/ui read); 0 turns the activity log off.")
    path: Optional[NonEmptyStr] = Field(
        None, description="An SQLite file the records are also written to (off the event loop), so they survive a "
        "restart: the ring is refilled from it at start. Unset: memory only.")
    max_rows: int = Field(
        1_000_000, ge=1, description="Rows the SQLite file keeps; the oldest are deleted past it.")

    @model_validator(mode="after")
    def _path_needs_the_ring(self) -> "Activity":
        if self.path is not None and self.ring == 0:
            raise ValueError("path is set but ring: 0 turns the activity log off; give ring: N >= 1 (N records in memory)")
        return self


class Gpu(Section):
    index: int = Field(ge=0, description="The GPU index, as in `devices` (nvidia-smi's numbering).")
    memory_gb: float = Field(gt=0, description="Its memory, in GB.")


class Host(Section):
    ram_budget_gb: Optional[float] = Field(
        None, gt=0, description="Host RAM the engines may hold for sleep (Level-1 copies of the weights, and what stays "
                     "cached after a wake), as measured after every sleep and wake; unset: half of MemTotal.")
    page_cache_budget_gb: Optional[float] = Field(
        None, ge=0, description="Page cache the router may fill ahead of time with the checkpoints of the Level-2 "
        "sleepers most likely woken next (staged weights: their reload then reads RAM, not the disk). Page cache is "
        "evictable, but what it holds competes with the Level-1 copies (ram_budget_gb), the engines' own host RAM and "
        "everything else on the host: set it to what the host can spare. Unset or 0: nothing is staged ahead; a "
        "Level-2 wake still stages its own checkpoint while its victims drain and sleep.")


class StepTimeouts(Section):
    """Seconds each step of a swap may take before the engine is marked FAILED."""

    sleep: float = Field(120, gt=0, description="POST /sleep (after the drain).")
    stage: float = Field(300, gt=0, description="collective_rpc hotswap_stage_weights (the checkpoint read into the "
                         "page cache before a Level-2 wake). Past it the wake goes on: a stage never fails a wake.")
    release_kv_cache: float = Field(
        60, gt=0, description="POST /release_kv_cache_memory (a KV park, after POST /sleep?level=0).")
    wake_weights: float = Field(120, gt=0, description="POST /wake_up?tags=weights.")
    reload_draft: float = Field(300, gt=0, description="collective_rpc hotswap_reload_draft (draft from disk).")
    reload_weights: float = Field(600, gt=0, description="collective_rpc reload_weights (target from disk).")
    wake_kv_cache: float = Field(120, gt=0, description="POST /wake_up?tags=kv_cache (or the whole Level-1 wake, or a KV park's wake).")
    reset_prefix_cache: float = Field(60, gt=0, description="POST /reset_prefix_cache, retried while it answers false.")
    gate: float = Field(120, gt=0, description="Each canary generation and its counter reads (a gate step runs one to "
                        "three: the first cold boot's replay, gate.lora_canary's; the step gets this much for each).")


class Swap(Section):
    min_active_s: float = Field(5, ge=0, description="An engine stays awake at least this long (no thrash).")
    max_hold_s: float = Field(30, gt=0, description="Oldest waiter of another model forces a swap after this long.")
    idle_sleep_s: Optional[float] = Field(None, gt=0, description="Park an engine idle this long even if nobody waits.")
    interactive_hold_s: float = Field(
        60, ge=0, description="An engine asked for by an interactive request within this long still has interactive "
        "demand: batch requests never park, stop or preempt it for their own model (they wait, up to "
        "queue.batch_max_wait_s). 0: only interactive requests in flight or queued hold it. Past it, users likely "
        "back before the batch model's wake would end (their rate, over demand_tau_s) still hold it.")
    demand_tau_s: float = Field(300, gt=0, description="How fast demand is forgotten: a request's weight in a model's "
                                "request rate decays with this time constant (it halves in 0.69x this). A stop is weighed by the chance of "
                                "a request within it: nothing boots a stopped engine ahead of demand.")
    reuse_horizon_s: float = Field(60, gt=0, description="\"Asked for again soon\" means within this long: what parking an "
                                   "engine is expected to cost is its wake times the chance of a request within it.")
    wake_ahead: bool = Field(True, description="Wake the parked engine likeliest to be asked for next into room nobody waits "
                             "for (or room idle, less likely engines hold), when the numbers say it pays (docs/operators.md).")
    drain_timeout_s: float = Field(30, ge=0, description="In-flight requests get this long before sleep aborts them; an "
                                   "aborted answer is paused and resumed once the model serves again (docs/operators.md, "
                                   "\"When a model's turn ends mid-answer\").")
    boot_timeout_s: float = Field(900, gt=0, description="A cold boot must be healthy within this.")
    kill_grace_s: float = Field(
        15, gt=0, description="Stopping an engine (shutdown, restart, router death): SIGTERM to its process group, SIGKILL after this long."
    )
    timeouts: StepTimeouts = Field(default_factory=StepTimeouts, description="Per-step limits; a step past its limit fails the engine.")

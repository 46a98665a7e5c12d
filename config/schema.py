"""The roster schema: what an operator may write in roster.yaml, with its defaults.

One pydantic model per section (the router-wide ones are in `config.sections`). `ModelSpec` is a model *after* `defaults` have been merged
into it; `ModelDefaults` (derived from it) is what the `defaults:` section may hold.
Cross-model rules (duplicate names, port collisions) live in `config.loader`, which sees
the whole file and its line numbers.
"""

from __future__ import annotations

import re
import ssl
import string
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from config.names import ModelName
from config.virtual import VirtualModel
from config.argv import (
    DEFAULT_LAUNCHER,
    GPU_SHARE_FLAG,
    LOAD_FORMAT_FLAG,
    NO_RELOAD_FORMATS,
    NO_RELOAD_VLLM,
    ROUTER_OWNED_ENV,
    VLLM_DEFAULT_GPU_SHARE,
    arg_text,
    flag_name,
    flag_value,
    gpu_share_in,
    no_router_owned_flags,
    split_argv,
)
from config.secrets import split_userinfo, mask_argv, mask_env, mask_tree, mask_url
from config.sections import Activity, ApiKey, Auth, Gpu, Host, Listen, Node, NonEmptyStr, Queue, Section, StepTimeouts, Swap

__all__ = ["Activity", "ApiKey", "Auth", "Gate", "Gpu", "Host", "Listen", "ModelSpec", "Node", "Queue", "Roster", "RosterFile", "Section", "StepTimeouts", "Swap"]

DEFAULT_GATE_PROMPT = (
    "Write one paragraph about the history of the printing press, in plain words."
)
# Mean |logprob change| per token, in nats, past which a wake is refused. Chosen from measurement
# (docs/gate.md, "Measured: logprob drift"): well above a healthy engine's spread across cold boots and
# batch sizes, well below what a numerically wrong target shows.
DEFAULT_MAX_LOGPROB_DRIFT = 0.05


def _output_check(value: str) -> str:
    if value in ("exact", "off") or re.fullmatch(r"prefix:[1-9][0-9]*", value):
        return value
    raise ValueError("must be 'exact', 'off' or 'prefix:N' (N characters, N >= 1)")


_Scalar = Union[str, float, bool]
ArgvItem = Annotated[str, BeforeValidator(arg_text, json_schema_input_type=_Scalar)]
Argv = Annotated[list[ArgvItem], BeforeValidator(split_argv, json_schema_input_type=Union[str, list[_Scalar]])]


class Gate(Section):
    enabled: bool = Field(True, description="Run the canary at cold boot (baseline) and after every wake.")
    prompt: NonEmptyStr = Field(DEFAULT_GATE_PROMPT, description="The canary prompt (temperature 0, ignore_eos).")
    max_tokens: int = Field(64, ge=1, le=4096, description="Tokens the canary decodes; more drafts, steadier numbers.")
    wake_max_tokens: Optional[int] = Field(
        16, ge=1, le=4096, description="Tokens of the canary after a wake that moved no weights from disk (from the "
        "KV-only rung or Level 1): a lost draft, garbage KV pages and numeric drift show in the first tokens, and it is "
        "judged against its own cold-boot baseline of this length (the first boot runs one canary more to record it). "
        "At most max_tokens (left unwritten, it is cut to max_tokens); null: the full canary after every wake. "
        "Level-2 wakes and restarts always run the full canary. Why 16: docs/gate.md.")
    min_acceptance_ratio: float = Field(
        0.5, ge=0, le=1, description="Refuse when MAL_after-1 < ratio * (MAL_baseline-1)."
    )
    min_acceptance_length: float = Field(1.2, ge=1, description="Refuse when MAL_after is below this.")
    output_check: Annotated[str, AfterValidator(_output_check)] = Field(
        "exact", description="'exact', 'prefix:N' (first N characters) or 'off'."
    )
    max_logprob_drift: Optional[float] = Field(
        DEFAULT_MAX_LOGPROB_DRIFT, ge=0, description="Refuse a wake whose canary's per-token logprobs moved from the cold-boot "
        "baseline's by more than this mean absolute difference (nats) over the tokens both chose: the tokens match but the numbers "
        "do not (vLLM #45617, #44972). Also refuses a cold boot whose two canaries already differ by more. null: not "
        "measured (the canary asks for no logprobs). How the default was measured: docs/gate.md.")
    lora_canary: Optional[NonEmptyStr] = Field(
        None, description="A LoRA adapter the engine serves: the canary also runs through it, and its output must "
        "match its own cold-boot baseline after every wake (an adapter can come back wrong silently).")
    on_fail: Literal["restart", "refuse", "allow"] = Field(
        "restart", description="On a refused wake: cold restart and re-verify, fail the engine, or promote and alert."
    )
    on_midlife: Literal["log", "restart"] = Field("log", description="On a collapse while serving: log it, or restart when idle.")
    midlife_window_s: float = Field(60, gt=0, description="Sliding window of the acceptance watch while serving.")
    midlife_min_drafts: int = Field(200, ge=1, description="Drafts the window needs before it judges.")

    @field_validator("wake_max_tokens")
    @classmethod
    def _wake_canary_within_the_full_one(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        # Runs only when written (pydantic leaves defaults alone), so a roster with max_tokens below 16
        # that never names this key keeps working: the default is cut to max_tokens (`wake_tokens`).
        full = info.data.get("max_tokens")
        if value is not None and full is not None and value > full:
            raise ValueError(f"{value} is more than max_tokens ({full}): the wake canary is the start of the full one; "
                             f"lower it to {full} or less, or null for the full canary after every wake")
        return value

    @property
    def wake_tokens(self) -> Optional[int]:
        """The short wake canary's length; None when a wake runs the full canary (null, or no shorter)."""
        if not self.enabled or self.wake_max_tokens is None or self.wake_max_tokens >= self.max_tokens:
            return None
        return self.wake_max_tokens


class ModelSpec(Section):
    """One engine, with `defaults` already merged in.

    Field order matters: a field's validator sees the fields above it (`info.data`),
    which is how each cross-field error lands on the key that is wrong.
    """

    name: ModelName = Field(description="What clients put in `model`: one word (no whitespace or control characters).")
    aliases: list[ModelName] = Field(default_factory=list, description="Other names clients may use (one word each, as names).")
    group: Optional[NonEmptyStr] = Field(
        None, description="Models that share a group are never awake together; unset: placed by GPU memory only.")
    default: bool = Field(False, description="Serves requests that name no model; kept awake at boot when it fits.")
    devices: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: [0], min_length=1,
        description="GPU indexes the engine uses (the router sets CUDA_VISIBLE_DEVICES from them).")
    pin: bool = Field(False, description="Never parked to make room (still drained at shutdown).")
    weights_gb: Optional[float] = Field(
        None, gt=0, description="The checkpoint's size: until its first Level-1 sleep is measured, that sleep is "
                     "expected to hold 1.35 x this in host RAM; unset: read from the checkpoint files.")
    sleep_residual_gb: float = Field(
        1.0, ge=0, description="GPU memory a sleeping engine still holds per device (CUDA context, pools).")
    model: Optional[NonEmptyStr] = Field(None, description="Path or id given to `vllm serve`.")
    url: Optional[NonEmptyStr] = Field(None, description="Attach to an engine something else runs.")
    tls_ca_file: Optional[NonEmptyStr] = Field(
        None, description="For an `https://` url: a PEM file of the CA certificate(s) the engine's certificate is "
        "verified against, instead of the system store (a private CA). Read at load: it must exist and hold a certificate.")
    port: Optional[int] = Field(None, ge=1, le=65535, description="Engine port; picked free when unset.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the engine process.")
    speculative: Optional[dict[str, Any]] = Field(None, description="Becomes --speculative-config (JSON).")
    sleep_level: Literal["auto", 0, 1, 2] = Field(
        "auto", description="vLLM sleep level when parked: 0 releases only the KV cache (weights stay on the GPU; "
        "when its room is needed it is stopped), 1 keeps weights in host RAM (stopped instead where host.ram_budget_gb "
        "cannot hold them), 2 discards them; auto: the whole ladder, "
        "0 when releasing the KV cache makes the room needed and costs less (weights_gb and gpus known), else 1 while host.ram_budget_gb holds what it would hold there, else 2 (else a stop, for a --load-format vLLM cannot "
        "reload from: dummy, ipc_cache, modelexpress, sharded_state, runai_streamer_sharded, tensorizer; 2 is refused for those).")
    # After sleep_level, so that its validator sees it (pydantic validates fields in this order).
    # Its share is read from it (`vllm_argv`), so it is held to the rule `args` are held to.
    command: Optional[Annotated[Argv, AfterValidator(gpu_share_in)]] = Field(
        None, description="Full argv; {port}, {model}, {name} are filled in. The vLLM flags the router reads "
        "(--gpu-memory-utilization, --max-num-seqs, --scheduling-policy, --load-format, --api-key) are read here, not in args.")
    draft_restore: Optional[Literal["reload", "preserve", "none"]] = Field(
        None,
        validate_default=True,
        description="How the draft survives Level-2 sleep; 'reload' when speculative is set, else 'none'.",
    )
    gate: Gate = Field(default_factory=Gate, description="The promotion gate (see below).")
    launcher: Argv = Field(default_factory=lambda: list(DEFAULT_LAUNCHER), min_length=1,
                           description="argv prefix replacing `vllm serve` (another venv, a container wrapper).")
    args: Annotated[Argv, AfterValidator(no_router_owned_flags), AfterValidator(gpu_share_in)] = Field(
        default_factory=list,
        validate_default=True,  # a `command:` engine's --load-format is checked here too
        description="Extra `vllm serve` flags (not the ones the router sets); a string is split like a shell, "
        "a number or boolean is taken as written (`[--gpu-memory-utilization, 0.85]`).")

    # The values the loader substituted for ${ENV} references in the models and defaults: shown masked.
    _from_env: frozenset[str] = PrivateAttr(frozenset())

    def masked(self, argv: list[str]) -> list[str]:
        """`argv` (this engine's, or a part of it) as it may be printed or logged: see `config.secrets`."""
        return mask_argv(argv, self._from_env)

    @property
    def shown_url(self) -> Optional[str]:
        """`url` as it may be printed or logged: its userinfo and ${ENV} values masked (`config.secrets`)."""
        return None if self.url is None else mask_url(self.masked([self.url])[0])

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, url: Optional[str]) -> Optional[str]:
        if url is not None and not re.match(r"https?://[^/]+", url):
            raise ValueError("must be an http:// or https:// URL, e.g. http://127.0.0.1:8001")
        credentials = split_userinfo(url)[1] if url is not None else None
        if credentials is not None and ":" in credentials[0]:  # Basic auth cannot carry it (RFC 7617)
            raise ValueError(f"{mask_url(url)}: the user name before '@' may not contain ':' (written %3A)")
        return url

    @field_validator("tls_ca_file")
    @classmethod
    def _ca_file_usable(cls, path: Optional[str], info: ValidationInfo) -> Optional[str]:
        if path is None:
            return None
        if "url" in info.data and not (info.data["url"] or "").startswith("https://"):  # (a bad url has its own error)
            url = info.data["url"]
            raise ValueError("applies only to an engine attached by an https:// url "
                             f"({f'url is {mask_url(url)}' if url else 'this model has no url'})")
        try:  # what the engine's TLS will do with it, so a file that passes here works there
            ssl.create_default_context(cafile=path)
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file") from None
        except ssl.SSLError as exc:
            raise ValueError(f"{path}: no PEM certificate in it ({exc.reason or exc})") from None
        except OSError as exc:
            raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        return path

    @field_validator("devices")
    @classmethod
    def _devices_unique(cls, devices: list[int]) -> list[int]:
        if len(set(devices)) != len(devices):
            raise ValueError(f"lists a device twice ({devices})")
        return devices

    @field_validator("env")
    @classmethod
    def _env_not_router_owned(cls, env: dict[str, str]) -> dict[str, str]:
        for name in ROUTER_OWNED_ENV:
            if name in env:
                raise ValueError(f"{name} is set by the router from `devices`; list the GPU indexes there instead")
        return env

    @field_validator("command")
    @classmethod
    def _command_placeholders(cls, command: Optional[list[str]], info: ValidationInfo) -> Optional[list[str]]:
        if command is None:
            return None
        if not command:
            raise ValueError("must not be empty")
        try:  # the same parser str.format uses, so `{{` escapes literal braces (e.g. JSON)
            fields = {f for part in command for _, f, _, _ in string.Formatter().parse(part) if f is not None}
        except ValueError as exc:
            raise ValueError(f"{exc} (write literal braces as {{{{ and }}}})") from None
        unknown = fields - {"port", "model", "name"}
        if unknown:
            raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; known: {{port}}, {{model}}, {{name}}")
        if "port" not in fields and info.data.get("port") is None:
            raise ValueError("needs {port} or an explicit port, so the router knows where the engine listens")
        return command

    @field_validator("speculative")
    @classmethod
    def _speculative_tokens(cls, spec: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if spec is not None:
            n = spec.get("num_speculative_tokens")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError("needs num_speculative_tokens, an integer >= 1")
        return spec

    @field_validator("draft_restore")
    @classmethod
    def _draft_restore(cls, value: Optional[str], info: ValidationInfo) -> str:
        has_draft = info.data.get("speculative") is not None
        if value is None:
            return "reload" if has_draft else "none"
        if value != "none" and not has_draft and "speculative" in info.data:
            raise ValueError(f"'{value}' needs speculative (without it there is no draft to restore)")
        return value

    @field_validator("args")
    @classmethod
    def _stats_kept_for_gate(cls, args: list[str], info: ValidationInfo) -> list[str]:
        gate = info.data.get("gate")
        if gate is not None and gate.enabled and any(flag_name(a) == "--disable-log-stats" for a in args):
            raise ValueError(
                "--disable-log-stats removes the spec-decode counters the gate reads; "
                "drop it or set gate.enabled: false"
            )
        return args

    @field_validator("command", "args")
    @classmethod
    def _level2_can_reload(cls, argv: Optional[list[str]], info: ValidationInfo) -> Optional[list[str]]:
        # On the field the flag was written in: a `command:` engine's own argv (its args are not used), else args.
        if argv is None or (info.field_name == "args" and not ("command" in info.data and info.data["command"] is None)):
            return argv
        load_format = flag_value(argv, LOAD_FORMAT_FLAG)
        if info.data.get("sleep_level") == 2 and load_format in NO_RELOAD_FORMATS:
            raise ValueError(
                f"sleep_level: 2 discards the weights and its wake reloads them from disk, which vLLM {NO_RELOAD_VLLM} "
                f"cannot do for {LOAD_FORMAT_FLAG} {load_format} (its loader has no get_all_weights; the first wake "
                "would fail): set sleep_level: 1, or auto (level 1 while host RAM holds the weights, else a stop and "
                "a cold boot)")
        return argv

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        sources = [k for k in ("model", "command", "url") if getattr(self, k) is not None]
        if len(sources) != 1:
            found = ", ".join(sources) if sources else "none of them"
            raise ValueError(f"set exactly one of model, command, url (found {found})")
        return self

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    @property
    def engine_api_key(self) -> Optional[str]:
        """The key the engine itself demands on /v1 (its `--api-key` or VLLM_API_KEY), for the router's own calls."""
        return self.flag("--api-key") or self.env.get("VLLM_API_KEY")

    @property
    def vllm_argv(self) -> list[str]:
        """Where this engine's vLLM flags are written: a `command:` engine's own argv (the engine never
        sees its `args`), else `args`."""
        return self.command if self.command is not None else self.args

    def flag(self, name: str) -> Optional[str]:
        """The value the engine runs with for vLLM flag `name` (None: unset, vLLM's default)."""
        return flag_value(self.vllm_argv, name)

    @property
    def gpu_share(self) -> float:
        """The fraction of each of its devices this engine takes when awake (vLLM's default when unset)."""
        text = self.flag(GPU_SHARE_FLAG)
        return float(text) if text is not None else VLLM_DEFAULT_GPU_SHARE

    @property
    def reloads_weights(self) -> bool:
        """Whether vLLM can reload this engine's weights from disk, as a Level-2 wake must (an attached
        `url:` engine's format is not known here: assumed yes, as before)."""
        return self.flag(LOAD_FORMAT_FLAG) not in NO_RELOAD_FORMATS

    @property
    def managed(self) -> bool:
        """The router starts and stops this engine's process (not attached by url)."""
        return self.url is None


# Keys that identify one engine: a default for them would make every model the same.
IDENTITY_KEYS = frozenset({"name", "aliases", "default", "model", "command", "url", "port"})

ModelDefaults = create_model(
    "ModelDefaults",
    __base__=Section,
    **{
        name: (Optional[field.annotation], Field(None, description=field.description))
        for name, field in ModelSpec.model_fields.items()
        if name not in IDENTITY_KEYS
    },
)
ModelDefaults.__doc__ = "Keys merged into every model (the model's own value wins; env and gate merge key by key; args append)."


class RosterFile(Section):
    """The roster file as written (models still without their defaults)."""

    listen: Listen = Field(default_factory=Listen)
    auth: Auth = Field(default_factory=Auth)
    queue: Queue = Field(default_factory=Queue)
    swap: Swap = Field(default_factory=Swap)
    gpus: Optional[list[Gpu]] = Field(None, description="GPU sizes; unset: discovered through NVML, else each device is 1.0 of itself.")
    host: Host = Field(default_factory=Host)
    node: Node = Field(default_factory=Node)
    activity: Activity = Field(default_factory=Activity)
    defaults: ModelDefaults = Field(default_factory=ModelDefaults)  # type: ignore[valid-type]
    models: list[ModelSpec] = Field(min_length=1)
    virtual_models: list[VirtualModel] = Field(default_factory=list, description="Names that stand for any of several models.")


class Roster(Section):
    """The resolved roster every other part of hotswap reads."""

    source: str
    listen: Listen
    auth: Auth
    queue: Queue
    swap: Swap
    gpus: Optional[list[Gpu]] = None
    host: Host = Host()
    node: Node = Node()
    activity: Activity = Activity()
    models: list[ModelSpec]
    virtual_models: list[VirtualModel] = []
    _located: Optional[Callable[[tuple[Any, ...]], tuple[str, int, int]]] = PrivateAttr(None)  # config.loader.Locations

    def locate(self, path: tuple[Any, ...]) -> Optional[tuple[str, int, int]]:
        """Where `path` (e.g. `("models", 0, "launcher")`) was written in the roster file, as
        (field, line, col), for messages in `file:line:col: field: message` form. A model's key
        set in `defaults` is placed there; one nobody wrote, at its model. None for a roster
        not loaded from YAML."""
        return self._located(path) if self._located is not None else None

    def redacted(self) -> dict[str, Any]:
        """The roster as plain data with secrets masked (for `hotswap check` and /admin)."""
        data = self.model_dump(mode="json")
        data["auth"]["api_keys"] = ["***"] * len(self.auth.api_keys)
        if self.auth.admin_key:
            data["auth"]["admin_key"] = "***"
        for entry in data["auth"]["keys"]:
            entry["key"] = "***"
            entry["class"] = entry.pop("klass")  # as the roster writes it
        if self.node.agent_key:
            data["node"]["agent_key"] = "***"
        for m, spec in zip(data["models"], self.models):
            m["env"] = mask_env(spec.env, spec._from_env)
            for key in ("launcher", "args", "command"):
                if m[key] is not None:
                    m[key] = spec.masked(m[key])
            if m["model"] is not None:  # it is in the argv too
                m["model"] = spec.masked([m["model"]])[0]
            if m["speculative"] is not None:  # so is this, as --speculative-config
                m["speculative"] = mask_tree(m["speculative"], spec._from_env)
            m["url"] = spec.shown_url
        return data

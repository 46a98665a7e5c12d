"""`python -m engines.sim serve MODEL [vllm serve flags] [--sim-* knobs]`: a simulated vLLM engine.

Its command line, and what each flag models, is engines/sim/flags.py; this module serves it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from .control import Control, Fault, InjectedFault
from .boot_failure import extension_import_failure, extension_origin, memory_check_failure, print_boot_failure
from .flags import parse_args
from .memory import EngineMemory, OutOfMemory
from .page_cache import DiskModel

log = logging.getLogger("vllm.sim")
uvicorn_log = logging.getLogger("uvicorn")

VERSION = "0.33.0"
# Speculative methods whose proposer has no weights, so sleep cannot break it.
WEIGHTLESS_METHODS = ("ngram", "suffix")


def setup_logging() -> None:
    # Handlers flush every record, so a supervisor tailing the pipe sees lines at once.
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"))
    log.addHandler(out)
    log.setLevel(logging.INFO)
    log.propagate = False
    uv = logging.StreamHandler(sys.stdout)
    uv.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    uvicorn_log.addHandler(uv)
    uvicorn_log.setLevel(logging.INFO)
    uvicorn_log.propagate = False


async def _load_weights(disk: DiskModel) -> None:
    started = time.monotonic()
    resident = await disk.reload()
    log.info("sim: loaded %g GB of weights from %s in %.2f s", disk.weights_gb, "the page cache" if resident else "disk",
             time.monotonic() - started)


async def _until_stopped(stop: asyncio.Event, aw) -> bool:
    """Run `aw` unless SIGTERM comes first; True when stopped."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not task.done():
        task.cancel()
        return True
    task.result()
    return False


async def serve(args: argparse.Namespace, unknown: list[str]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # Imported here so that argv errors answer before the heavier imports.
    from aiohttp import web

    from .app import build_app
    from .lora import Adapters, parse_module
    from .http import UvicornAccessLogger
    from .server import SimServer
    from .state import EngineConfig, SimEngine, SpecConfig
    from .numerics import NumericFaults

    log.info("vLLM API server version %s (simulated by engines.sim)", VERSION)
    log.info("args: model=%s served_model_name=%s speculative_config=%s", args.model, args.served_model_name, args.speculative_config)
    if unknown:
        log.info("simulator ignores vLLM arguments it does not model: %s", " ".join(unknown))

    delays = {step: float(v) for step, v in args.sim_step_delay}
    control = Control(delays, [Fault(step, kind) for step, kind in args.sim_fault])

    # vLLM's worker imports its extension first (v1/worker/worker_base.py:297), then initialises the device.
    extension_from = None
    if args.sim_separate_env and args.worker_extension_cls:
        extension_from, missing = extension_origin(args.worker_extension_cls, os.environ.get("PYTHONPATH", ""))
        if extension_from is None:
            print_boot_failure(extension_import_failure(missing))
            return 1
        log.info("sim: worker extension %s from %s", args.worker_extension_cls, extension_from)

    # vLLM's worker checks free GPU memory as it initialises the device, before it loads
    # the model; the engine then holds its share (a process that exits holds nothing).
    memory: EngineMemory | None = args.gpu_memory
    if memory is not None:
        try:
            memory.boot()
        except OutOfMemory as e:
            print_boot_failure(memory_check_failure(e))
            return 1
        log.info("sim: GPU memory held: %s GB on devices %s", memory.held_gb(), memory.devices)

    # vLLM loads the model before it binds the port: /health is refused while booting.
    try:
        if await _until_stopped(stop, asyncio.sleep(args.sim_boot_s)):
            return 0
        if args.disk_model is not None and await _until_stopped(stop, _load_weights(args.disk_model)):
            return 0
        if await _until_stopped(stop, control.enter("boot")):
            return 0
    except InjectedFault:  # http500, the only answer kind boot takes: a failed boot
        print_boot_failure()
        return 1
    if args.sim_fail_boot:
        print_boot_failure()
        return 1

    spec = None
    if args.speculative_config is not None:
        c = args.speculative_config
        spec = SpecConfig(c["num_speculative_tokens"], c.get("model"), c.get("method"))
    engine = SimEngine(
        EngineConfig(
            model=args.model,
            served_names=args.served_model_name or [args.model],
            max_model_len=args.max_model_len,
            spec=spec,
            acceptance=args.sim_acceptance,
            token_rate=args.sim_token_rate,
            prefill_rate=args.sim_prefill_rate,
            max_num_seqs=args.max_num_seqs,
            preserve_patterns=args.sleep_preserve_parameter_names,
            worker_extension=args.worker_extension_cls,
            reset_prefix_false=args.sim_reset_prefix_false,
            metrics_lag_s=args.sim_metrics_lag_s,
            log_stats=not args.disable_log_stats,
            per_request_spec_metrics=args.per_request_spec_decode_metrics,
            prompt_acceptance=args.sim_prompt_acceptance,
            weightless_draft=spec is not None and spec.method in WEIGHTLESS_METHODS,
            load_format=args.load_format,
            numeric_faults=NumericFaults(args.sim_logprob_jitter, args.sim_wake_logprob_shift, args.sim_wake_logprob_noise),
        )
    )
    log.info(
        "engine: draft=%s k=%d acceptance=%.3f token_rate=%.0f/s preserve=%s",
        engine.draft, engine.k, args.sim_acceptance, args.sim_token_rate, args.sleep_preserve_parameter_names,
    )
    served = args.served_model_name or [args.model]
    adapters = Adapters(dict(parse_module(m) for m in args.lora_modules) if args.enable_lora else {}, served[0])
    server = SimServer(
        engine,
        control,
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        crash_mid_stream=args.sim_crash_mid_stream,
        adapters=adapters,
        memory=memory,
    )
    server.lose_lora_on_level2 = args.sim_lora_lost_on_level2
    server.disk = args.disk_model
    server.extension_from = extension_from
    if server.dev_mode:
        log.warning("SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!")
    runner = web.AppRunner(
        build_app(server, args.host_model),
        access_log_class=UvicornAccessLogger,
        access_log=logging.getLogger("uvicorn.access"),
        # A client that disconnects aborts its request, as in vLLM.
        handler_cancellation=True,
        shutdown_timeout=0.1,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port, backlog=2048).start()  # uvicorn's, so vLLM's
    except OSError as e:
        print(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address ({args.host!r}, {args.port}): {e.strerror}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 1
    if memory is not None:
        memory.awake()
    uvicorn_log.info("Started server process [%d]", os.getpid())
    uvicorn_log.info("Waiting for application startup.")
    uvicorn_log.info("Application startup complete.")
    uvicorn_log.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", args.host, args.port)

    await stop.wait()
    uvicorn_log.info("Shutting down")
    try:
        await asyncio.wait_for(runner.cleanup(), 0.5)
    except Exception as e:  # exiting anyway; say why it was not clean
        log.warning("unclean shutdown: %r", e)
    uvicorn_log.info("Finished server process [%d]", os.getpid())
    return 0


def main(argv: list[str] | None = None) -> int:
    args, unknown = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging()
    import uvloop

    return uvloop.run(serve(args, unknown))


if __name__ == "__main__":
    sys.exit(main())

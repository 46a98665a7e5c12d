"""The flags `vllm serve --help` lists (vLLM 0.32, read from its own argument parser; `--no-X` spellings left out),
for one purpose: telling an operator who wrote a flag as a roster key (`gpu_memory_utilization: 0.85`) that it goes
in `args`. A hint only: a flag missing here (a newer vLLM's) gets the plain unknown-key message, and nothing is refused
or passed for being listed. To refresh, in vLLM's environment:

    python -c "from vllm.entrypoints.launchers.cli_args import make_arg_parser as m; \\
    from vllm.utils.argparse_utils import FlexibleArgumentParser as P; \\
    print(' '.join(sorted({o[2:] for a in m(P())._actions for o in a.option_strings if o[:2] == '--' and o[:5] != '--no-'})))"
"""

VLLM_SERVE_FLAGS = frozenset(f"--{name}" for name in """
additional-config aggregate-engine-logging all2all-backend allow-credentials allow-deprecated-quantization
allowed-headers allowed-local-media-path allowed-media-domains allowed-methods allowed-origins
anthropic-disabled-thinking-effort api-key api-server-count async-scheduling attention-backend attention-config
aux-output-config block-size chat-template chat-template-content-format code-revision cohere-format
cohere-is-reasoning-model collect-detailed-traces compilation-config config config-format convert
cp-kv-cache-interleave-size cpu-distributed-timeout-seconds cpu-offload-gb cpu-offload-params
cudagraph-capture-sizes cudagraph-metrics custom-histogram-buckets data-parallel-address data-parallel-backend
data-parallel-external-lb data-parallel-hybrid-lb data-parallel-multi-port-external-lb data-parallel-rank
data-parallel-rpc-port data-parallel-size data-parallel-size-local data-parallel-start-rank
data-parallel-supervisor-port dbo-decode-token-threshold dbo-prefill-token-threshold dcp-comm-backend
dcp-kv-cache-interleave-size dcp-q-replicate decode-context-parallel-size default-chat-template-kwargs
default-mm-loras device-ids device-memory-utilization diffusion-config disable-access-log-for-endpoints
disable-cascade-attn disable-chunked-mm-input disable-custom-all-reduce disable-fastapi-docs
disable-hybrid-kv-cache-manager disable-log-stats disable-nccl-for-dp-synchronization disable-sliding-window
disable-uvicorn-access-log distributed-executor-backend distributed-timeout-seconds download-dir
dp-supervisor-probe-failure-threshold dp-supervisor-probe-interval-s dp-supervisor-probe-timeout-s dp-sync-interval
dtype ec-manager-config ec-transfer-config elastic-ep-max-dp-size enable-auto-tool-choice
enable-batch-sharded-sampling enable-chunked-prefill enable-cumem-allocator enable-dbo enable-elastic-ep
enable-ep-weight-filter enable-eplb enable-expert-parallel enable-fault-tolerance enable-flash-late-interaction
enable-flashinfer-autotune enable-force-include-usage enable-hc-sp enable-layerwise-nvtx-tracing enable-log-deltas
enable-log-outputs enable-log-requests enable-logging-iteration-details enable-lora
enable-mamba-cache-stochastic-rounding enable-mamba-shared-prefix-checkpoint enable-mfu-metrics
enable-mixed-moe-lora-format enable-mm-embeds enable-moe-shared-loras enable-nccl-comm-suspend enable-offline-docs
enable-per-request-metrics enable-prefix-caching enable-prompt-embeds enable-prompt-tokens-details
enable-request-id-headers enable-return-routed-experts enable-scale-out enable-server-load-tracking
enable-shm-tensor-arena enable-sleep-mode enable-ssl-refresh enable-tokenizer-info-endpoint
enable-tower-connector-lora enable-trace-replay enforce-eager engram-config eplb-config
exclude-tools-when-tool-choice-none expert-placement-strategy fail-on-environ-validation fault-tolerance-config
fingerprint-mode fingerprint-value fully-sharded-loras gdn-prefill-backend generation-config gpu-memory-utilization
grpc grpc-port h11-max-header-count h11-max-incomplete-event-size headless help hf-config-path hf-overrides hf-token
host ignore-patterns interleave-mm-strings io-processor-plugin ir-op-priority jit-monitor-mode jit-monitor-verbose
kda-decode-backend kda-prefill-backend kernel-config kv-cache-dtype kv-cache-dtype-skip-layers kv-cache-memory-bytes
kv-cache-metrics kv-cache-metrics-sample kv-events-config kv-offloading-backend kv-offloading-size
kv-sharing-fast-prefill kv-transfer-config language-model-only limit-mm-per-prompt linear-backend load-format
log-config-file log-error-stack log-level logging-config logits-processors logprobs-mode
long-prefill-token-threshold long-prefill-token-threshold-adaptive lora-dtype lora-modules lora-target-modules
mamba-backend mamba-block-size mamba-cache-dtype mamba-cache-mode mamba-cache-philox-rounds mamba-ssm-cache-dtype
mamba-ssu-algorithm master-addr master-port max-cpu-loras max-cudagraph-capture-size max-log-len max-logprobs
max-lora-cls-labels max-lora-rank max-loras max-model-len max-num-active-seqs max-num-batched-tokens
max-num-queued-reqs max-num-queued-tokens max-num-scheduled-tokens max-num-seqs max-parallel-loading-workers
media-io-kwargs middleware mm-device-do-normalize mm-encoder-attn-backend mm-encoder-attn-dtype
mm-encoder-fp8-scale-path mm-encoder-fp8-scale-save-margin mm-encoder-fp8-scale-save-path mm-encoder-only
mm-encoder-tp-mode mm-hasher-algorithm mm-ipc-gpu-memory-gb mm-processor-cache-gb mm-processor-cache-type
mm-processor-device mm-processor-kwargs mm-shm-cache-max-object-size-mb mm-tensor-ipc model model-class-overrides
model-impl model-loader-extra-config moe-backend nnodes node-rank num-gpu-blocks-override numa-bind numa-bind-cpus
numa-bind-nodes offload-backend offload-group-size offload-num-in-group offload-params offload-prefetch-step
optimization-level otlp-traces-endpoint override-generation-config per-request-spec-decode-metrics performance-mode
pipeline-parallel-size pooler-config port prefill-context-parallel-size prefill-schedule-interval
prefix-cache-retention-interval prefix-caching-hash-algo prefix-match-unit profiler-config pt-load-map-location
quantization quantization-config ray-workers-use-nsight reasoning-config reasoning-parser reasoning-parser-plugin
renderer-num-workers replayssm-buffer-len response-role return-sampling-mask return-tokens-as-token-ids revision
root-path runner safetensors-load-strategy safetensors-prefetch-block-size safetensors-prefetch-num-threads
scheduler-cls scheduler-reserve-full-isl scheduling-policy seed served-model-name show-hidden-metrics-for-version
shutdown-timeout skip-mm-profiling skip-tokenizer-init sleep-mode-offload-cudagraph sleep-preserve-parameter-names
sparse-indexer-topk-backend spec-method spec-model spec-tokens specialize-active-lora speculative-config
sse-keep-alive-interval ssl-ca-certs ssl-cert-reqs ssl-certfile ssl-ciphers ssl-keyfile stream-interval
structured-outputs-config swa-bounded-replay tensor-parallel-size tokenizer tokenizer-mode tokenizer-revision
tokens-only tool-call-parser tool-parser-plugin tool-server tool-strict-level trust-remote-code
trust-request-chat-template trust-request-mm-kwargs ubatch-size uds use-fp64-gumbel use-replayssm use-tqdm-on-load
uvicorn-log-level video-pruning-method video-pruning-rate watermark watermark-config weight-transfer-config
worker-cls worker-extension-cls
""".split())

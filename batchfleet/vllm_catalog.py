"""Every flag ``vllm serve`` takes, and how many values each takes: read from the parser
of vLLM 0.34.0 (``EngineArgs.add_cli_args`` and the config dataclasses it expands,
``entrypoints/common/cli_args.py``'s ``FrontendArgs`` and ``make_arg_parser``), so a command
line is split into flags as vLLM splits it. What each flag means for a fleet is
:mod:`.vllm_flags`'s, and a test checks that every flag here has a meaning there.
``tools/vllm_catalog.py`` compares it with the parser of the vLLM installed where it runs.
"""

from __future__ import annotations

VLLM_VERSION = "0.34.0"
"""The vLLM release these flags were read from."""


def _names(text: str) -> tuple[str, ...]:
    """Flag names written a word each."""
    return tuple(text.split())


# fmt: off
BOOLEANS = _names("""
    --trust-request-chat-template --trust-request-mm-kwargs --return-tokens-as-token-ids
    --enable-auto-tool-choice --exclude-tools-when-tool-choice-none
    --enable-prompt-tokens-details --enable-per-request-metrics --enable-server-load-tracking
    --enable-force-include-usage --enable-tokenizer-info-endpoint --enable-log-outputs
    --enable-log-deltas --cohere-is-reasoning-model --log-error-stack --tokens-only
    --enable-scale-out --disable-uvicorn-access-log --allow-credentials --enable-ssl-refresh
    --enable-request-id-headers --disable-fastapi-docs --enable-offline-docs
    --enable-flash-late-interaction --trust-remote-code --allow-deprecated-quantization
    --enforce-eager --enable-return-routed-experts --return-sampling-mask --use-fp64-gumbel
    --enable-trace-replay --disable-sliding-window --disable-cascade-attn --skip-tokenizer-init
    --enable-prompt-embeds --enable-sleep-mode --sleep-mode-offload-cudagraph
    --enable-cumem-allocator --enable-nccl-comm-suspend --checkpoint-prepare-on-startup
    --use-tqdm-on-load --shuffle-safetensors-files --enable-mamba-cache-stochastic-rounding
    --numa-bind --dcp-q-replicate --data-parallel-hybrid-lb --data-parallel-external-lb
    --enable-hc-sp --enable-expert-parallel --enable-batch-sharded-sampling
    --enable-ep-weight-filter --enable-dbo --enable-shm-tensor-arena --enable-elastic-ep
    --disable-nccl-for-dp-synchronization --enable-eplb --ray-workers-use-nsight
    --disable-custom-all-reduce --enable-fault-tolerance --enable-extensible-kv-cache
    --enable-prefix-caching --kv-sharing-fast-prefill --swa-bounded-replay
    --enable-mamba-shared-prefix-checkpoint --use-replayssm --language-model-only
    --enable-mm-embeds --mm-encoder-only --interleave-mm-strings --skip-mm-profiling
    --mm-device-do-normalize --enable-lora --enable-tower-connector-lora --fully-sharded-loras
    --specialize-active-lora --enable-mixed-moe-lora-format --enable-moe-shared-loras
    --kv-cache-metrics --cudagraph-metrics --enable-layerwise-nvtx-tracing --enable-mfu-metrics
    --enable-logging-iteration-details --jit-monitor-verbose
    --long-prefill-token-threshold-adaptive --enable-chunked-prefill --disable-chunked-mm-input
    --scheduler-reserve-full-isl --disable-hybrid-kv-cache-manager --async-scheduling
    --enable-flashinfer-autotune --monokernel --fail-on-environ-validation
    --enable-log-requests
""")
"""vLLM's ``--x`` / ``--no-x`` switches (argparse's ``BooleanOptionalAction``), by the form
that turns them on; an ``--enable-x`` is also turned off by ``--disable-x``, a
``--disable-x`` also by ``--enable-x`` (vLLM's ``EnableDisableAction``)."""

STORE_TRUE = _names("""
    --headless --grpc --data-parallel-multi-port-external-lb --disable-log-stats
    --aggregate-engine-logging
""")
"""Switches with no ``--no-`` form."""

LISTS = _names("""
    --lora-modules --api-key --allowed-media-domains --served-model-name
    --sleep-preserve-parameter-names --logits-processors --ignore-patterns --numa-bind-nodes
    --numa-bind-cpus --kv-cache-dtype-skip-layers --cpu-offload-params --offload-params
    --lora-target-modules --collect-detailed-traces --cudagraph-capture-sizes
""")
"""Flags that take one value or more (``nargs="+"``)."""

OPTIONAL = ("--hf-token",)
"""Flags whose value may be left out (``nargs="?"``: ``--hf-token`` alone reads the
token Hugging Face's login stored)."""

VALUED = _names("""
    --headless-client-handshake-address --api-server-count --config --chat-template
    --chat-template-content-format --default-chat-template-kwargs --reasoning-effort-map
    --response-role --tool-call-parser --tool-parser-plugin --tool-strict-level --tool-server
    --max-log-len --sse-keep-alive-interval --cohere-format
    --anthropic-disabled-thinking-effort --fingerprint-mode --fingerprint-value --host --port
    --grpc-port --data-parallel-supervisor-port --dp-supervisor-probe-interval-s
    --dp-supervisor-probe-timeout-s --dp-supervisor-probe-failure-threshold --uds
    --uvicorn-log-level --disable-access-log-for-endpoints --allowed-origins --allowed-methods
    --allowed-headers --ssl-keyfile --ssl-certfile --ssl-ca-certs --ssl-cert-reqs --ssl-ciphers
    --root-path --middleware --h11-max-incomplete-event-size --h11-max-header-count --model
    --runner --convert --tokenizer --tokenizer-mode --dtype --seed --hf-config-path
    --allowed-local-media-path --revision --code-revision --tokenizer-revision --max-model-len
    --quantization --quantization-config --max-logprobs --logprobs-mode --config-format
    --hf-overrides --model-class-overrides --pooler-config --generation-config
    --override-generation-config --sleep-mode-backend --model-impl --io-processor-plugin
    --renderer-num-workers --load-format --download-dir --safetensors-load-strategy
    --safetensors-prefetch-num-threads --safetensors-prefetch-block-size
    --model-loader-extra-config --pt-load-map-location --attention-backend --mamba-backend
    --mamba-ssu-algorithm --mamba-cache-philox-rounds --reasoning-parser
    --reasoning-parser-plugin --distributed-executor-backend --pipeline-parallel-size
    --master-addr --master-port --nnodes --node-rank --distributed-timeout-seconds
    --cpu-distributed-timeout-seconds --device-ids --tensor-parallel-size
    --decode-context-parallel-size --dcp-comm-backend --dcp-kv-cache-interleave-size
    --cp-kv-cache-interleave-size --prefill-context-parallel-size --data-parallel-size
    --data-parallel-rank --data-parallel-start-rank --data-parallel-size-local
    --data-parallel-address --data-parallel-rpc-port --data-parallel-backend --all2all-backend
    --ubatch-size --elastic-ep-max-dp-size --dbo-decode-token-threshold --dp-sync-interval
    --dbo-prefill-token-threshold --eplb-config --expert-placement-strategy
    --max-parallel-loading-workers --worker-cls --worker-extension-cls --fault-tolerance-config
    --block-size --gpu-memory-utilization --kv-cache-memory-bytes --kv-cache-dtype
    --num-gpu-blocks-override --prefix-caching-hash-algo --prefix-cache-retention-interval
    --mamba-cache-dtype --mamba-ssm-cache-dtype --mamba-block-size --prefix-match-unit
    --mamba-cache-mode --replayssm-buffer-len --kv-offloading-size --kv-offloading-backend
    --offload-backend --cpu-offload-gb --offload-group-size --offload-num-in-group
    --offload-prefetch-step --limit-mm-per-prompt --media-io-kwargs --mm-processor-kwargs
    --mm-processor-cache-gb --mm-processor-cache-type --mm-hasher-algorithm
    --mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode --mm-encoder-attn-backend
    --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-path
    --mm-encoder-fp8-scale-save-margin --video-pruning-rate --video-pruning-method
    --mm-tensor-ipc --mm-processor-device --mm-ipc-gpu-memory-gb --max-loras --max-lora-rank
    --lora-dtype --max-cpu-loras --default-mm-loras --max-lora-cls-labels --logging-config
    --log-level --log-config-file --show-hidden-metrics-for-version --otlp-traces-endpoint
    --per-request-spec-decode-metrics --kv-cache-metrics-sample --custom-histogram-buckets
    --jit-monitor-mode --max-num-batched-tokens --max-num-scheduled-tokens --max-num-seqs
    --max-num-active-seqs --max-num-inflight-kv-loads --max-num-queued-reqs
    --max-num-queued-tokens --long-prefill-token-threshold --scheduling-policy --scheduler-cls
    --watermark --prefill-schedule-interval --cache-aware-admission-window
    --cache-aware-admission-threshold --stream-interval --max-cudagraph-capture-size
    --ir-op-priority --moe-backend --linear-backend --sparse-indexer-topk-backend
    --speculative-config --spec-method --spec-model --spec-tokens --watermark-config
    --diffusion-config --kv-transfer-config --kv-events-config --ec-transfer-config
    --ec-manager-config --compilation-config --attention-config --engram-config
    --reasoning-config --kernel-config --additional-config --structured-outputs-config
    --aux-output-config --profiler-config --watchdog-config --optimization-level
    --performance-mode --weight-transfer-config --shutdown-timeout --gdn-prefill-backend
    --kda-prefill-backend --kda-decode-backend
""")
"""Flags that take one value (``--middleware``: one each time it is given)."""

SHORT = {
    "-asc": "--api-server-count", "-q": "--quantization", "-pp": "--pipeline-parallel-size",
    "-n": "--nnodes", "-r": "--node-rank", "-tp": "--tensor-parallel-size",
    "-dcp": "--decode-context-parallel-size", "-pcp": "--prefill-context-parallel-size",
    "-dp": "--data-parallel-size", "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank", "-dpl": "--data-parallel-size-local",
    "-dpa": "--data-parallel-address", "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend", "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb", "-dpm": "--data-parallel-multi-port-external-lb",
    "-ep": "--enable-expert-parallel", "-sc": "--speculative-config",
    "-dc": "--diffusion-config", "-cc": "--compilation-config", "-ac": "--attention-config",
    "--device-memory-utilization": "--gpu-memory-utilization",
}
"""Aliases and their flags (``-O3``, ``-O=3`` and ``-O 3``, ``--optimization-level``'s, are
read by :mod:`.vllm_args`)."""

APPENDED = ("--middleware",)
"""Flags whose values add up when given again (``action="append"``); the others' last wins."""

OLDER = {"--calculate-kv-scales": 0, "--disable-frontend-multiprocessing": 0, "--enable-lora-bias": 0,
         "--kv-cache-memory": 1, "--max-seq-len-to-capture": 1, "--rope-scaling": 1, "--swap-space": 1,
         "--task": 1}
"""Flags of earlier vLLM releases (gone from 0.34) still read, and how many values each takes."""
# fmt: on


def _off_forms(flag: str) -> list[str]:
    """The forms that turn switch ``flag`` off."""
    rest = flag.removeprefix("--enable-").removeprefix("--disable-")
    inverse = {"--enable-": "--disable-", "--disable-": "--enable-"}
    return ["--no-" + flag[2:]] + [to + rest for fr, to in inverse.items() if flag.startswith(fr)]


OFF = {off: flag for flag in BOOLEANS for off in _off_forms(flag)}
"""Each switch's off form and the switch it turns off (``--no-enable-prefix-caching``,
``--disable-prefix-caching``: ``--enable-prefix-caching``)."""

ARITY: dict[str, int | str] = {
    **dict.fromkeys([*BOOLEANS, *OFF, *STORE_TRUE], 0), **dict.fromkeys(LISTS, "+"),
    **dict.fromkeys(OPTIONAL, "?"), **dict.fromkeys(VALUED, 1), **OLDER,
}  # fmt: skip
"""Every long flag read, and its values: 0, 1, ``"+"`` (one or more), ``"?"`` (none or one)."""

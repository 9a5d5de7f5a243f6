"""vLLM's engine flags (``EngineArgs``: the model, loading, KV cache, parallelism,
scheduling, compilation, LoRA, multimodal inputs, observability) that need nothing in a
fleet, and those with no equivalent, each with why (the fleet file's comments say it).

A switch's off form (``--no-x``, ``--disable-x``) that is not listed takes its switch's
judgement: see :func:`.vllm_flags.judgement`. The flags that become a setting are
:mod:`.vllm_flags`'s.
"""

from __future__ import annotations

ONE_DEVICE = "a worker serves a model on one device (more workers add replicas)"
KERNELS = "a kernel or backend choice: layers run the kernels torch and transformers pick"
MAMBA = "Mamba layers keep their state as transformers keeps it (the paged engine)"
METRICS = "vLLM's own metrics and profiling: the worker's are its Prometheus metrics " \
          "(docs/worker.md) and batchfleet trace MODEL ID"  # fmt: skip
SCHEDULER = "tunes vLLM's scheduler: the worker's is tuned by step_tokens and max_running"
LOADING = "weights load through transformers (safetensors, else PyTorch files)"
COMPILE = "vLLM's torch.compile and CUDA graphs: the worker's steps run eagerly " \
          "(options.cuda_graphs: the paged engine's, replayed)"  # fmt: skip
MEDIA_TUNING = "tunes media inputs, which text generation does not take"
MEDIA = "text generation takes text only (images, audio and video are refused)"
SLEEP = "no sleep mode: drain and stop a worker instead"
OFFLOAD = "the model's weights stay on its device"
LOGS = "vLLM's per-request log lines have no counterpart here"

# fmt: off
NEEDLESS = {
    "--enable-prefix-caching": "prefix caching is on by default (prefix_cache_tokens, the "
    "padded engine)",
    "--enforce-eager": "steps run eagerly by default (options.cuda_graphs: the paged engine only)",
    "--enable-lora": "LoRA adapters are served where lora_adapters (or a runtime load) name them",
    "--enable-chunked-prefill": "prompts are always prefilled in chunks of step_tokens",
    "--async-scheduling": "each step is planned while the one before runs "
    "(options.schedule_ahead, on by default)",
    "--enable-log-requests": "requests are followed by id: batchfleet trace MODEL ID",
    "--disable-log-stats": "statistics are Prometheus metrics, not periodic log lines",
    "--aggregate-engine-logging": "statistics are Prometheus metrics, not periodic log lines",
    "--download-dir": "the fleet loads local directories; nothing is downloaded",
    "--hf-token": "the fleet loads local directories; nothing is downloaded",
    "--use-tqdm-on-load": "no progress bar is shown while weights load",
    "--swap-space": "preempted requests are recomputed, never swapped to the CPU",
    "--allowed-local-media-path": "text generation takes text only: no media is read",
    "--allowed-media-domains": "text generation takes text only: no media is fetched",
    "--allow-deprecated-quantization": "no vLLM quantization method is used (--quantization)",
    "--disable-cascade-attn": KERNELS,
    "--model-impl": "the model runs transformers' implementation",
    "--renderer-num-workers": "chat templates are rendered on the worker's loop thread",
    "--language-model-only": "the worker serves the model's text: it takes text only",
    "--scheduling-policy": "a request's priority picks its lane (0 first, as vLLM's "
    "priority policy); without one it takes the model's default lane",
    "--stream-interval": "streamed chunks follow the fleet's deltas (one a step)",
    "--enable-fault-tolerance": "a worker that dies is replaced and the requests it held "
    "go to another (worker.claim_idle_ms)",
    "--fault-tolerance-config": "a worker that dies is replaced and the requests it held "
    "go to another (worker.claim_idle_ms)",
    "--fail-on-environ-validation": "vLLM's environment is not read (but VLLM_API_KEY and "
    "the switches from-vllm names)",
    "--prefix-caching-hash-algo": "the prefix cache keys blocks by their token ids",
    "--prefix-match-unit": "prefix cache hits land on whole blocks of page_size tokens",
    "--kv-cache-dtype-skip-layers": "the KV cache has the model's dtype in every layer",
    "--max-num-inflight-kv-loads": "no KV-connector loads: a worker prefills and decodes",
    "--enable-extensible-kv-cache": "the KV cache is sized in tokens (kv_cache_tokens), "
    "allocated when the worker starts",
    "--profiler-config": "the torch profiler routes are not served (docs/gateway.md)",
    "--watchdog-config": "no stack-dump watchdog: a stuck worker's requests go to another "
    "(worker.claim_idle_ms)",
    "--logging-config": "logging is configured by batchfleet's CLI (worker --loglevel)",
    "--log-level": "logging is configured by batchfleet's CLI (worker --loglevel)",
    "--log-config-file": "logging is configured by batchfleet's CLI (worker --loglevel)",
    **dict.fromkeys(["--specialize-active-lora",
                     "--kv-sharing-fast-prefill", "--attention-backend", "--attention-config",
                     "--kernel-config", "--ir-op-priority", "--enable-flashinfer-autotune",
                     "--monokernel", "--moe-backend", "--linear-backend",
                     "--sparse-indexer-topk-backend", "--gdn-prefill-backend",
                     "--kda-prefill-backend", "--kda-decode-backend",
                     "--disable-hybrid-kv-cache-manager", "--swa-bounded-replay",
                     "--enable-hc-sp"], KERNELS),
    **dict.fromkeys(["--mamba-backend", "--mamba-ssu-algorithm", "--mamba-cache-philox-rounds",
                     "--enable-mamba-cache-stochastic-rounding", "--mamba-cache-dtype",
                     "--mamba-ssm-cache-dtype", "--mamba-block-size", "--mamba-cache-mode",
                     "--enable-mamba-shared-prefix-checkpoint", "--replayssm-buffer-len",
                     "--use-replayssm", "--prefix-cache-retention-interval"], MAMBA),
    **dict.fromkeys(["--safetensors-load-strategy", "--safetensors-prefetch-num-threads",
                     "--safetensors-prefetch-block-size", "--model-loader-extra-config",
                     "--ignore-patterns", "--pt-load-map-location", "--shuffle-safetensors-files",
                     "--max-parallel-loading-workers"], LOADING),
    **dict.fromkeys(["--distributed-executor-backend", "--master-addr", "--master-port",
                     "--nnodes", "--node-rank", "--distributed-timeout-seconds",
                     "--cpu-distributed-timeout-seconds", "--numa-bind", "--numa-bind-nodes",
                     "--numa-bind-cpus", "--dcp-comm-backend", "--dcp-q-replicate",
                     "--dcp-kv-cache-interleave-size", "--cp-kv-cache-interleave-size",
                     "--data-parallel-rank", "--data-parallel-start-rank",
                     "--data-parallel-size-local", "--data-parallel-address",
                     "--data-parallel-rpc-port", "--data-parallel-backend",
                     "--data-parallel-hybrid-lb", "--data-parallel-external-lb",
                     "--data-parallel-multi-port-external-lb", "--enable-batch-sharded-sampling",
                     "--enable-dbo", "--enable-shm-tensor-arena", "--ubatch-size",
                     "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold",
                     "--dp-sync-interval", "--disable-nccl-for-dp-synchronization",
                     "--ray-workers-use-nsight", "--disable-custom-all-reduce"], ONE_DEVICE),
    **dict.fromkeys(["--long-prefill-token-threshold", "--long-prefill-token-threshold-adaptive",
                     "--watermark", "--prefill-schedule-interval", "--scheduler-reserve-full-isl",
                     "--cache-aware-admission-window", "--cache-aware-admission-threshold"],
                    SCHEDULER),
    **dict.fromkeys(["--compilation-config", "--optimization-level", "--performance-mode",
                     "--cudagraph-capture-sizes", "--max-cudagraph-capture-size",
                     "--max-seq-len-to-capture"], COMPILE),
    **dict.fromkeys(["--show-hidden-metrics-for-version", "--per-request-spec-decode-metrics",
                     "--kv-cache-metrics", "--kv-cache-metrics-sample", "--custom-histogram-buckets",
                     "--cudagraph-metrics", "--enable-layerwise-nvtx-tracing",
                     "--enable-mfu-metrics", "--enable-logging-iteration-details",
                     "--jit-monitor-mode", "--jit-monitor-verbose"], METRICS),
    **dict.fromkeys(["--mm-processor-cache-gb", "--mm-processor-cache-type",
                     "--mm-hasher-algorithm", "--mm-shm-cache-max-object-size-mb",
                     "--mm-encoder-tp-mode", "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype",
                     "--mm-encoder-fp8-scale-path", "--mm-encoder-fp8-scale-save-path",
                     "--mm-encoder-fp8-scale-save-margin", "--skip-mm-profiling",
                     "--video-pruning-rate", "--video-pruning-method", "--mm-tensor-ipc",
                     "--mm-processor-device", "--mm-ipc-gpu-memory-gb",
                     "--mm-device-do-normalize", "--disable-chunked-mm-input"], MEDIA_TUNING),
}
"""Engine flags that change nothing here, and why (a comment in the fleet file)."""

UNSUPPORTED = {
    "--gpu-memory-utilization": "no faithful conversion of a memory fraction: the KV cache "
    "is sized in tokens (options.kv_cache_tokens, default 16384; the 'GPU KV cache size: N "
    "tokens' of vLLM's startup log is the number to set)",
    "--trust-remote-code": "the worker loads only architectures transformers ships",
    "--revision": "the fleet loads a local directory: download that revision there",
    "--tokenizer-revision": "the tokenizer is the model directory's",
    "--code-revision": "no remote code is run",
    "--hf-config-path": "the model directory's config.json is used",
    "--max-cpu-loras": "adapters are all kept on the device (options.max_loras)",
    "--enable-lora-bias": "LoRA adapters with biases are not served",
    "--fully-sharded-loras": "no tensor parallelism: nothing to shard",
    "--lora-target-modules": "an adapter applies to the modules its adapter_config.json names",
    "--enable-mixed-moe-lora-format": "adapters apply to linear layers (PEFT's), not to "
    "fused MoE experts",
    "--enable-moe-shared-loras": "adapters apply to linear layers (PEFT's), not to fused "
    "MoE experts",
    "--max-lora-cls-labels": "the text-classification runner serves no LoRA adapters",
    "--cpu-offload-gb": OFFLOAD,
    "--enable-sleep-mode": SLEEP,
    "--kv-transfer-config": "no disaggregated prefill: a worker prefills and decodes",
    "--kv-events-config": "KV-cache events are not published",
    "--ec-transfer-config": "no disaggregated encoders: text generation takes text only",
    "--ec-manager-config": "no disaggregated encoders: text generation takes text only",
    "--kv-offloading-size": "the KV cache stays on the device (no CPU offloading)",
    "--kv-offloading-backend": "the KV cache stays on the device (no CPU offloading)",
    "--rope-scaling": "the model's config.json is used as it is: edit it there",
    "--hf-overrides": "the model's config.json is used as it is: edit it there",
    "--model-class-overrides": "the model class is the one transformers picks for its "
    "config.json",
    "--quantization-config": "the worker loads weights through transformers, without "
    "vLLM's quantization kernels",
    "--calculate-kv-scales": "the KV cache has the model's dtype (no quantized KV cache)",
    "--enable-return-routed-experts": "routed experts are not returned",
    "--return-sampling-mask": "sampling masks are not returned",
    "--use-fp64-gumbel": "tokens are drawn by the worker's own sampler (no float64 Gumbel "
    "noise)",
    "--enable-trace-replay": "a request cannot force the tokens it decodes",
    "--disable-sliding-window": "a sliding-window model keeps its window (the paged engine)",
    "--logits-processors": "no custom logits processors: sampling takes the request's fields",
    "--io-processor-plugin": "no IO processor plugins",
    "--reasoning-parser-plugin": "reasoning parsers are the fleet's built-in ones",
    "--enable-expert-parallel": "expert parallelism: " + ONE_DEVICE,
    "--enable-eplb": "expert parallelism: " + ONE_DEVICE,
    "--eplb-config": "expert parallelism: " + ONE_DEVICE,
    "--enable-elastic-ep": "expert parallelism: " + ONE_DEVICE,
    "--elastic-ep-max-dp-size": "expert parallelism: " + ONE_DEVICE,
    "--enable-ep-weight-filter": "expert parallelism: " + ONE_DEVICE,
    "--all2all-backend": "expert parallelism: " + ONE_DEVICE,
    "--expert-placement-strategy": "expert parallelism: " + ONE_DEVICE,
    "--worker-cls": "no custom vLLM worker classes",
    "--worker-extension-cls": "no custom vLLM worker classes",
    "--scheduler-cls": "no custom scheduler classes: the worker's scheduler plans each step",
    "--max-num-scheduled-tokens": "no bound below step_tokens (--max-num-batched-tokens) "
    "on a step's tokens",
    "--max-num-queued-tokens": "lanes are bounded in requests (max_queue_depth), not in "
    "prompt tokens",
    "--otlp-traces-endpoint": "no OpenTelemetry traces: follow a request with batchfleet "
    "trace MODEL ID",
    "--collect-detailed-traces": "no OpenTelemetry traces: follow a request with batchfleet "
    "trace MODEL ID",
    "--skip-tokenizer-init": "the worker detokenizes what it generates",
    "--enable-prompt-embeds": "prompts are text or token ids",
    "--watermark-config": "outputs are not watermarked",
    "--diffusion-config": "from-vllm writes a text-generation model (no diffusion models)",
    "--engram-config": "no n-gram embedding tables (Engram)",
    "--aux-output-config": "no auxiliary outputs of the model's execution",
    "--additional-config": "vLLM platform plugins' settings",
    "--weight-transfer-config": "no weight updates while serving: restart workers on new "
    "weights",
    **dict.fromkeys(["--sleep-mode-backend", "--sleep-mode-offload-cudagraph",
                     "--sleep-preserve-parameter-names", "--enable-cumem-allocator",
                     "--enable-nccl-comm-suspend", "--checkpoint-prepare-on-startup"], SLEEP),
    **dict.fromkeys(["--offload-backend", "--cpu-offload-params", "--offload-group-size",
                     "--offload-num-in-group", "--offload-prefetch-step", "--offload-params"],
                    OFFLOAD),
    **dict.fromkeys(["--limit-mm-per-prompt", "--enable-mm-embeds", "--media-io-kwargs",
                     "--mm-processor-kwargs", "--interleave-mm-strings", "--mm-encoder-only",
                     "--default-mm-loras", "--enable-tower-connector-lora"], MEDIA),
}
"""Engine flags with no equivalent here, and why (listed; the fleet file goes on without
them)."""

BY_VALUE = {
    "--tokenizer-mode": (("auto", "hf"), "the model directory's tokenizer, through transformers",
                         "the tokenizer is the model directory's, through transformers"),
    "--config-format": (("auto", "hf"), "the model directory's config.json",
                        "the model's config is read as transformers reads it (config.json)"),
    "--load-format": (("auto", "safetensors", "pt", "gguf"), LOADING, LOADING),
    "--lora-dtype": (("auto",), "adapters take the model's dtype",
                     "adapters take the model's dtype"),
    "--max-logprobs": (("20",), "a token lists up to 20 log-probabilities, as here",
                       "a token lists up to 20 log-probabilities here"),
    "--logprobs-mode": (("raw_logprobs",), "log-probabilities are the model's own, before "
                        "the sampling rules and temperature, as vLLM's default",
                        "log-probabilities are the model's own, before the sampling rules and "
                        "temperature (raw_logprobs)"),
}
"""Engine flags whose values in the first part change nothing here (and why), and why the
others have no equivalent."""
# fmt: on

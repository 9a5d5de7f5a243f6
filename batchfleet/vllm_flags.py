"""vLLM's ``serve`` flags as a fleet sees them: those that are one text-generation option
each, those that need nothing here, and those with no equivalent (and why).

The flags that need more than a table row are :mod:`.from_vllm`'s handlers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SimpleOption = tuple[str, Callable[[str], Any]]
"""An option's name and how the flag's value becomes its value."""

DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
          "float": "float32", "float32": "float32"}  # fmt: skip
"""vLLM's ``--dtype`` values and the fleet's."""


def _count(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError(f"{value} is not a positive integer")
    return n


def simple_options() -> dict[str, SimpleOption]:
    """Flags that set one text-generation option."""
    return {
        "--max-num-seqs": ("max_running", _count),
        "--max-num-batched-tokens": ("step_tokens", _count),
        "--block-size": ("page_size", _count),
        "--max-loras": ("max_loras", _count),
    }


NEEDLESS = {
    "--enable-prefix-caching": "prefix caching is on by default (prefix_cache_tokens, the "
    "padded engine)",
    "--enforce-eager": "steps run eagerly by default (options.cuda_graphs: the paged engine only)",
    "--enable-auto-tool-choice": 'tool_choice "auto" is served where tool_call_parser is set',
    "--enable-lora": "LoRA adapters are served where lora_adapters (or a runtime load) name them",
    "--enable-chunked-prefill": "prompts are always prefilled in chunks of step_tokens",
    "--async-scheduling": "each step is planned while the one before runs "
    "(options.schedule_ahead, on by default)",
    "--disable-log-requests": "vLLM's per-request log lines have no counterpart here",
    "--enable-log-requests": "requests are followed by id: batchfleet trace MODEL ID",
    "--disable-log-stats": "statistics are Prometheus metrics, not periodic log lines",
    "--uvicorn-log-level": "the gateway is not uvicorn; its log level is the CLI's (INFO)",
    "--disable-uvicorn-access-log": "the gateway is not uvicorn (no access log)",
    "--disable-fastapi-docs": "the gateway serves no OpenAPI docs pages",
    "--disable-frontend-multiprocessing": "the gateway is one process apart from the workers",
    "--api-server-count": "run more gateways: any of them serves any request",
    "--load-format": "weights load through transformers (safetensors, else PyTorch files)",
    "--download-dir": "the fleet loads local directories; nothing is downloaded",
    "--max-log-len": "the gateway does not log prompts",
    "--use-tqdm-on-load": "no progress bar is shown while weights load",
    "--no-use-tqdm-on-load": "no progress bar is shown while weights load",
    "--swap-space": "preempted requests are recomputed, never swapped to the CPU",
    "--enable-server-load-tracking": "the gateway's metrics show the requests in flight",
}
"""Flags that change nothing here, and why (a comment in the fleet file)."""

UNSUPPORTED = {
    "--gpu-memory-utilization": "no faithful conversion of a memory fraction: the KV cache "
    "is sized in tokens (options.kv_cache_tokens, default 16384; the 'GPU KV cache size: N "
    "tokens' of vLLM's startup log is the number to set)",
    "--trust-remote-code": "the worker loads only architectures transformers ships",
    "--chat-template": "the tokenizer's own chat template is used: put the template in "
    "the model directory (chat_template.jinja)",
    "--chat-template-content-format": "messages' content is passed as the template takes it",
    "--seed": "no fleet-wide seed: a request's seed field seeds its sampling",
    "--revision": "the fleet loads a local directory: download that revision there",
    "--tokenizer-revision": "the tokenizer is the model directory's",
    "--code-revision": "no remote code is run",
    "--tokenizer-mode": "the model directory's (fast) tokenizer is used",
    "--max-cpu-loras": "adapters are all kept on the device (options.max_loras)",
    "--enable-lora-bias": "LoRA adapters with biases are not served",
    "--fully-sharded-loras": "no tensor parallelism: nothing to shard",
    "--lora-dtype": "adapters take the model's dtype",
    "--enable-expert-parallel": "a worker serves a model on one device",
    "--cpu-offload-gb": "the model's weights stay on its device",
    "--enable-sleep-mode": "no sleep mode: drain and stop a worker instead",
    "--kv-transfer-config": "no disaggregated prefill: a worker prefills and decodes",
    "--kv-events-config": "KV-cache events are not published",
    "--compilation-config": "no torch.compile or vLLM compilation config",
    "--rope-scaling": "the model's config.json is used as it is: edit it there",
    "--hf-overrides": "the model's config.json is used as it is: edit it there",
    "--root-path": "the gateway serves at the root: strip a prefix in a proxy",
    "--ssl-keyfile": "the gateway speaks plain HTTP: terminate TLS in front of it",
    "--ssl-certfile": "the gateway speaks plain HTTP: terminate TLS in front of it",
    "--ssl-ca-certs": "the gateway speaks plain HTTP: terminate TLS in front of it",
    "--allowed-origins": "no CORS headers: add them in a proxy",
    "--allowed-methods": "no CORS headers: add them in a proxy",
    "--allowed-headers": "no CORS headers: add them in a proxy",
    "--allow-credentials": "no CORS headers: add them in a proxy",
    "--middleware": "the gateway takes no ASGI middleware",
    "--tool-parser-plugin": "tool parsers are the fleet's built-in ones",
    "--reasoning-parser-plugin": "reasoning parsers are the fleet's built-in ones",
    "--limit-mm-per-prompt": "text generation takes text only",
    "--distributed-executor-backend": "a worker serves a model on one device",
    "--num-gpu-blocks-override": "the KV cache is sized in tokens (options.kv_cache_tokens)",
    "--max-seq-len-to-capture": "no CUDA graphs of the padded engine",
    "--enable-prompt-embeds": "prompts are text or token ids",
    "--skip-tokenizer-init": "the worker detokenizes what it generates",
    "--headless": "a worker has no HTTP front; the gateway is a separate process",
}
"""Flags with no equivalent here, and why (listed; the fleet file goes on without them)."""

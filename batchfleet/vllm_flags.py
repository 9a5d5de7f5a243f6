"""vLLM's ``serve`` flags as a fleet sees them: what each becomes (a model setting or
option, a gateway flag), those that need nothing here, and those with no equivalent (and
why), into a :class:`Conversion` that :mod:`.from_vllm` writes as a fleet file.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .vllm_args import Flag

MAX_LORA_RANK = 512  # worker.generation.lora.MAX_RANK (not imported: it imports torch)
MAX_TOKENS = 65_536  # ModelConfig.max_tokens' bound
MAX_NEW_TOKENS = 1_000_000  # Limits.max_new_tokens' bound
MAX_TEXT_CHARS = 1_000_000  # Limits.max_text_chars' bound
MAX_ENTRY_BYTES = 8 * 1_048_576  # a request of MAX_TEXT_CHARS in UTF-8, and the rest

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
    "--hf-token": "the fleet loads local directories; nothing is downloaded",
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


@dataclass(frozen=True, slots=True)
class Line:
    """One ``key = value`` of the fleet file and the vLLM flag it came from."""

    key: str
    value: Any
    source: str


@dataclass(slots=True)
class Conversion:
    """What a ``vllm serve`` command line becomes."""

    name: str
    model: list[Line] = field(default_factory=list)
    options: list[Line] = field(default_factory=list)
    adapters: list[Line] = field(default_factory=list)
    limits: list[Line] = field(default_factory=list)
    gateway: list[tuple[str, ...]] = field(default_factory=list)
    needless: list[str] = field(default_factory=list)
    """``flag: why nothing is needed``."""
    unsupported: list[str] = field(default_factory=list)
    """``flag: why it has no equivalent``."""
    unknown: list[str] = field(default_factory=list)

    def option(self, flag: Flag, key: str, value: Any) -> None:
        self.options = [ln for ln in self.options if ln.key != key]
        self.options.append(Line(key, value, flag.shown()))

    def judged(self, flag: Flag, needless: bool, why: str) -> None:
        """``flag`` listed as needing nothing here (``needless``) or as having no
        equivalent, with ``why``."""
        (self.needless if needless else self.unsupported).append(f"{flag.shown()}: {why}")

    def gateway_command(self, fleet_path: str, *, secret: bool) -> str:
        """The ``batchfleet gateway`` command; without ``secret``, an API key is left to
        ``$BATCHFLEET_API_KEY`` (a fleet file is no place for it)."""
        argv = ["batchfleet", "gateway", "--config", fleet_path]
        hidden = False
        for args in self.gateway:
            if args[0] == "--api-key" and not secret:
                hidden = True
            else:
                argv += args
        return shlex.join(argv) + (_ENV_KEY if hidden else "")


_ENV_KEY = "  # and BATCHFLEET_API_KEY=<vLLM's --api-key> in its environment"


def _dtype(flag: Flag, out: Conversion) -> None:
    if flag.value not in DTYPES:
        raise ValueError(f"the fleet takes {', '.join(sorted(DTYPES))}")
    out.model.append(Line("dtype", DTYPES[flag.value], flag.shown()))


def _max_model_len(flag: Flag, out: Conversion) -> None:
    n = _count(flag.value)
    prompt = min(n - 1, MAX_TOKENS)
    why = "prompts longer are refused, as vLLM's; a sequence's whole length is bounded by " \
          "the model's positions and kv_cache_tokens"  # fmt: skip
    if n - 1 > MAX_TOKENS:
        why += f" (the fleet bounds prompts at {MAX_TOKENS} tokens)"
    out.model.append(Line("max_tokens", max(prompt, 1), f"{flag.shown()}: {why}"))
    out.limits.append(Line("max_new_tokens", max(min(n - 1, MAX_NEW_TOKENS), 1),
                           f"{flag.shown()}: a request asks for fewer new tokens"))  # fmt: skip


def lengths(out: Conversion) -> None:
    """What vLLM bounds only by the model's context, bounded here as loosely as the fleet
    allows (the runner bounds each sequence by the context): prompt and new tokens, where
    ``--max-model-len`` did not; and prompts' characters and bytes, which vLLM does not
    count (the fleet's defaults refuse prompts past 20,000 characters)."""
    if not any(ln.key == "max_tokens" for ln in out.model):
        out.model.append(Line("max_tokens", MAX_TOKENS, "no --max-model-len: prompts up to "
                              "the model's context, as vLLM's"))  # fmt: skip
        out.limits.append(Line("max_new_tokens", MAX_TOKENS, "no --max-model-len: up to the "
                               "model's context, as vLLM's"))  # fmt: skip
    why = "prompts are bounded in tokens (max_tokens), as vLLM's: this only guards decoding"
    out.limits.append(Line("max_text_chars", MAX_TEXT_CHARS, why))
    out.limits.append(Line("max_entry_bytes", MAX_ENTRY_BYTES, why))


def _served_names(flag: Flag, out: Conversion) -> None:
    for extra in flag.values[1:]:
        out.unsupported.append(f"--served-model-name {extra}: a model has one name in a "
                               f"fleet ({out.name!r})")  # fmt: skip


def _prefix_off(flag: Flag, out: Conversion) -> None:
    out.option(flag, "prefix_cache_tokens", 0)


def _speculative(flag: Flag, out: Conversion) -> None:
    raw = json.loads(flag.value)
    if not isinstance(raw, dict):
        raise ValueError("a JSON object")
    from .worker.generation.speculative import parse

    parse(raw)  # a ValueError names what the fleet does not take (method, keys)
    out.option(flag, "speculative", raw)


def _reasoning_config(flag: Flag, out: Conversion) -> None:
    raw = json.loads(flag.value)
    from .worker.generation.think_budget import markers

    markers(raw, None, (), lambda text: [0])  # the runner's own check of the table
    out.option(flag, "reasoning_config", raw)


def _tool_parser(flag: Flag, out: Conversion) -> None:
    from .worker.generation.tools import PARSERS

    if flag.value not in PARSERS:
        raise ValueError(f"the fleet reads {', '.join(PARSERS)}")
    out.option(flag, "tool_call_parser", flag.value)


def _reasoning_parser(flag: Flag, out: Conversion) -> None:
    from .worker.generation.reasoning import REASONING_PARSERS

    if flag.value not in REASONING_PARSERS:
        raise ValueError(f"the fleet splits {', '.join(REASONING_PARSERS)}")
    out.option(flag, "reasoning_parser", flag.value)


def _lora_modules(flag: Flag, out: Conversion) -> None:
    """``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``, each."""
    for item in flag.values:
        if item.lstrip().startswith("{"):
            raw = json.loads(item)
            if not isinstance(raw, dict) or not {"name", "path"} <= set(raw):
                raise ValueError(f"{item}: a JSON object with name and path")
            name, path = str(raw["name"]), str(raw["path"])
        else:
            name, eq, path = item.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"{item}: name=path or a JSON object")
        out.adapters = [a for a in out.adapters if a.key != name]
        out.adapters.append(Line(name, path, f"--lora-modules {item}"))


def _max_lora_rank(flag: Flag, out: Conversion) -> None:
    rank = _count(flag.value)
    if rank > MAX_LORA_RANK:
        raise ValueError(f"the fleet serves LoRA ranks up to {MAX_LORA_RANK}")
    out.option(flag, "max_lora_rank", rank)


def _kv_cache_bytes(flag: Flag, out: Conversion) -> None:
    """KV-cache bytes to tokens, where the model's config.json is here to size a token."""
    size = _count(flag.value)
    path = next((ln.value for ln in out.model if ln.key == "path"), "")
    per_token = _kv_bytes_per_token(Path(path), out)
    if per_token is None:
        out.unsupported.append(f"{flag.shown()}: kv_cache_tokens counts tokens, and this "
                               "model's config.json is not here to size one: set "
                               "kv_cache_tokens yourself")  # fmt: skip
        return
    out.option(flag, "kv_cache_tokens", max(size // per_token, 1))


def _kv_bytes_per_token(path: Path, out: Conversion) -> int | None:
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    dtype = next((ln.value for ln in out.model if ln.key == "dtype"), "auto")
    width = 4 if dtype == "float32" else 2  # auto: 16-bit on a GPU
    return 2 * layers * kv_heads * head_dim * width


def _generation_config(flag: Flag, out: Conversion) -> None:
    """``auto`` (vLLM's default) and a folder: the option; ``vllm``: the fleet's default."""
    if flag.value == "vllm":
        out.needless.append(f"{flag.shown()}: no sampling defaults from a generation config "
                            "(the fleet's default, generation_config = \"vllm\")")  # fmt: skip
    else:
        out.option(flag, "generation_config", flag.value)


def generation_defaults(given: bool, out: Conversion) -> None:
    """Without ``--generation-config``, vLLM takes the model's (``auto``): so does the fleet
    file (the fleet's own default is ``vllm``: none)."""
    if not given:
        out.options.append(Line("generation_config", "auto", "no --generation-config: vLLM's "
                                "default takes the model's sampling defaults"))  # fmt: skip


def _override_generation(flag: Flag, out: Conversion) -> None:
    """vLLM's keys (:data:`..worker.generation.defaults.KEYS`) to the option, checked as
    the runner checks them; any other key vLLM ignores: listed as having no equivalent."""
    from .worker.generation.defaults import KEYS, checked

    raw = json.loads(flag.value)
    if not isinstance(raw, dict):
        raise ValueError("a JSON object")
    taken = {k: v for k, v in raw.items() if k in KEYS}
    for key in raw.keys() - taken.keys():
        out.unsupported.append(f"--override-generation-config {key}: not a sampling default "
                               f"vLLM takes ({', '.join(KEYS)})")  # fmt: skip
    if taken:
        out.option(flag, "override_generation_config", checked(taken, flag.name))


def _parallel(flag: Flag, out: Conversion) -> None:
    size = _count(flag.value)
    if size > 1 and flag.name == "--data-parallel-size":
        out.judged(flag, True, f"run {size} workers with this fleet file (each serves the "
                   "model; requests are shared through Redis)")  # fmt: skip
    else:
        out.judged(flag, size == 1, "one device per worker, as here" if size == 1 else
                   "a worker serves a model on one device (no tensor or pipeline "
                   "parallelism); more workers add replicas")  # fmt: skip


def _quantization(flag: Flag, out: Conversion) -> None:
    gguf = flag.value == "gguf" and any(ln.key == "gguf_file" for ln in out.options)
    out.judged(flag, gguf, "the model is a GGUF file (gguf_file)" if gguf else "the worker "
               "loads weights through transformers, without vLLM's quantization kernels (a "
               "GGUF file is dequantized; a pre-quantized checkpoint is untested)")  # fmt: skip


def _tokenizer(flag: Flag, out: Conversion) -> None:
    path = next(ln.value for ln in out.model if ln.key == "path")
    own = flag.value.rstrip("/") == str(path).rstrip("/")
    out.judged(flag, own, "the model's own tokenizer" if own else "the tokenizer is loaded "
               "from the model's directory (or GGUF file): copy its files there")  # fmt: skip


def _kv_cache_dtype(flag: Flag, out: Conversion) -> None:
    auto = flag.value == "auto"
    out.judged(flag, auto, "the KV cache has the model's dtype" + ("" if auto else
               " (no quantized KV cache)"))  # fmt: skip


def _gateway_value(flag: Flag, out: Conversion) -> None:
    if flag.name == "--port" and not 0 <= int(flag.value) <= 65_535:
        raise ValueError("not a TCP port")
    out.gateway.append((flag.name, flag.value))


def _gateway_switch(flag: Flag, out: Conversion) -> None:
    out.gateway.append((flag.name,))


HANDLERS = {
    "--dtype": _dtype, "--max-model-len": _max_model_len,
    "--served-model-name": _served_names, "--no-enable-prefix-caching": _prefix_off,
    "--speculative-config": _speculative, "--reasoning-config": _reasoning_config,
    "--tool-call-parser": _tool_parser, "--reasoning-parser": _reasoning_parser,
    "--lora-modules": _lora_modules, "--max-lora-rank": _max_lora_rank,
    "--kv-cache-memory-bytes": _kv_cache_bytes, "--kv-cache-memory": _kv_cache_bytes,
    "--generation-config": _generation_config,
    "--override-generation-config": _override_generation,
    "--tensor-parallel-size": _parallel, "--pipeline-parallel-size": _parallel,
    "--data-parallel-size": _parallel, "--quantization": _quantization,
    "--tokenizer": _tokenizer, "--kv-cache-dtype": _kv_cache_dtype, "--host": _gateway_value, "--port": _gateway_value,
    "--api-key": _gateway_value, "--return-tokens-as-token-ids": _gateway_switch,
}  # fmt: skip

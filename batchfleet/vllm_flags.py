"""vLLM's ``serve`` flags as a fleet sees them: what each becomes (a model setting or
option, a gateway flag: the handlers here and :mod:`.vllm_scheduling`'s), or why it needs
nothing here or has no equivalent (:mod:`.vllm_engine_flags`, :mod:`.vllm_server_flags`),
into a :class:`Conversion` that :mod:`.from_vllm` writes as a fleet file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import vllm_engine_flags, vllm_server_flags
from .vllm_args import Flag
from .vllm_catalog import OFF
from .vllm_conversion import Conversion, Line, count, token_count
from .vllm_pooling import POOLING_FLAGS, encoder_length, is_pooling
from .vllm_scheduling import SCHEDULING
from .vllm_serving import SERVING

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

NEEDLESS = {**vllm_engine_flags.NEEDLESS, **vllm_server_flags.NEEDLESS}
"""Flags that change nothing here, and why."""
UNSUPPORTED = {**vllm_engine_flags.UNSUPPORTED, **vllm_server_flags.UNSUPPORTED}
"""Flags with no equivalent here, and why."""
BY_VALUE = {**vllm_engine_flags.BY_VALUE, **vllm_server_flags.BY_VALUE}
"""Flags whose values in the first part change nothing here (the second part says why),
the others having no equivalent (the third part says why)."""

ORDER = {"--dtype": -3, "--block-size": -2, "--kv-cache-dtype": -2, "--speculative-config": -1,
         "--num-gpu-blocks-override": 1, "--max-num-active-seqs": 1}  # fmt: skip
"""Flags read before the others (what those use: the dtype sizes a KV token) or after
(what overrides another: vLLM's block count over its KV bytes)."""


def rank(flag: Flag) -> int:
    """Where ``flag`` is read among the others (a sort key: see :data:`ORDER`)."""
    return ORDER.get(flag.name, 0)


def simple_options() -> dict[str, SimpleOption]:
    """Flags that set one text-generation option."""
    return {
        "--max-num-seqs": ("max_running", count),
        "--max-num-batched-tokens": ("step_tokens", token_count),
        "--block-size": ("page_size", count),
        "--max-loras": ("max_loras", count),
    }


def judgement(name: str) -> tuple[bool, str] | None:
    """Whether flag ``name`` needs nothing here (True) or has no equivalent (False), and
    why; None where neither (a flag that becomes a setting, or one not known). A switch's
    off form not listed needs nothing where its switch has no equivalent (the fleet does
    not do it either), and is judged as its switch where that needs nothing."""
    if name in NEEDLESS or name in UNSUPPORTED:
        return name in NEEDLESS, NEEDLESS.get(name) or UNSUPPORTED[name]
    on = OFF.get(name, "")
    if on in UNSUPPORTED:
        return True, f"{on} is off, as here ({UNSUPPORTED[on]})"
    return (True, NEEDLESS[on]) if on in NEEDLESS else None


def _dtype(flag: Flag, out: Conversion) -> None:
    if flag.value not in DTYPES:
        raise ValueError(f"the fleet takes {', '.join(sorted(DTYPES))}")
    out.model.append(Line("dtype", DTYPES[flag.value], flag.shown()))


def _max_model_len(flag: Flag, out: Conversion) -> None:
    if flag.value.strip().lower() in ("auto", "-1"):  # vLLM: as long as the KV cache fits
        out.judged(flag, True, "up to the model's context, as here")
        return
    if is_pooling(out):
        encoder_length(flag, out)
        return
    n = token_count(flag.value)
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


def _reasoning_parser(flag: Flag, out: Conversion, parser: str | None = None) -> None:
    from .worker.generation.reasoning import REASONING_PARSERS

    parser = flag.value if parser is None else parser
    if parser not in REASONING_PARSERS:
        raise ValueError(f"the fleet splits {', '.join(REASONING_PARSERS)}")
    out.option(flag, "reasoning_parser", parser)


def _structured_outputs(flag: Flag, out: Conversion) -> None:
    """vLLM's ``StructuredOutputsConfig`` JSON: its ``reasoning_parser`` as the flag's;
    its ``backend``: the worker's own grammar engine; any other key: listed."""
    raw = json.loads(flag.value)
    if not isinstance(raw, dict):
        raise ValueError("a JSON object")
    for key, value in raw.items():
        if key == "reasoning_parser" and value:
            _reasoning_parser(flag, out, str(value))
        elif key in ("backend", "reasoning_parser"):
            out.needless.append(f"{flag.name} {key}: structured outputs are constrained by "
                                "the worker's own grammar engine")  # fmt: skip
        else:
            out.unsupported.append(f"{flag.name} {key}: structured outputs are constrained "
                                   "by the worker's own grammar engine, as it is")  # fmt: skip


def _chat_template(flag: Flag, out: Conversion) -> None:
    """The four chat template flags to their options (the template itself, a path or
    inline, as vLLM reads it where the worker runs), checked as the runner checks them."""
    from .worker.generation.chat_template import JINJA_CHARS, ChatTemplates

    key = flag.name.removeprefix("--").replace("-", "_")
    value: Any = True if flag.name == "--trust-request-chat-template" else flag.value
    if flag.name == "--default-chat-template-kwargs":
        value = json.loads(flag.value)
    if flag.name != "--chat-template" or any(c in flag.value for c in JINJA_CHARS):
        ChatTemplates.from_options({key: value})  # (a file is read where the worker runs)
    out.option(flag, key, value)


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
    r = count(flag.value)
    if r > MAX_LORA_RANK:
        raise ValueError(f"the fleet serves LoRA ranks up to {MAX_LORA_RANK}")
    out.option(flag, "max_lora_rank", r)


def _kv_cache_bytes(flag: Flag, out: Conversion) -> None:
    """KV-cache bytes to tokens, where the model's config.json is here to size a token."""
    size = token_count(flag.value)
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
    kv = out.setting("kv_cache_dtype")
    width = 4 if dtype == "float32" and kv is None else 2  # auto: 16-bit on a GPU
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


def _seed(flag: Flag, out: Conversion) -> None:
    """The seed of the sampling of requests without one (``options.seed``); a pooling
    model samples nothing."""
    if is_pooling(out):
        out.judged(flag, True, "a pooling model samples nothing")
        return
    seed = int(flag.value)
    if not 0 <= seed < 2**63:
        raise ValueError("the fleet takes seeds 0 … 2**63 - 1")
    out.option(flag, "seed", seed)


def seed_default(given: bool, out: Conversion) -> None:
    """Without ``--seed``, vLLM seeds with 0: so does the fleet file (the fleet's own
    default is none: a random seed per sampled request without one)."""
    if not given:
        out.options.append(Line("seed", 0, "no --seed: vLLM's default seeds the sampling of "
                                "requests without a seed with 0"))  # fmt: skip


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
    size = count(flag.value)
    if size > 1 and flag.name == "--data-parallel-size":
        out.judged(flag, True, f"run {size} workers with this fleet file (each serves the "
                   "model; requests are shared through Redis)")  # fmt: skip
        out.gateway.append((flag.name, str(size)))  # its fingerprint's dpN, as vLLM's
    else:
        out.judged(flag, size == 1, "one device per worker, as here" if size == 1 else
                   "a worker serves a model on one device (no tensor, pipeline or context "
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
    """``auto`` or the model's own dtype (``--dtype``) need nothing; ``bfloat16`` is the
    option (the padded engine keeps its cache in it); another (fp8) has none."""
    dtype = out.setting("dtype")
    same = flag.value == "auto" or (dtype is not None and DTYPES.get(flag.value) == dtype.value)
    if not same and flag.value == "bfloat16":
        out.option(flag, "kv_cache_dtype", "bfloat16")
        return
    out.judged(flag, same, "the KV cache has the model's dtype" + ("" if same else
               " or bfloat16 (no quantized KV cache)"))  # fmt: skip


def _gateway_value(flag: Flag, out: Conversion) -> None:
    if flag.name == "--port" and not 0 <= int(flag.value) <= 65_535:
        raise ValueError("not a TCP port")
    out.gateway.append((flag.name, flag.value))


def _api_keys(flag: Flag, out: Conversion) -> None:
    """vLLM takes several keys; the gateway one (the first)."""
    out.gateway.append((flag.name, flag.values[0]))
    if len(flag.values) > 1:
        out.unsupported.append(f"--api-key: {len(flag.values) - 1} more keys: the gateway "
                               "takes one (the first)")  # fmt: skip


def _gateway_switch(flag: Flag, out: Conversion) -> None:
    out.gateway.append((flag.name,))


def _by_value(flag: Flag, out: Conversion) -> None:
    """:data:`BY_VALUE`'s flags: some values need nothing here, the others have no
    equivalent."""
    values, needless_why, unsupported_why = BY_VALUE[flag.name]
    out.judged(flag, flag.value in values, needless_why if flag.value in values else
               unsupported_why)  # fmt: skip


HANDLERS: dict[str, Callable[[Flag, Conversion], None]] = {
    "--dtype": _dtype, "--max-model-len": _max_model_len,
    "--served-model-name": _served_names, "--no-enable-prefix-caching": _prefix_off,
    "--disable-prefix-caching": _prefix_off, "--reasoning-config": _reasoning_config,
    "--tool-call-parser": _tool_parser, "--reasoning-parser": _reasoning_parser,
    "--structured-outputs-config": _structured_outputs,
    "--lora-modules": _lora_modules, "--max-lora-rank": _max_lora_rank,
    **dict.fromkeys(["--chat-template", "--default-chat-template-kwargs",
                     "--trust-request-chat-template", "--chat-template-content-format"],
                    _chat_template),
    "--kv-cache-memory-bytes": _kv_cache_bytes, "--kv-cache-memory": _kv_cache_bytes,
    "--generation-config": _generation_config, "--seed": _seed,
    "--override-generation-config": _override_generation,
    "--tensor-parallel-size": _parallel, "--pipeline-parallel-size": _parallel,
    "--data-parallel-size": _parallel, "--decode-context-parallel-size": _parallel,
    "--prefill-context-parallel-size": _parallel, "--quantization": _quantization,
    "--tokenizer": _tokenizer, "--kv-cache-dtype": _kv_cache_dtype, "--host": _gateway_value,
    "--port": _gateway_value, "--api-key": _api_keys,
    "--return-tokens-as-token-ids": _gateway_switch,
    **dict.fromkeys(BY_VALUE, _by_value), **SCHEDULING, **SERVING, **POOLING_FLAGS,
}  # fmt: skip
"""Flags that become settings (or are judged by their value), and how."""

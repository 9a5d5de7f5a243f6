"""``batchfleet from-vllm``: a ``vllm serve`` command line turned into a fleet file and the
``batchfleet gateway`` command serving the same API.

Each flag goes to a model setting or option (the fleet file's line cites it), to a gateway
flag, to nothing (it changes nothing here: a comment says why), or is listed as having
no equivalent, with why. A flag this converter does not know is an error unless
``keep_going`` (then a comment names it). The fleet file is checked by the fleet loader
and the text-generation options by the runner's own tables before it is written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .vllm_args import Flag, ServeArgs, VllmArgsError, read_serve
from .vllm_flags import DTYPES, NEEDLESS, UNSUPPORTED, SimpleOption, simple_options

MAX_LORA_RANK = 512  # worker.generation.lora.MAX_RANK (not imported: it imports torch)
MAX_TOKENS = 65_536  # ModelConfig.max_tokens' bound
ENV_SWITCHES = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "--allow-runtime-lora-updating",
                "VLLM_SERVER_DEV_MODE": "--server-dev-mode"}  # fmt: skip
"""vLLM's environment switches with a gateway flag."""


class ConversionError(ValueError):
    """The command line cannot become a fleet that starts (a bad value, unknown flags)."""


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
    gateway: list[tuple[str, ...]] = field(default_factory=list)
    needless: list[str] = field(default_factory=list)
    """``flag: why nothing is needed``."""
    unsupported: list[str] = field(default_factory=list)
    """``flag: why it has no equivalent``."""
    unknown: list[str] = field(default_factory=list)

    def option(self, flag: Flag, key: str, value: Any) -> None:
        self.options = [ln for ln in self.options if ln.key != key]
        self.options.append(Line(key, value, flag.shown()))

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


def convert(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Conversion:
    """``argv`` (a ``vllm serve`` command line, ``env`` its environment) converted; a
    :class:`ConversionError` where it names no model or a value would not start."""
    try:
        serve = read_serve(argv, {*simple_options(), *HANDLERS, *NEEDLESS, *UNSUPPORTED})
    except VllmArgsError as exc:
        raise ConversionError(str(exc)) from None
    if not serve.model:
        raise ConversionError("no model: give it as vLLM takes it (vllm serve MODEL ...)")
    flags = serve.last()
    out = Conversion(_model_name(serve, flags))
    _model_path(serve.model, flags, out)
    simple = simple_options()
    for flag in sorted(flags.values(), key=lambda f: f.name != "--dtype"):  # dtype sizes KV
        try:
            _one(flag, out, simple)
        except (ValueError, json.JSONDecodeError) as exc:
            raise ConversionError(f"{flag.shown()}: {exc}") from None
    _environment(env or {}, out)
    return out


def _one(flag: Flag, out: Conversion, simple: Mapping[str, SimpleOption]) -> None:
    name = flag.name
    if name in simple:
        key, kind = simple[name]
        out.option(flag, key, kind(flag.value))
    elif name in HANDLERS:
        HANDLERS[name](flag, out)
    elif name in NEEDLESS:
        out.needless.append(f"{flag.shown()}: {NEEDLESS[name]}")
    elif name in UNSUPPORTED:
        out.unsupported.append(f"{flag.shown()}: {UNSUPPORTED[name]}")
    else:
        out.unknown.append(flag.shown())


def _model_name(serve: ServeArgs, flags: Mapping[str, Flag]) -> str:
    """The fleet's name of the model: ``--served-model-name``'s first, else the model's
    last path part, in the characters a fleet's model name takes."""
    given = flags.get("--served-model-name")
    raw = given.values[0] if given else Path(str(serve.model).rstrip("/")).name
    raw = raw.removesuffix(".gguf") if not given else raw
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", raw).lstrip("_.-")[:64] or "model"
    return name


def _model_path(model: str, flags: Mapping[str, Flag], out: Conversion) -> None:
    out.model.append(Line("runner", "text-generation", "vllm serve: a generative model"))
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        out.model.append(Line("path", str(path.parent), f"the GGUF file {model}'s directory"))
        out.options.append(Line("gguf_file", path.name, model))
    elif path.exists() or model.startswith((".", "/", "~")):
        out.model.append(Line("path", model, "vllm serve's model"))
    else:
        out.model.append(Line("path", model, "a hub id, kept as given: machines with "
                              "HF_HUB_OFFLINE=1 need a local directory here"))  # fmt: skip
    given = flags.get("--served-model-name")
    if given is None and out.name != model:
        out.needless.append(f"(model {model}): clients now name it {out.name!r} (a fleet's "
                            "model name is letters, digits, '_', '.', '-')")  # fmt: skip
    elif given is not None and given.values[0] != out.name:
        out.needless.append(f"--served-model-name {given.values[0]}: clients now name it "
                            f"{out.name!r} (a fleet's model name is letters, digits, '_', '.', '-')")  # fmt: skip


def _dtype(flag: Flag, out: Conversion) -> None:
    if flag.value not in DTYPES:
        raise ValueError(f"the fleet takes {', '.join(sorted(DTYPES))}")
    out.model.append(Line("dtype", DTYPES[flag.value], flag.shown()))


def _max_model_len(flag: Flag, out: Conversion) -> None:
    n = _positive(flag.value)
    prompt = min(n - 1, MAX_TOKENS)
    why = "prompts longer are refused, as vLLM's; a sequence's whole length is bounded by " \
          "the model's positions and kv_cache_tokens"  # fmt: skip
    if n - 1 > MAX_TOKENS:
        why += f" (the fleet bounds prompts at {MAX_TOKENS} tokens)"
    out.model.append(Line("max_tokens", max(prompt, 1), f"{flag.shown()}: {why}"))


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
    rank = _positive(flag.value)
    if rank > MAX_LORA_RANK:
        raise ValueError(f"the fleet serves LoRA ranks up to {MAX_LORA_RANK}")
    out.option(flag, "max_lora_rank", rank)


def _kv_cache_bytes(flag: Flag, out: Conversion) -> None:
    """KV-cache bytes to tokens, where the model's config.json is here to size a token."""
    size = _positive(flag.value)
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
    if flag.value == "vllm":
        out.needless.append(f"{flag.shown()}: requests' sampling defaults are vLLM's here")
    else:
        out.unsupported.append(f"{flag.shown()}: the fleet does not take sampling defaults "
                               "from a generation_config.json (requests' fields and vLLM's "
                               "defaults apply; its end tokens are read)")  # fmt: skip


def _override_generation(flag: Flag, out: Conversion) -> None:
    raw = json.loads(flag.value)
    if not isinstance(raw, dict):
        raise ValueError("a JSON object")
    for key, value in raw.items():
        if key in ("max_new_tokens", "max_tokens"):
            out.option(flag, "max_new_tokens", _positive(str(value)))
        else:
            out.unsupported.append(f"--override-generation-config {key}: the fleet has no "
                                   "default for it (requests set it)")  # fmt: skip


def _parallel(flag: Flag, out: Conversion) -> None:
    size = _positive(flag.value)
    if size == 1:
        out.needless.append(f"{flag.shown()}: one device per worker, as here")
    elif flag.name == "--data-parallel-size":
        out.needless.append(f"{flag.shown()}: run {size} workers with this fleet file (each "
                            "serves the model; requests are shared through Redis)")  # fmt: skip
    else:
        out.unsupported.append(f"{flag.shown()}: a worker serves a model on one device (no "
                               "tensor or pipeline parallelism); more workers add replicas")  # fmt: skip


def _quantization(flag: Flag, out: Conversion) -> None:
    if flag.value == "gguf" and any(ln.key == "gguf_file" for ln in out.options):
        out.needless.append(f"{flag.shown()}: the model is a GGUF file (gguf_file)")
    else:
        out.unsupported.append(f"{flag.shown()}: the worker loads weights through "
                               "transformers, without vLLM's quantization kernels (a GGUF "
                               "file is dequantized; a pre-quantized checkpoint is untested)")  # fmt: skip


def _tokenizer(flag: Flag, out: Conversion) -> None:
    path = next(ln.value for ln in out.model if ln.key == "path")
    if flag.value.rstrip("/") == str(path).rstrip("/"):
        out.needless.append(f"{flag.shown()}: the model's own tokenizer")
    else:
        out.unsupported.append(f"{flag.shown()}: the tokenizer is loaded from the model's "
                               "directory (or GGUF file): copy its files there")  # fmt: skip


def _kv_cache_dtype(flag: Flag, out: Conversion) -> None:
    if flag.value == "auto":
        out.needless.append(f"{flag.shown()}: the KV cache has the model's dtype")
    else:
        out.unsupported.append(f"{flag.shown()}: the KV cache has the model's dtype (no "
                               "quantized KV cache)")  # fmt: skip


def _gateway_value(flag: Flag, out: Conversion) -> None:
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


def _environment(env: Mapping[str, str], out: Conversion) -> None:
    for var, flag in ENV_SWITCHES.items():
        if env.get(var, "").strip().lower() in ("1", "true"):
            out.gateway.append((flag,))
    if env.get("VLLM_API_KEY") and not any(a[0] == "--api-key" for a in out.gateway):
        out.needless.append("env VLLM_API_KEY: set BATCHFLEET_API_KEY to it for the gateway")
    if not any(a[0] == "--host" for a in out.gateway):
        out.gateway.insert(0, ("--host", "0.0.0.0"))  # vLLM's default: every interface


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError(f"{value} is not a positive integer")
    return n


def render(conv: Conversion, argv: Sequence[str], fleet_path: str) -> str:
    """The fleet file's text: each line cites the vLLM flag it came from."""
    given = shlex.join(_redacted(argv))
    gateway = conv.gateway_command(fleet_path, secret=False)
    out = [f"# From `batchfleet from-vllm`: {given}",
           f"# Run:  batchfleet worker --config {fleet_path}",
           f"#       {gateway}",
           'redis_url = "redis://127.0.0.1:6379/0"  # the fleet\'s Redis: set yours', "",
           f"[models.{_key(conv.name)}]"]  # fmt: skip
    out += [_line(ln) for ln in conv.model]
    if conv.options:
        out += ["", f"[models.{_key(conv.name)}.options]", *map(_line, conv.options)]
    if conv.adapters:
        out += ["", f"[models.{_key(conv.name)}.options.lora_adapters]"]
        out += map(_line, conv.adapters)
    for title, items in (("Nothing needed here", conv.needless),
                         ("No equivalent (not carried over)", conv.unsupported),
                         ("Unknown to from-vllm (dropped: --keep-going)", conv.unknown)):  # fmt: skip
        if items:
            out += ["", f"# {title}:", *(f"#   {item}" for item in items)]
    return "\n".join(out) + "\n"


def _redacted(argv: Sequence[str]) -> list[str]:
    """``argv`` without the API key's value."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--api-key="):
            out[i] = "--api-key=***"
        elif arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
    return out


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _line(ln: Line) -> str:
    return f"{_key(ln.key)} = {_toml(ln.value)}  # {ln.source}"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def check(text: str) -> None:
    """``text`` loaded by the fleet loader, as a worker would load it (a
    :class:`ConversionError` says why it would not start)."""
    from pydantic import ValidationError

    from .config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "fleet.toml")
        path.write_text(text, encoding="utf-8")
        try:
            load_config(path)
        except (ValidationError, ValueError) as exc:  # TOMLDecodeError is one too
            raise ConversionError(f"the fleet file would not load: {exc}") from None


def from_vllm(argv: Sequence[str], *, out: str | None = None, keep_going: bool = False,
              env: Mapping[str, str] | None = None) -> tuple[int, str, str]:  # fmt: skip
    """The command: ``(exit code, stdout, stderr)``. The fleet file goes to ``out`` (then
    stdout shows the commands) or to stdout. 2: unknown flags (without ``keep_going``)
    or a command line that cannot be converted."""
    try:
        conv = convert(argv, os.environ if env is None else env)
    except ConversionError as exc:
        return 2, "", f"from-vllm: {exc}\n"
    if conv.unknown and not keep_going:
        listed = "".join(f"  {u}\n" for u in conv.unknown)
        return 2, "", (f"from-vllm: flags it does not know (--keep-going writes the file "
                       f"without them, each named in a comment):\n{listed}")  # fmt: skip
    fleet_path = out or "fleet.toml"
    text = render(conv, argv, fleet_path)
    try:
        check(text)
    except ConversionError as exc:
        return 2, "", f"from-vllm: {exc}\n"
    notes = "".join(f"from-vllm: no equivalent: {u}\n" for u in conv.unsupported)
    notes += "".join(f"from-vllm: dropped (unknown): {u}\n" for u in conv.unknown)
    if out is None:
        return 0, text, notes
    Path(out).write_text(text, encoding="utf-8")
    commands = f"batchfleet worker --config {out}\n{conv.gateway_command(out, secret=True)}\n"
    return 0, commands, f"from-vllm: wrote {out}\n" + notes

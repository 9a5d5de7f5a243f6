"""vLLM's pooling models as the worker's encoder runners: which runner a ``vllm serve``
command line serves (``--runner``, ``--convert``, the older ``--task``, else the model's
``config.json`` as vLLM reads it) and the settings of one (``--pooler-config``, the
model's sentence-transformers pooling, ``--max-model-len``, the batch bounds); what only
text generation takes is listed as not applying."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .vllm_args import Flag
from .vllm_conversion import Conversion, Line, token_count
from .vllm_pooling_defaults import (
    GRITLM_POOLING,
    POOLINGS,
    ST_NORMALIZE,
    ST_POOLING,
    architecture_pooling,
    architectures,
    is_gritlm,
    st_pooling,
)

GENERATE = "text-generation"
RUNNERS = {"embed": "embedding", "classify": "text-classification", "score": "rerank"}
"""vLLM's pooling tasks and the runner serving each (``score``: a cross-encoder, a
classifier with one output)."""

SUFFIXES = (("ForCausalLM", "generate"), ("ForConditionalGeneration", "generate"),
            ("ChatModel", "generate"), ("LMHeadModel", "generate"),
            ("ForTextEncoding", "embed"), ("EmbeddingModel", "embed"),
            ("ForSequenceClassification", "classify"), ("ForTokenClassification", "token"),
            ("ForAudioClassification", "media"), ("ForImageClassification", "media"),
            ("ForVideoClassification", "media"), ("ClassificationModel", "classify"),
            ("ForRewardModeling", "reward"), ("RewardModel", "reward"), ("Model", "embed"))  # fmt: skip
"""vLLM's architecture suffixes (``_SUFFIX_TO_DEFAULTS``, first match wins) and what a
model of each is: generative, or the pooling task it serves."""

TASKS = {"generate": "generate", "embed": "embed", "embedding": "embed",
         "classify": "classify", "score": "score"}  # fmt: skip
"""Older vLLM's ``--task`` values the fleet serves (``auto``: as ``--runner auto``)."""
REFUSED = {
    "reward": "the fleet has no reward-model runner (a process reward model's scores)",
    "token": "token classification (a label per token) is not served: the "
    "text-classification runner labels whole texts",
    "media": "image, audio and video classification: from-vllm writes text models (an image "
    'classifier: write runner = "image-classification" by hand)',
    "transcription": "speech-to-text is not served (the text-generation runner takes text)",
    "draft": "a draft model proposes tokens for another: give it to that model's "
    "--speculative-config",
}
"""What vLLM serves and the fleet does not, by task."""

SHORT_INPUTS = "inputs are cut to the model's max_tokens (vLLM refuses longer ones)"
POOLER_UNSUPPORTED = {
    "dimensions": "vectors are not shortened (a request's dimensions must be the model's size)",
    "max_embed_len": SHORT_INPUTS,
    "logit_bias": "classifiers' logits are the model's",
    "step_tag_id": REFUSED["reward"],
    "returned_token_ids": REFUSED["reward"],
    "tok_pooling_type": "token embeddings and token classification (token_embed, "
    "token_classify) are not served",
}
"""``--pooler-config`` keys with no equivalent, and why."""
BATCH = {"max_running": "max_batch_size", "step_tokens": "max_batch_tokens"}
"""What bounds a generating step and the same bound on an encoder's batch (vLLM's
``--max-num-seqs`` and ``--max-num-batched-tokens`` bound a pooling model's batches)."""
MAX_TOKENS = 65_536  # ModelConfig.max_tokens' bound
MAX_BATCH = 4_096  # BatchConfig.max_batch_size's bound


def runner_line(model: str, flags: Mapping[str, Flag]) -> Line:
    """The model's ``runner`` line, decided as vLLM decides its runner and pooling task
    (a ``ValueError`` where the fleet serves no such model)."""
    runner, convert, given = _asked(flags)
    cfg = model_config(Path(model).expanduser())
    why = " ".join(f.shown() + ":" for f in given) or "vllm serve:"
    if runner == "auto" and convert in ("auto", "none"):
        runner, why = _auto_runner(cfg, why)
    if runner == "generate":
        if convert not in ("auto", "none"):
            raise ValueError(
                f"--convert {convert}: vLLM converts a model for --runner pooling only"
            )
        return Line("runner", GENERATE, f"{why} a generative model")
    if is_gritlm(cfg) and convert not in ("auto", "none"):
        return Line("runner", RUNNERS["embed"], f"{why} a no-op for GritLM, whose class in "
                    "vLLM pools already (its --convert adapters leave a pooling model's class "
                    "as it is): vLLM's embed task")  # fmt: skip
    task = convert if convert not in ("auto", "none") else _pooling_task(cfg)
    if task == "classify" and _labels(cfg) == 1:
        task = "score"  # vLLM serves a classifier with one output as a cross-encoder
    if task == "score" and cfg is not None and _labels(cfg) != 1:
        raise ValueError(f"a score model (a cross-encoder) has one output, not {_labels(cfg)}")
    if task in REFUSED:
        raise ValueError(REFUSED[task])
    unread = _UNREAD if cfg is None and task == "classify" else ""
    return Line("runner", RUNNERS[task], f"{why} a pooling model, vLLM's {task} task{unread}")


_UNREAD = " (its config.json is not here to read: a cross-encoder, one output, needs " \
          'runner = "rerank")'  # fmt: skip


def _asked(flags: Mapping[str, Flag]) -> tuple[str, str, list[Flag]]:
    """``--runner`` and ``--convert`` as given (``--task`` read as the vLLM release that
    had it read it), checked; and the flags that said them."""
    runner_flag, convert_flag = flags.get("--runner"), flags.get("--convert")
    runner = runner_flag.value if runner_flag else "auto"
    convert = convert_flag.value if convert_flag else "auto"
    if runner not in ("auto", "generate", "pooling", "draft"):
        raise ValueError(f"--runner {runner}: vLLM takes auto, generate, pooling, draft")
    if convert not in ("auto", "none", "embed", "classify", "reward"):
        raise ValueError(f"--convert {convert}: vLLM takes auto, none, embed, classify")
    given = [f for f in (runner_flag, convert_flag) if f is not None]
    if (task_flag := flags.get("--task")) is not None and task_flag.value != "auto":
        task = TASKS.get(task_flag.value, task_flag.value)
        if task in ("reward", "transcription", "draft"):
            raise ValueError(f"--task {task_flag.value}: {REFUSED[task]}")
        if task not in TASKS.values():
            raise ValueError(f"--task {task_flag.value}: vLLM took auto, {', '.join(TASKS)}")
        given.append(task_flag)
        runner = "generate" if task == "generate" else "pooling"
        convert = convert if task == "generate" or convert_flag else task
    if runner == "draft":
        raise ValueError(f"--runner draft: {REFUSED['draft']}")
    if runner == "auto" and convert in ("embed", "classify", "score", "reward"):
        runner = "pooling"
    return runner, convert, given


def _auto_runner(cfg: dict[str, Any] | None, why: str) -> tuple[str, str]:
    """vLLM's ``--runner auto``: pooling for a sentence-transformers model, else by the
    architectures' suffixes; generate where the config is not here to read."""
    if cfg is None:
        return "generate", "vllm serve (a hub id or a folder without config.json: vLLM " \
                           "reads its config; give --runner pooling for a pooling model):"  # fmt: skip
    if cfg.get("_sentence_transformers_pooling"):
        return "pooling", f"{why} sentence-transformers' modules.json:"
    if is_gritlm(cfg):
        return "pooling", f"{why} config.json's GritLM (a pooling model's class in vLLM):"
    for arch in architectures(cfg):
        kind = next((k for suffix, k in SUFFIXES if arch.endswith(suffix)), None)
        if kind is not None:
            runner = "generate" if kind == "generate" else "pooling"
            return runner, f"{why} config.json's {arch}:"
    return "generate", f"{why} config.json's architectures:"


def _pooling_task(cfg: dict[str, Any] | None) -> str:
    """vLLM's default conversion for ``--runner pooling``: by the architectures' pooling
    suffixes, else ``embed`` (a generative model's states pooled)."""
    for arch in architectures(cfg or {}):
        kind = next((k for suffix, k in SUFFIXES if arch.endswith(suffix) and
                     k != "generate"), None)  # fmt: skip
        if kind is not None:
            return kind
    return "embed"


def _labels(cfg: Mapping[str, Any] | None) -> int | None:
    """A classifier's outputs (transformers': ``id2label``'s size, else ``num_labels``,
    else 2)."""
    if cfg is None:
        return None
    labels = cfg.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else int(cfg.get("num_labels", 2))


def model_config(path: Path) -> dict[str, Any] | None:
    """A local model folder's ``config.json``, with its sentence-transformers pooling
    (``_sentence_transformers_pooling``: the type, ``_sentence_transformers_normalize``)
    where ``modules.json`` names one; None where there is no such folder."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    modules = _json(path / "modules.json")
    if isinstance(modules, list):
        found = [m for m in modules if isinstance(m, dict)]
        pooling = next((m for m in found if m.get("type") in ST_POOLING), None)
        if pooling is not None:
            modes = _json(path / str(pooling.get("path", "")) / "config.json")
            kind = st_pooling(modes if isinstance(modes, dict) else {})
            cfg["_sentence_transformers_pooling"] = kind or "unread"
            cfg["_sentence_transformers_normalize"] = any(
                m.get("type") in ST_NORMALIZE for m in found
            )
    return cfg


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _runner(out: Conversion) -> str:
    line = out.setting("runner")
    return GENERATE if line is None else str(line.value)


def is_pooling(out: Conversion) -> bool:
    """Whether the model written is a pooling model (not ``text-generation``)."""
    return _runner(out) != GENERATE


def _runner_flag(flag: Flag, out: Conversion) -> None:
    """``--runner``, ``--convert``, ``--task``: cited by the runner line (read first,
    :func:`runner_line`), and needing nothing for a generative model."""
    line = out.setting("runner")
    if not is_pooling(out) and flag.value in ("auto", "generate", "none"):
        out.judged(flag, True, "a generative model: runner = text-generation")
    elif line is not None and flag.shown() not in line.source:  # --task auto
        out.judged(flag, True, f"runner = {line.value}, as vLLM decides it")


def _pooler_config(flag: Flag, out: Conversion) -> None:
    """vLLM's ``PoolerConfig`` JSON: each key to the runner's option, needless, or listed."""
    raw = json.loads(flag.value)
    if not isinstance(raw, dict):
        raise ValueError("a JSON object")
    if not is_pooling(out):
        out.judged(flag, True, "a generative model: a pooler applies to pooling models")
        return
    runner = _runner(out)
    for key, value in raw.items():
        if value is None:
            continue
        shown = f"{flag.name} {key}={json.dumps(value)}"
        sub = Flag(shown, ())  # the key cited as a flag of its own
        if key in ("pooling_type", "seq_pooling_type"):
            _pooling_type(sub, str(value), runner, out)
        elif key in ("use_activation", "normalize", "softmax", "activation"):
            _activation(sub, bool(value), runner, out)
        elif key == "enable_chunked_processing" and not value:
            out.needless.append(f"{shown}: {SHORT_INPUTS}, as without chunks")
        elif key in POOLER_UNSUPPORTED or key == "enable_chunked_processing":
            out.unsupported.append(f"{shown}: {POOLER_UNSUPPORTED.get(key, SHORT_INPUTS)}")
        else:
            out.unsupported.append(f"{shown}: not a key of vLLM 0.34's PoolerConfig")


def _pooling_type(flag: Flag, value: str, runner: str, out: Conversion) -> None:
    if value in ("ALL", "STEP"):
        out.unsupported.append(f"{flag.name}: {POOLER_UNSUPPORTED['tok_pooling_type']}")
    elif value not in POOLINGS:
        raise ValueError(f"{flag.name}: vLLM pools by {', '.join(POOLINGS)}, ALL or STEP")
    elif runner == "embedding":
        out.option(flag, "pooling", POOLINGS[value])
    else:
        out.unsupported.append(f"{flag.name}: the {runner} runner's head pools as the "
                               "model's transformers class does")  # fmt: skip


def _activation(flag: Flag, on: bool, runner: str, out: Conversion) -> None:
    """Embeddings' normalisation, a cross-encoder's sigmoid, a classifier's softmax (its
    answer is probabilities: off has no equivalent)."""
    if runner == "embedding":
        out.option(flag, "normalize", on)
    elif runner == "rerank":
        out.option(flag, "activation", "sigmoid" if on else "none")
    else:
        out.judged(flag, on, "the classifier answers probabilities (softmax, sigmoid per "
                   "label for a multi-label model)")  # fmt: skip


def encoder_length(flag: Flag, out: Conversion) -> None:
    """``--max-model-len N`` of a pooling model: inputs cut to N tokens."""
    n = token_count(flag.value)
    why = "inputs are cut to it (vLLM refuses longer ones)"
    if n > MAX_TOKENS:
        why += f"; the fleet bounds them at {MAX_TOKENS} tokens"
    out.model.append(Line("max_tokens", min(n, MAX_TOKENS), f"{flag.shown()}: {why}"))


def pooling_settings(model: str, out: Conversion) -> None:
    """A pooling model's settings once every flag is read: vLLM's defaults where no flag
    set them (the model's sentence-transformers pooling and normalisation, its context
    length, a cross-encoder's sigmoid); the generating bounds of a step as the batch's;
    what only text generation takes, listed."""
    runner = _runner(out)
    cfg = model_config(Path(model).expanduser())
    if runner == "embedding":
        _embedding_defaults(cfg, out)
    if runner == "rerank" and out.setting("activation") is None:
        identity = "Identity" in str((cfg or {}).get("sentence_transformers", {}))
        out.options.append(Line("activation", "none" if identity else "sigmoid",
                                "vLLM's default: the model's sentence-transformers "
                                "activation" if identity else "vLLM's default: scores "
                                "through a sigmoid"))  # fmt: skip
    if not any(ln.key == "max_tokens" for ln in out.model):
        out.model.append(Line("max_tokens", MAX_TOKENS, "no --max-model-len: inputs up to the "
                              "model's positions, as vLLM's"))  # fmt: skip
    kept = {"embedding": ("pooling", "normalize"), "rerank": ("activation",)}.get(runner, ())
    for ln in list(out.options):
        if ln.key in BATCH:
            size = min(int(ln.value), MAX_BATCH) if ln.key == "max_running" else ln.value
            cut = f" (the fleet's batches take up to {MAX_BATCH})" if size != ln.value else ""
            out.batch.append(Line(BATCH[ln.key], size, ln.source + cut))
        elif ln.key not in kept:
            out.unsupported.append(f"{ln.source}: {ln.key} applies to text generation "
                                   f"(the {runner} runner)")  # fmt: skip
    out.options = [ln for ln in out.options if ln.key in kept]
    lora = [n for n in out.needless if n.startswith("--enable-lora:")]
    for item in [*(ln.source for ln in out.adapters), *(n.split(":")[0] for n in lora)]:
        out.unsupported.append(f"{item}: the {runner} runner serves no LoRA adapters")
    out.adapters = []
    out.needless = [n for n in out.needless if n not in lora]


def _embedding_defaults(cfg: dict[str, Any] | None, out: Conversion) -> None:
    """vLLM's pooling and normalisation where ``--pooler-config`` left them: the model's
    sentence-transformers modules, else the architecture's
    (:func:`.vllm_pooling_defaults.architecture_pooling`)."""
    st = (cfg or {}).get("_sentence_transformers_pooling")
    if is_gritlm(cfg):
        for ln in (ln for ln in out.options if ln.key == "pooling"):
            out.needless.append(f"{ln.source}: vLLM's GritLM pools by its own pooler, "
                                "whatever the pooling type")  # fmt: skip
        out.options = [ln for ln in out.options if ln.key != "pooling"]
        out.options.append(Line("pooling", *GRITLM_POOLING))
    elif out.setting("pooling") is None and cfg is not None:
        if st in POOLINGS:
            why = "the model's sentence-transformers pooling (1_Pooling/config.json), as vLLM's"
            out.options.append(Line("pooling", POOLINGS[st], why))
        else:
            kind, why = architecture_pooling(cfg)
            if st:
                why += " (its sentence-transformers pooling is none vLLM pools by)"
            out.options.append(Line("pooling", POOLINGS[kind], why))
    elif out.setting("pooling") is None:
        out.unsupported.append("the model's pooling: its folder is not here to read "
                               "(sentence-transformers' modules.json, which vLLM reads): "
                               "the embedding runner mean-pools unless options.pooling "
                               "says cls, last or gritlm (a GritLM)")  # fmt: skip
    if out.setting("normalize") is None and st:
        normalize = bool((cfg or {}).get("_sentence_transformers_normalize"))
        out.options.append(Line("normalize", normalize, "the model's sentence-transformers "
                                "Normalize module" + ("" if normalize else " is absent") +
                                ", as vLLM's"))  # fmt: skip


POOLING_FLAGS: dict[str, Callable[[Flag, Conversion], None]] = {
    "--runner": _runner_flag, "--convert": _runner_flag, "--task": _runner_flag,
    "--pooler-config": _pooler_config,
}  # fmt: skip
"""These flags and how each becomes a setting."""

"""Every message on the wire, gathered: import the protocol's models from here.

Each concept has its own module: :mod:`.request` (the request and its webhook),
:mod:`.chat`, :mod:`.structured` (its parts), :mod:`.limits` and :mod:`.generation_fields`
(its bounds), :mod:`.results` (results and deltas), :mod:`.outputs` (a generation's
output), :mod:`.version`; this module re-exports their names, so callers need not know
where each lives.
"""

from __future__ import annotations

from .chat import (
    MAX_CHAT_TEMPLATE_CHARS,
    MAX_TEMPLATE_KWARGS_CHARS,
    TEMPLATE_NAMES,
    ChatMessage,
    TextPart,
)
from .generation_fields import (
    BEAM_REFUSES,
    GENERATION_FIELDS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_COMPLETIONS,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)
from .limits import DEFAULT_LIMITS, Limits
from .outputs import FINISH_REASONS, Generation, TokenLogprob, TopLogprob
from .request import SECRET_ID, Request, Webhook
from .results import (
    ERROR,
    EXPIRED,
    KNOWN_STATUSES,
    OK,
    Delta,
    ErrorInfo,
    PromptTokensDetails,
    Result,
    Status,
    Timings,
    Usage,
)
from .structured import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_STRUCTURES,
    JsonSchemaFormat,
    ResponseFormat,
    StructuralTag,
    StructuredOutputs,
    TagStructure,
)
from .version import SCHEMA_VERSION, Format

__all__ = [
    "BEAM_REFUSES",
    "DEFAULT_LIMITS",
    "ERROR",
    "EXPIRED",
    "FINISH_REASONS",
    "GENERATION_FIELDS",
    "KNOWN_STATUSES",
    "MAX_ALLOWED_TOKEN_IDS",
    "MAX_BAD_WORDS",
    "MAX_CHAT_TEMPLATE_CHARS",
    "MAX_CHOICES",
    "MAX_COMPLETIONS",
    "MAX_GRAMMAR_CHARS",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_STRUCTURES",
    "MAX_TEMPLATE_KWARGS_CHARS",
    "MAX_TOP_LOGPROBS",
    "OK",
    "SCHEMA_VERSION",
    "SECRET_ID",
    "TEMPLATE_NAMES",
    "ChatMessage",
    "Delta",
    "ErrorInfo",
    "Format",
    "Generation",
    "JsonSchemaFormat",
    "Limits",
    "PromptTokensDetails",
    "Request",
    "ResponseFormat",
    "Result",
    "Status",
    "StructuralTag",
    "StructuredOutputs",
    "TagStructure",
    "TextPart",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "Webhook",
]

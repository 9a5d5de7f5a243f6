"""vLLM's server flags (``vllm serve``'s own and ``FrontendArgs``: HTTP, the OpenAI
routes' defaults, logging) that need nothing in a fleet, and those with no
equivalent, each with why (the fleet file's comments say it).

A switch's off form (``--no-x``, ``--disable-x``) that is not listed takes its switch's
judgement: see :func:`.vllm_flags.judgement`. The flags that become a gateway flag are
:mod:`.vllm_flags`'s (TLS, CORS, root path, Unix socket and the answers' switches:
:mod:`.vllm_serving`'s).
"""

from __future__ import annotations

UVICORN = "the gateway is not uvicorn (tornado: no access log, its own HTTP limits)"
LOGS = "vLLM's per-request log lines have no counterpart here"
HEALTH = "no data-parallel supervisor: each gateway answers /health for itself"
DOCS = "the gateway serves no OpenAPI docs pages"
COHERE = "no Cohere /v2/chat route"
TOKEN_ROUTES = "vLLM's disaggregated token routes (/render, /inference/v1/generate) are " \
               "not served"  # fmt: skip
GRPC = "the gateway serves HTTP only"

# fmt: off
NEEDLESS = {
    "--enable-auto-tool-choice": 'tool_choice "auto" is served where tool_call_parser is set',
    "--no-return-tokens-as-token-ids": "the gateway's default",
    "--no-allow-credentials": "the gateway's default",
    "--no-enable-ssl-refresh": "the gateway's default",
    "--disable-ssl-refresh": "the gateway's default",
    **dict.fromkeys(("--no-exclude-tools-when-tool-choice-none",
                     "--no-enable-per-request-metrics", "--disable-per-request-metrics",
                     "--no-enable-force-include-usage", "--disable-force-include-usage",
                     "--no-enable-tokenizer-info-endpoint",
                     "--disable-tokenizer-info-endpoint"), "the gateway's default"),
    "--no-trust-request-chat-template": "a request's chat_template is refused, as the "
    "fleet's default (trust_request_chat_template = false)",
    "--disable-log-requests": LOGS,
    "--enable-log-outputs": LOGS,
    "--enable-log-deltas": LOGS,
    "--log-error-stack": LOGS,
    "--max-log-len": "the gateway does not log prompts",
    "--uvicorn-log-level": "the gateway is not uvicorn; its log level is the CLI's (INFO)",
    "--disable-uvicorn-access-log": UVICORN,
    "--disable-access-log-for-endpoints": UVICORN,
    "--h11-max-incomplete-event-size": UVICORN,
    "--h11-max-header-count": UVICORN,
    "--disable-fastapi-docs": DOCS,
    "--enable-offline-docs": DOCS,
    "--disable-frontend-multiprocessing": "the gateway is one process apart from the workers",
    "--api-server-count": "run more gateways: any of them serves any request",
    "--headless-client-handshake-address": "internal to vLLM's Rust frontend",
    "--enable-server-load-tracking": "the gateway's metrics show the requests in flight",
    "--enable-prompt-tokens-details": "usage carries prompt_tokens_details.cached_tokens "
    "wherever the worker reports it",
    "--enable-request-id-headers": "the gateway always answers with X-Request-Id",
    "--enable-flash-late-interaction": "late-interaction (ColBERT) scoring is not served: "
    "scores are the rerank runner's",
    "--data-parallel-supervisor-port": HEALTH,
    "--dp-supervisor-probe-interval-s": HEALTH,
    "--dp-supervisor-probe-timeout-s": HEALTH,
    "--dp-supervisor-probe-failure-threshold": HEALTH,
}
"""Server flags that change nothing here, and why (a comment in the fleet file)."""

UNSUPPORTED = {
    "--trust-request-mm-kwargs": "a request's media_io_kwargs and mm_processor_kwargs are "
    "refused (400)",
    "--reasoning-effort-map": "a request's reasoning_effort reaches the chat template as sent",
    "--tool-parser-plugin": "tool parsers are the fleet's built-in ones",
    "--tool-strict-level": "no server-wide floor: a request's tool_choice and its tools' "
    "strict decide what is constrained",
    "--tool-server": "no built-in tools or MCP tool servers",
    "--anthropic-disabled-thinking-effort": "Anthropic's disabled thinking reaches the chat "
    "template as enable_thinking false",
    "--middleware": "the gateway takes no ASGI middleware",
    "--headless": "a worker has no HTTP front; the gateway is a separate process",
    "--grpc": GRPC,
    "--grpc-port": GRPC,
    "--tokens-only": TOKEN_ROUTES,
    "--enable-scale-out": TOKEN_ROUTES,
    "--cohere-is-reasoning-model": COHERE,
    "--cohere-format": COHERE,
}
"""Server flags with no equivalent here, and why (listed; the fleet file goes on without
them)."""

BY_VALUE = {
    "--sse-keep-alive-interval": (("0",), "no keep-alive comments in streams, as vLLM's "
                                  "default", "streams send no keep-alive comments: raise "
                                  "the proxy's read timeout"),
}
"""Server flags whose values in the first part change nothing here (and why), and why the
others have no equivalent."""
# fmt: on

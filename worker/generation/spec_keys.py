"""vLLM's ``SpeculativeConfig`` keys beyond those the proposers read, and what each does
here (:func:`check`).

The method's own keys (``method``, ``num_speculative_tokens``, ``prompt_lookup_min`` and
``prompt_lookup_max``, ``model``, ``max_model_len``) are :mod:`.speculative`'s; the
batch-size bound (``disable_by_batch_size``, ``num_speculative_tokens_per_batch_size``) is
:mod:`.spec_bound`'s. Of the others, a key whose value is what the fleet does anyway is
taken and changes nothing (:data:`AS_IS`: its default, and where the key only tunes
something the fleet does not have, any value); every other key is refused with why
(:data:`REFUSED`), so a vLLM configuration is never half-followed in silence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

WHERE = "options.speculative"
ONE_DEVICE = "a worker serves a model on one device (no tensor parallelism)"
KERNELS = "a kernel choice: the draft runs the kernels torch and transformers pick"
BOOL = (False, True)

# fmt: off
AS_IS: dict[str, tuple[tuple[Any, ...], str]] = {
    "enforce_eager": ((None, *BOOL), "the padded engine and its draft run eagerly: no CUDA "
                      "graphs are captured to skip"),
    "disable_padded_drafter_batch": (BOOL, "vLLM pads only EAGLE's drafter batch; the draft "
                                     "model here runs each row at its own column (no padding "
                                     "to share a shape)"),
    "disable_eagle_block_drop": (BOOL, "an EAGLE option (its prefix-cache block), and EAGLE "
                                 "is not served"),
    "use_local_argmax_reduction": (BOOL, "a tensor-parallel vocabulary argmax: " + ONE_DEVICE),
    "draft_tensor_parallel_size": ((None, 1), ONE_DEVICE),
    "quantization": ((None,), "the draft loads through transformers, without vLLM's "
                     "quantization kernels (transformers reads a quantized checkpoint's own "
                     "quantization_config)"),
    "kv_cache_dtype": ((None, "auto"), "the draft's KV cache has the draft's dtype (the "
                       "target's)"),
    "attention_backend": ((None, "auto"), KERNELS),
    "moe_backend": ((None, "auto"), KERNELS),
    "rejection_sample_method": (("standard",), "drafts are verified by vLLM's standard "
                                "rejection sampling (its synthetic and block methods are not "
                                "served)"),
    "draft_sample_method": (("greedy",), "drafts are the draft's argmax, as vLLM's greedy "
                            "default (probabilistic drafting is not served)"),
    "use_heterogeneous_vocab": ((False,), "the draft model must have the target's vocabulary"),
    "parallel_drafting": ((False,), "drafts are proposed one forward a token (drafters "
                          "trained to draft in parallel are not served)"),
    "enable_adaptive_verification": ((False,), "a DSpark option, and DSpark is not served"),
}
# fmt: on
"""Keys taken as they are: per key, the values served (all of them where the key tunes
something the fleet does not have) and why nothing changes."""

SUFFIX = "suffix decoding (method 'suffix') is not served"
INTERNAL = "vLLM sets it itself from the model's configuration: not a user setting"

REFUSED: dict[str, str] = {
    "tensor_parallel_size": "not a speculative key (vLLM refuses it too: it takes "
    "draft_tensor_parallel_size, and only 1 is served here)",
    "revision": "the draft model is a local directory: download that revision there",
    "code_revision": "no remote code is run",
    "index_share_for_mtp_iteration": "an MTP option, and MTP is not served",
    "dspark_draft_topk": "a DSpark option, and DSpark is not served",
    "draft_load_config": "the draft loads through transformers from its directory",
    "synthetic_acceptance_rates": "synthetic rejection sampling is not served: the target "
    "verifies every draft",
    "synthetic_acceptance_length": "synthetic rejection sampling is not served: the target "
    "verifies every draft",
    "suffix_decoding_max_tree_depth": SUFFIX,
    "suffix_decoding_max_cached_requests": SUFFIX,
    "suffix_decoding_max_spec_factor": SUFFIX,
    "suffix_decoding_min_token_prob": SUFFIX,
    "target_model_config": INTERNAL,
    "target_parallel_config": INTERNAL,
    "draft_model_config": INTERNAL,
    "draft_parallel_config": INTERNAL,
}
"""vLLM's keys with no equivalent here, and why."""


def _served(value: Any, values: tuple[Any, ...]) -> bool:
    """``value`` is one of ``values``, of the same type (``1`` is not ``True``)."""
    return any(type(value) is type(v) and value == v for v in values)


def check(raw: Mapping[str, Any]) -> set[str]:
    """The keys of ``raw`` this module judges, checked (a ``ValueError`` names a refused
    key, or a value not served, and why)."""
    for key in sorted(set(raw) & set(REFUSED)):
        raise ValueError(f"{WHERE}.{key} is not served: {REFUSED[key]}")
    taken = set(raw) & set(AS_IS)
    for key in sorted(taken):
        values, why = AS_IS[key]
        if not _served(raw[key], values):
            shown = " or ".join("none" if v is None else repr(v) for v in values)
            raise ValueError(f"{WHERE}.{key}: {raw[key]!r} is not served (only {shown}): {why}")
    return taken

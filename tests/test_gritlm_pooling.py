"""GritLM's embeddings as vLLM's GritLM pooler makes them: the mean of the states after
the prompt's instruction, the attention bidirectional and unwindowed; from-vllm sets it."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from batchfleet.worker.runner import InvalidInput
from batchfleet.worker.runners.embedding import EmbeddingRunner
from batchfleet.worker.runners.gritlm import GritInstruction
from devices import DEVICE

INSTRUCTED = "<|user|>\nRepresent the query\n<|embed|>\nthe quick fox"
EMBED_ONLY = "<|embed|>\nthe quick fox"
PLAIN = "the quick fox"
USER_PREFIX, EMBED_PREFIX = "<|user|>\nRepresent the query\n<|embed|>\n", "<|embed|>\n"


def _tokenizer():  # type: ignore[no-untyped-def]
    """Mistral's kind of tokenizer, small: SentencePiece BPE (``▁`` a space, a text's
    first ``▁`` prepended), byte fallback (a newline is ``<0x0A>``), ``<s>`` first."""
    from tokenizers import Tokenizer, models, normalizers, processors

    vocab = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
             "▁", "▁<", "<", "|", ">", "us", "use", "user", "em", "emb", "embe", "embed",
             *string.ascii_letters, *string.digits, ".", ",", "?"]  # fmt: skip
    merges = [("▁", "<"), ("u", "s"), ("us", "e"), ("use", "r"), ("e", "m"), ("em", "b"),
              ("emb", "e"), ("embe", "d")]  # fmt: skip
    bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges,
                     unk_token="<unk>", byte_fallback=True)  # fmt: skip
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


@pytest.fixture(scope="module")
def gritlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GritLM (a Mistral whose config says ``GritLM``, with a sliding window
    its embeddings do without, as vLLM's)."""
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("gritlm")
    fast = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")  # fmt: skip
    fast.save_pretrained(path)
    cfg = MistralConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, sliding_window=4, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    MistralForCausalLM(cfg).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GritLM"]}))
    return path


def _reference(path: Path, text: str, prefix: str | None) -> torch.Tensor:
    """The mean of ``text``'s states after ``prefix``'s tokens (None: after none), each
    token seeing every other (a full 4D mask, eager attention: no window, not causal)."""
    tok = _tokenizer()
    ids = tok.encode(text).ids
    skip = 0
    if prefix is not None:  # the prefix's own tokens, counted apart (and checked to lead)
        head = tok.encode(prefix).ids
        assert ids[: len(head)] == head
        skip = len(head)
    return _mean_states(path, ids)[skip:].mean(dim=0)


def _mean_states(path: Path, ids: list[int]) -> torch.Tensor:
    """``ids``' last hidden states (brought to the CPU) by the model at ``path`` on the
    tests' device, each token seeing every other (a full 4D mask, eager attention)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.to(DEVICE)
    full = torch.zeros(1, 1, len(ids), len(ids), device=DEVICE)
    with torch.inference_mode():
        ids_on = torch.tensor([ids], device=DEVICE)
        return model(input_ids=ids_on, attention_mask=full).last_hidden_state[0].cpu()


def _runner(path: Path, **options: object) -> EmbeddingRunner:
    return EmbeddingRunner(path, device=DEVICE, dtype="float32", max_tokens=128,
                           options={"pooling": "gritlm", "normalize": False, **options})  # fmt: skip


def test_the_vector_is_the_mean_after_the_instruction(gritlm: Path) -> None:
    runner = _runner(gritlm)
    texts = [INSTRUCTED, EMBED_ONLY, PLAIN]
    # Given three prompts of different lengths in one batch (padded on the right)
    got = runner.run(runner.encode(texts))
    # Then each is its states' mean after its instruction: <|user|>...<|embed|>\n, a
    # leading <|embed|>\n, or (none) <s> alone, as vLLM's
    for vector, text, prefix in zip(got, texts, [USER_PREFIX, EMBED_PREFIX, ""], strict=True):
        want = _reference(gritlm, text, prefix)
        assert torch.allclose(torch.tensor(vector), want, atol=1e-5), text
    # and not the plain mean (the instruction's tokens would pull it)
    assert not torch.allclose(torch.tensor(got[0]), _reference(gritlm, INSTRUCTED, None),
                              atol=1e-3)  # fmt: skip


def test_without_bos_the_vector_is_the_plain_mean(gritlm: Path) -> None:
    """vLLM's: a prompt that does not begin with <s> has no instruction."""
    runner = _runner(gritlm)
    runner._tok.post_processor = None  # type: ignore[assignment]  # <s> no longer added
    got = runner.run(runner.encode([EMBED_ONLY]))[0]
    ids = _tokenizer().encode(EMBED_ONLY).ids[1:]
    assert torch.allclose(torch.tensor(got), _mean_states(gritlm, ids).mean(dim=0), atol=1e-5)


def test_vectors_are_normalised_by_default(gritlm: Path) -> None:
    runner = EmbeddingRunner(gritlm, device=DEVICE, dtype="float32", options={"pooling": "gritlm"})
    (vector,) = runner.run(runner.encode([INSTRUCTED]))
    want = torch.nn.functional.normalize(_reference(gritlm, INSTRUCTED, USER_PREFIX), dim=0)
    assert torch.allclose(torch.tensor(vector), want, atol=1e-5)


def test_a_prompt_that_is_all_instruction_is_refused(gritlm: Path) -> None:
    runner = _runner(gritlm)
    with pytest.raises(InvalidInput, match="nothing to embed after the instruction"):
        runner.encode([USER_PREFIX])


S, LT_, LT, BAR, USER, EMBED, GT, NL, X = 1, 10, 11, 12, 13, 14, 15, 16, 99
IDS = {"<s>": S, "▁<": LT_, "<": LT, "|": BAR, "user": USER, "embed": EMBED, ">": GT,
       "<0x0A>": NL}  # fmt: skip
USER_TAG, EMBED_TAG = [LT_, BAR, USER, BAR, GT, NL], [LT_, BAR, EMBED, BAR, GT, NL]
EMBED_AFTER = [NL, LT, BAR, EMBED, BAR, GT, NL]


@pytest.mark.parametrize(("ids", "length"), [
    ([S, *USER_TAG, X, X, *EMBED_AFTER, X, X], 16),  # <|user|>\n..\n<|embed|>\n
    ([S, *EMBED_TAG, X, X], 7),  # <|embed|>\n
    ([S, X, *EMBED_TAG, X], 8),  # an <|embed|>\n further on ends it too, as vLLM's
    ([S, *USER_TAG, X, *EMBED_TAG, X], 1),  # after <|user|>, only \n<|embed|>\n ends it
    ([S, X, *USER_TAG, X, *EMBED_AFTER, X], 1),  # <|user|> counts right after <s> only
    ([S, X, X], 1),  # none: <s> alone
    ([X, *EMBED_TAG, X], 0),  # no <s>: no instruction
    ([S, *EMBED_TAG], 7),  # all instruction
    ([], 0),
])  # fmt: skip
def test_the_instruction_is_found_as_vllm_finds_it(ids: list[int], length: int) -> None:
    assert GritInstruction(IDS.get).length(ids) == length


def test_a_tokenizer_without_gritlms_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary lacks embed, <0x0A>"):
        GritInstruction({k: v for k, v in IDS.items() if k not in ("embed", "<0x0A>")}.get)


# from-vllm: a GritLM is embedded by vLLM's GritLM pooler


def test_from_vllm_serves_a_gritlm_with_its_pooler(tmp_path: Path, gritlm: Path) -> None:
    from test_from_vllm_pooling import model_of
    from vllm_commands import started_runner

    # Given vllm serve of a GritLM folder, no --runner: vLLM's class is a pooling model's
    argv = ["vllm", "serve", str(gritlm), "--served-model-name", "grit", "--dtype", "float32"]
    model, text, _ = model_of(tmp_path, argv)
    assert (model["runner"], model["options"]) == ("embedding", {"pooling": "gritlm"})
    assert "GritLMMeanPool" in text
    # Then the runner it starts embeds as vLLM's GritLM pooler (normalised)
    runner, _ = started_runner(tmp_path, argv, "grit")
    (vector,) = runner.run(runner.encode([INSTRUCTED]))
    want = torch.nn.functional.normalize(_reference(gritlm, INSTRUCTED, USER_PREFIX), dim=0)
    assert torch.allclose(torch.tensor(vector), want, atol=1e-5)


def test_a_pooling_type_does_not_change_gritlms_pooler(tmp_path: Path, gritlm: Path) -> None:
    from test_from_vllm_pooling import model_of

    argv = ["vllm", "serve", str(gritlm), "--runner", "pooling", "--pooler-config",
            '{"pooling_type": "CLS", "normalize": false}']  # fmt: skip
    model, text, _ = model_of(tmp_path, argv)
    assert model["options"] == {"pooling": "gritlm", "normalize": False}
    assert "vLLM's GritLM pools by its own pooler" in text

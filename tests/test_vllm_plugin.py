"""The vLLM plugin's parts that need no vLLM: its switch and settings, the entry point vLLM finds,
the layout read from vLLM's shard indices, request seeds and the grammar bitmask's row order.
tests/in_vllm runs the plugin inside a real vLLM (``make test-vllm``)."""

import importlib.metadata
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vocabpar.integrations.vllm import ENV, settings_of
from vocabpar.integrations.vllm.step import Settings, column_ids, layout_of, ordered_bitmask, request_seed
from vocabpar.layout import VocabLayout


def config(extra=None):
    return SimpleNamespace(additional_config=extra or {})


def test_off_unless_switched_on_by_the_environment_or_additional_config(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert settings_of(config()) is None
    monkeypatch.setenv(ENV, "0")
    assert settings_of(config()) is None
    monkeypatch.setenv(ENV, "1")
    assert settings_of(config()) == Settings()
    assert settings_of(config({"vocabpar": {"enabled": False}})) is None  # the engine's own word wins
    monkeypatch.delenv(ENV)
    assert settings_of(config({"vocabpar": {"mode": "gather", "record": True}})) == Settings(mode="gather",
                                                                                            record=True)


@pytest.mark.parametrize("given, message", [
    ({"mod": "shards"}, "unknown setting 'mod'"),
    ({"mode": "gathered"}, "mode must be one of ('shards', 'gather'), got 'gathered'"),
    ({"check": "yes"}, "setting 'check' must be true or false, got 'yes'"),
])
def test_bad_settings_name_the_key(given, message):
    with pytest.raises(ValueError, match="vocabpar: " + message.replace("(", r"\(").replace(")", r"\)")):
        settings_of(config({"vocabpar": given}))
    with pytest.raises(ValueError, match="must be a dict"):
        settings_of(config({"vocabpar": "on"}))


def test_vllm_finds_the_plugin_through_its_entry_point():
    found = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "vocabpar"]
    assert [e.value for e in found] == ["vocabpar.integrations.vllm:register"]


def vllm_head(vocab: int, tp: int, rank: int, pad: int = 64) -> SimpleNamespace:
    """An LM head's attributes as vLLM's ParallelLMHead computes them: the vocabulary padded to
    ``pad``, then split evenly, no added (LoRA) rows."""
    padded = -(-vocab // pad) * pad
    width = padded // tp
    start = rank * width
    end = min(start + width, vocab)
    indices = SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end,
                              num_org_elements=end - start, num_org_elements_padded=width,
                              added_vocab_start_index=vocab, added_vocab_end_index=vocab,
                              num_added_elements=0)
    return SimpleNamespace(shard_indices=indices, num_embeddings_per_partition=width,
                           num_embeddings=vocab, org_vocab_size=vocab, padding_size=pad,
                           num_added_embeddings=0)


@pytest.mark.parametrize("vocab, tp", [(1000, 2), (1000, 1), (32000, 8), (151936, 4), (50257, 2)])
def test_the_layout_read_from_vllms_shard_indices_holds_the_same_columns(vocab, tp):
    for rank in range(tp):
        head = vllm_head(vocab, tp, rank)
        layout = layout_of(head, SimpleNamespace(org_vocab_size=vocab), tp, rank)
        assert layout == VocabLayout(vocab, tp, org_vocab_size=vocab, pad_to=64)
        assert torch.equal(layout.local_token_ids(rank), column_ids(head))


def test_a_head_it_cannot_serve_is_named():
    head = vllm_head(1000, 2, 1, pad=128)  # another padding: the layout takes it from the head
    assert layout_of(head, SimpleNamespace(org_vocab_size=1000), 2, 1).pad_to == 128
    head.shard_indices.org_vocab_start_index += 1  # a split vocabpar does not make
    head.shard_indices.org_vocab_end_index += 1
    with pytest.raises(ValueError, match="rank 1's columns differ"):
        layout_of(head, SimpleNamespace(org_vocab_size=1000), 2, 1)
    with pytest.raises(ValueError, match="logits over 999 ids from a head of 1000"):
        layout_of(vllm_head(1000, 2, 0), SimpleNamespace(org_vocab_size=999), 2, 0)
    lora = vllm_head(1000, 2, 0)
    lora.num_added_embeddings = 256
    with pytest.raises(ValueError, match="256 added"):
        layout_of(lora, SimpleNamespace(org_vocab_size=1000), 2, 0)


def test_request_seeds_are_the_requests_own_or_derived_alike_on_every_rank():
    assert request_seed(7, "a", 0) == 7
    assert request_seed(-1, "a", 0) == 2**63 - 1
    derived = {request_seed(None, f"req-{i}", 0) for i in range(100)}
    assert len(derived) == 100 and all(0 <= s < 2**63 for s in derived)
    assert request_seed(None, "req-1", 0) == request_seed(None, "req-1", 0) != request_seed(None, "req-1", 1)


def test_the_grammar_bitmask_follows_the_batchs_row_order():
    words = np.arange(6, dtype=np.int32).reshape(2, 3)
    grammar = SimpleNamespace(structured_output_request_ids=["c", "a"], grammar_bitmask=words)
    mask = ordered_bitmask(["a", "b", "c"], grammar, 3)
    assert mask.dtype == torch.int32
    assert mask.tolist() == [[3, 4, 5], [-1, -1, -1], [0, 1, 2]]
    assert ordered_bitmask(["a", "b", "c"], grammar, 4) is None

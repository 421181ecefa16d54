"""A small random Llama and a byte-level BPE tokenizer, saved to a folder vLLM can serve.

The vocabulary (1000 ids) is not a multiple of 64, so vLLM pads its LM head and every rank's
shard at tensor parallelism 2 holds padding columns. Head dim 32 (CPU attention's minimum), two
KV heads (split at TP 2), float32 weights (no ties in the greedy argmax). The LM head's weights
are scaled up so that the next-token distributions are peaked enough for top-k, top-p and min-p
to keep different sets."""

from __future__ import annotations

import json
import pathlib
import sys

VOCAB = 1000
WORDS = ["red", "green", "blue", "color", "size", "small", "large", "the", "a", "is", "and", "of",
         "vocabulary", "parallel", "shard", "rank", "token", "sample", "model", "engine"]


def corpus() -> list[str]:
    """Text with plain words, digits and JSON punctuation for the BPE merges."""
    lines = []
    for i, word in enumerate(WORDS):
        other = WORDS[(i * 7 + 3) % len(WORDS)]
        lines.append(f"the {word} is {other} and {i} of {i * 13}")
        lines.append(json.dumps({"color": word, "size": i, "tags": [other, word]}))
    return lines * 20


def build(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write config, weights and tokenizer into ``folder`` (created); returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 24, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=512, bos_token_id=fast.bos_token_id,
                         eos_token_id=fast.eos_token_id, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


if __name__ == "__main__":
    print(build(pathlib.Path(sys.argv[1])))

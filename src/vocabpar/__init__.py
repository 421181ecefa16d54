"""vocabpar: the vocabulary dimension of LLM inference split across ranks."""

from vocabpar.collect import ShardedLogits, broadcast_tokens, compute_logits, iter_logits
from vocabpar.embedding import VocabParallelEmbedding
from vocabpar.head import ParallelLMHead, reference_logits, select_rows
from vocabpar.launch import init, shutdown
from vocabpar.layout import Shard, VocabLayout
from vocabpar.sampling import (
    SampleOutput,
    Sampler,
    SamplingParams,
    TokenCounts,
    VerifyOutput,
    reference_sample,
    reference_verify,
    sample,
    verify,
)
from vocabpar.sampling.scoring import TokenLogprobs, token_logprobs

__all__ = ["ParallelLMHead", "Shard", "ShardedLogits", "VocabLayout", "VocabParallelEmbedding",
           "broadcast_tokens", "compute_logits", "iter_logits", "reference_logits", "select_rows",
           "Sampler", "SampleOutput", "SamplingParams", "TokenCounts", "reference_sample", "sample",
           "TokenLogprobs", "token_logprobs",
           "VerifyOutput", "reference_verify", "verify", "init", "shutdown"]
__version__ = "0.1.0"

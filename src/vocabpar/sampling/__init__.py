"""Sampling on vocab-sharded logits, exact and identical at any number of ranks."""

from vocabpar.sampling.params import SamplingParams, TokenCounts
from vocabpar.sampling.reference import reference_sample
from vocabpar.sampling.semantics import SampleOutput
from vocabpar.sampling.sharded import sample

__all__ = ["SampleOutput", "SamplingParams", "TokenCounts", "reference_sample", "sample"]

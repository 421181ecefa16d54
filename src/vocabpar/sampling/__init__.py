"""Sampling on vocab-sharded logits, exact and identical at any number of ranks."""

from vocabpar.sampling.adaptive import sample
from vocabpar.sampling.engine import Batch, Sampler
from vocabpar.sampling.params import SamplingParams, TokenCounts
from vocabpar.sampling.reference import reference_sample, reference_verify
from vocabpar.sampling.semantics import SampleOutput, VerifyOutput
from vocabpar.sampling.verify import verify

__all__ = ["Batch", "Sampler", "SampleOutput", "SamplingParams", "TokenCounts", "VerifyOutput",
           "reference_sample", "reference_verify", "sample", "verify"]

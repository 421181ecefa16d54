"""vocabpar: the vocabulary dimension of LLM inference split across ranks."""

from vocabpar.layout import Shard, VocabLayout

__all__ = ["Shard", "VocabLayout"]
__version__ = "0.1.0"

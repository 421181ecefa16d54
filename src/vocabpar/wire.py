"""Sizes of the fixed-format messages vocabpar sends, shared by ``vocabpar.comm`` (which sends
them) and the planner (which prices them) without importing ``torch.distributed``."""

AGREE_WIDTH = 32
"""int64 words per rank in a checked agreement exchange: valid flag, fact count, up to 30 facts."""


def agreement_words(checked: bool, varying: int) -> int:
    """int64 words per rank of one agreement exchange: the full record when the checks are on,
    else only the header and the ``varying`` per-rank values the caller needs (e.g. DP row
    counts); 0 when nothing needs sending."""
    if checked:
        return AGREE_WIDTH
    return 2 + varying if varying else 0

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


# The sharded sampler's messages (see ``vocabpar.sampling.sharded``), per batch row and rank.
MAX_CANDIDATES = 256
"""top-k beyond this uses the threshold search."""
TOP_P_CANDIDATES = 512
"""Round-one candidates over all ranks when a row has top-p: certifies peaked (LLM-like) rows,
which keep ~100-350 tokens."""
MIN_P_CANDIDATES = 16
SEARCH_BITS = 11
"""Key bits one histogram round of a threshold search resolves: ``2**SEARCH_BITS + 1`` int64."""
SETTLE_BITS = 10
"""A bucket of at most ``2**SETTLE_BITS`` keys is settled by gathering its tokens."""
SETTLE_TOKENS = 16
"""Tokens of the final bucket each rank sends per row when settling a threshold search."""


def candidate_count(ranks: int, widest: int, *, top_k: int, top_p: bool, min_p: bool) -> int:
    """Round-one candidates per rank and sampled row: enough for the largest small top-k
    (``top_k``: the largest k in ``(0, MAX_CANDIDATES]`` of any sampled row, else 0), for top-p and
    for min-p, at most ``widest`` (the most real tokens one rank holds)."""
    need = [1]
    if 0 < top_k <= MAX_CANDIDATES:
        need.append(top_k)
    if top_p:
        need.append(-(-TOP_P_CANDIDATES // ranks))
    if min_p:
        need.append(MIN_P_CANDIDATES)
    return min(max(need), widest)


def round_one_words(candidates: int) -> int:
    """Round one: the shard's (max, id), then its top candidates' (value, id)."""
    return 2 + 2 * candidates


def histogram_words() -> int:
    """One histogram round of a threshold search: the digits' weights plus the weight above."""
    return 2**SEARCH_BITS + 1


def settle_words(draw: bool) -> int:
    """The settling all-gather: bucket count, (key, weight) of ``SETTLE_TOKENS`` tokens, and to
    draw also their (id, score) and the rank's best (score, id) above the bucket."""
    return 1 + (4 if draw else 2) * SETTLE_TOKENS + (2 if draw else 0)


DRAW_WORDS = 2
"""The draw's all-gather: each rank's best (score, id)."""


# Scoring on shards (see ``vocabpar.sampling.scoring.token_logprobs``), per scored row and rank.
SCORE_ROWS = 256
"""Hidden rows whose logits one scoring call computes (``ParallelCausalLM.score``, prompt
logprobs): no rank holds more than one ``[SCORE_ROWS, V/n]`` block of logits."""


def score_words(top_n: int) -> int:
    """The scoring all-gather: the shard's max, its sum-exp, the scored token's logit, and its
    top-n (value, id); an all-reduce of one more word (the rank count) follows."""
    return 3 + 2 * top_n

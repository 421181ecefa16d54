"""Each operation's collective script beside its price.

A script is the ordered tuple of :class:`Message` s one call sends: which collective, which
record, how many rows. The sampler is adaptive -- which collectives it needs depends on the
logits -- so its script is a function of the *path* a call took (:class:`SamplePath`: a handful
of row counts), which the call reports; the planner builds the typical and the worst path of a
workload (:func:`sampler_paths`) and prices them with the same function. A test runs every
sampler configuration and checks the collectives and bytes ``vocabpar.comm`` measured against
:func:`price` of the reported script, message for message.

Adding a sampling filter means: its entry in :mod:`vocabpar.wire.filters`, its messages as
records (:mod:`vocabpar.wire.records`), its branch in :class:`SamplePath` / :func:`sample_script`
and in :func:`sampler_paths`, and the sampler code that sends them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vocabpar.wire.filters import BY_NAME, FILTERS, Sampling, candidate_count, masks_on
from vocabpar.wire.records import (
    AGREE_WIDTH,
    DRAW,
    HISTOGRAM,
    LARGER,
    MASSES,
    TOTAL,
    Record,
    agreement,
    folded,
    histogram,
    round_one,
    score,
    settle,
)
from vocabpar.wire.traffic import Traffic, all_gather, all_reduce, between

SCORE_ROWS = 256
"""Hidden rows whose logits one scoring call computes (prompt logprobs, ``score``): no rank
holds more than one ``[SCORE_ROWS, V/n]`` block of logits."""


@dataclass(frozen=True)
class Message:
    """One collective: ``kind`` (``"all_gather"`` or ``"all_reduce"``) of ``rows`` rows of
    ``record``."""

    kind: str
    record: Record
    rows: int

    def traffic(self, ranks: int) -> Traffic:
        """What one rank of ``ranks`` takes part in (nothing on one rank)."""
        send = all_gather if self.kind == "all_gather" else all_reduce
        return send(self.record.nbytes(self.rows), ranks)


Script = tuple[Message, ...]


def price(script: Sequence[Message], ranks: int) -> Traffic:
    """The traffic of ``script`` on one of ``ranks`` ranks."""
    return sum((m.traffic(ranks) for m in script), Traffic())


CHECK = Message("all_gather", agreement(AGREE_WIDTH - 2), 1)
"""The per-call agreement check every entry point runs first when checks are on."""


# ---------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class Search:
    """One threshold search over ``rows`` rows: ``rounds`` histogram all-reduces, one settling
    all-gather (which also draws the rows' tokens when ``draw``), and, when some row's final
    bucket held more distinct keys than the settle carries (``crowded``), one more histogram
    round."""

    rows: int
    rounds: int = 2
    draw: bool = False
    crowded: bool = False

    def script(self) -> Script:
        histogram = Message("all_reduce", HISTOGRAM, self.rows)
        return (histogram,) * self.rounds + (Message("all_gather", settle(self.draw), self.rows),) \
            + (histogram,) * self.crowded


@dataclass(frozen=True)
class SamplePath:
    """The branches one sampler call took: ``rows`` in the batch, ``candidates`` per rank in
    round one (0: greedy), the top-k threshold ``search`` (``None``: candidates sufficed), the
    rows whose top-p ``total_rows`` was all-reduced, the top-p threshold search, the rows drawn
    by the all-gather of each rank's best (``draw_rows``), the logprob count (``top_n``;
    ``None``: no logprobs) and whether the agreement check ran first."""

    rows: int
    candidates: int = 0
    top_k: Search | None = None
    total_rows: int = 0
    top_p: Search | None = None
    draw_rows: int = 0
    top_n: int | None = None
    checked: bool = False
    masks: tuple[str, ...] = ()
    """The mask filters whose sums ride in round one."""


def sample_script(path: SamplePath) -> Script:
    """What a sampler call that took ``path`` sends, in order."""
    script = (CHECK,) * path.checked + (Message("all_gather", round_one(path.candidates, masks=path.masks),
                                                path.rows),)
    if path.top_k is not None:
        script += path.top_k.script()
    if path.total_rows:
        script += (Message("all_reduce", TOTAL, path.total_rows),)
    if path.top_p is not None:
        script += path.top_p.script()
    if path.draw_rows:
        script += (Message("all_gather", DRAW, path.draw_rows),)
    if path.top_n is not None:
        script += score_script(path.rows, path.top_n)
    return script


def sampler_paths(rows: int, ranks: int, widest: int, vocab: int,
                  s: Sampling) -> tuple[SamplePath, SamplePath]:
    """The typical and the worst path of a sampler call on ``rows`` rows sharing the sampling
    ``s`` (``widest``: the most real tokens one rank holds).

    Typical means LLM-like peaked rows without ties: a top-k with k <= c and top-p are settled
    by the candidates, top-p without such a top-k needs its total all-reduced, a top-k with
    k > c a threshold search of two rounds, and the token is drawn locally unless no filter
    narrows the row. The worst case (flat or tied rows) adds, wherever the code may take them,
    the total, a top-p search, a crowded settle's extra round after each search and the draw's
    all-gather, each for every row. A mask filter's sums ride in round one; where one that spares
    only sent tokens on peaked rows (top-n-sigma) is on and round one sends more than one
    candidate per rank, typically no total and no draw follow."""
    if s.greedy:
        greedy = SamplePath(rows)
        return greedy, greedy
    c = s.candidates(ranks, widest)
    k = s.top_k if s.top_k < vocab else 0  # top-k over the whole vocabulary filters nothing
    with_top_p = s.top_p < 1
    unsent = c < widest  # some rank holds tokens it did not send
    searched = k > c
    narrowed = any(f.on(getattr(s, f.name), vocab) for f in FILTERS if not f.words)  # some threshold on
    masks = s.masks()
    kept_unsent = unsent and not (c > 1 and any(BY_NAME[name].keeps_only_sent for name in masks))  # typically
    typical = SamplePath(rows, c, top_k=Search(rows, draw=not with_top_p) if searched else None,
                         total_rows=rows * (with_top_p and kept_unsent and not 0 < k <= c),
                         draw_rows=rows * (kept_unsent and not narrowed), masks=masks)
    worst = SamplePath(rows, c, top_k=Search(rows, draw=not with_top_p, crowded=True) if searched else None,
                       total_rows=rows * (with_top_p and unsent),
                       top_p=Search(rows, draw=True, crowded=True) if with_top_p and unsent else None,
                       draw_rows=rows * unsent, masks=masks)
    return typical, worst


def sampler_price(paths: tuple[SamplePath, SamplePath], ranks: int) -> Traffic:
    """Typical..worst traffic of the pair :func:`sampler_paths` returns."""
    typical, worst = paths
    return between(price(sample_script(typical), ranks), price(sample_script(worst), ranks))


# ---------------------------------------------------------------------- verification
@dataclass(frozen=True)
class VerifyPath:
    """The branches one verification took: its stacked rows' sampler call (``sample``), the
    (row, draft position) pairs whose exact masses were all-reduced (``weighed``) and the rows
    that drew a correction from the residual (``rejected``)."""

    sample: SamplePath
    weighed: int = 0
    rejected: int = 0


def verify_script(path: VerifyPath) -> Script:
    """What a verification that took ``path`` sends, in order."""
    script = sample_script(path.sample)
    if path.weighed:
        script += (Message("all_reduce", MASSES, path.weighed),)
    if path.rejected:
        script += (Message("all_gather", DRAW, path.rejected),)
    return script


def verify_paths(batch: int, drafts: int, draft_logits: bool, ranks: int, widest: int, vocab: int,
                 s: Sampling) -> tuple[VerifyPath, VerifyPath]:
    """Typical and worst path of verifying ``drafts`` tokens per row of ``batch``: one sampler
    call on the ``B·(k+1)`` target rows -- with draft logits and sampled rows the ``B·k`` draft
    rows join it, the masses of every draft position are all-reduced and, in the worst case,
    every row draws a correction (typically none does)."""
    weigh = draft_logits and not s.greedy and drafts > 0
    rows = batch * (drafts + 1 + drafts * weigh)
    typical, worst = sampler_paths(rows, ranks, widest, vocab, s)
    weighed = batch * drafts * weigh
    return VerifyPath(typical, weighed), VerifyPath(worst, weighed, batch * weigh)


def verify_price(paths: tuple[VerifyPath, VerifyPath], ranks: int) -> Traffic:
    typical, worst = paths
    return between(price(verify_script(typical), ranks), price(verify_script(worst), ranks))


# ---------------------------------------------------------------------- the engine's fixed scripts
ENGINE_FACTS = 10
"""Words of the check an engine call folds into its first message: one per fact the ranks must
share."""
KEY_BITS = 32
"""An engine threshold search finds an exact 32-bit order key, whatever the logits hold (ties
included), in rounds that each resolve some of its bits."""
SEARCH_WIDTHS = range(4, 12)
"""How many bits one round of an engine search may resolve: the choices :func:`choose_search_bits`
weighs (a round of ``b`` bits all-reduces ``2**b + 1`` words per row). Never more than 11: each
rank also builds, zeroes and scans its ``2**b``-bin histograms, work the price leaves out."""


def search_bits(width: int) -> tuple[int, ...]:
    """The 32 key bits in the fewest rounds of at most ``width`` bits, the wider rounds first:
    ``search_bits(11) == (11, 11, 10)``, ``search_bits(8) == (8, 8, 8, 8)``."""
    if width not in SEARCH_WIDTHS:
        raise ValueError(f"a search round resolves {SEARCH_WIDTHS.start}-{SEARCH_WIDTHS.stop - 1} bits, "
                         f"got {width}")
    rounds = -(-KEY_BITS // width)
    base, wider = divmod(KEY_BITS, rounds)
    return tuple(base + (i < wider) for i in range(rounds))


def checked_search_bits(bits: tuple[int, ...]) -> tuple[int, ...]:
    """``bits`` as a tuple, when they are rounds of :data:`SEARCH_WIDTHS` bits adding up to 32;
    else ``ValueError``."""
    rounds = tuple(bits) if isinstance(bits, (tuple, list)) else ()
    bad = any(isinstance(b, bool) or b not in SEARCH_WIDTHS for b in rounds)
    if not rounds or bad or sum(rounds) != KEY_BITS:
        raise ValueError(f"search_bits must be rounds of {SEARCH_WIDTHS.start}-{SEARCH_WIDTHS.stop - 1} bits "
                         f"adding up to {KEY_BITS}, got {bits!r}")
    return rounds


ENGINE_SEARCH_BITS = search_bits(11)
"""The rounds of an engine search unless the sampler chooses others: three, 11, 11 and 10 bits."""


def choose_search_bits(rows: int, ranks: int, latency: float, bandwidth: float) -> tuple[int, ...]:
    """The rounds whose search takes least time for messages of ``rows`` rows on ``ranks`` ranks:
    each round costs ``latency`` seconds plus the bytes one rank receives (priced by the same
    histogram records the search sends) over ``bandwidth`` bytes/s. Ties go to fewer rounds."""
    def seconds(bits: tuple[int, ...]) -> float:
        return len(bits) * latency + price(engine_search_script(rows, bits), ranks).bytes / bandwidth
    choices = sorted({search_bits(w) for w in SEARCH_WIDTHS}, key=len)
    return min(choices, key=seconds)


@dataclass(frozen=True)
class EnginePlan:
    """What an engine call sends, decided on the host from the batch's parameters alone: every
    message carries ``rows`` (the sampler's ``max_rows``) rows whatever the call's batch.
    ``candidates`` per rank in round one; ``facts`` words of the folded check; a top-k
    threshold search, a top-p one, the draw's all-gather; ``top_n``: the logprob record's width
    (``None``: no logprobs); with ``drafts`` (verification), the exact masses and the
    correction's all-gather."""

    rows: int
    candidates: int = 0
    facts: int = ENGINE_FACTS
    top_k_search: bool = False
    top_p_search: bool = False
    draw: bool = False
    top_n: int | None = None
    drafts: bool = False
    search_bits: tuple[int, ...] = ENGINE_SEARCH_BITS
    masks: tuple[str, ...] = ()
    """The mask filters whose sums ride in round one (some sampled row asks each)."""


def engine_plan(rows: int, ranks: int, widest: int, vocab: int, *, greedy: Sequence[bool],
                values: Mapping[str, Sequence[float]], top_n: int | None = None,
                search_bits: tuple[int, ...] = ENGINE_SEARCH_BITS) -> EnginePlan:
    """The plan of an engine ``sample`` call padded to ``rows`` rows, from its rows' parameters
    alone: ``greedy`` and, per filter of :data:`vocabpar.wire.filters.FILTERS`, every row's value
    (a filter left out is off; top-k 0 is off; ``widest``: the most real tokens one rank holds).
    Candidates as the adaptive sampler sends; with some rank's tokens unsent, a top-k beyond the
    candidates takes a search, top-p on rows without such a small top-k takes one, and the token
    is drawn by an all-gather; with every token sent, the candidates decide everything.
    The sums of each mask filter some sampled row asks ride in round one."""
    sampled = [not g for g in greedy]
    if not any(sampled):
        return EnginePlan(rows, 0, top_n=top_n, search_bits=search_bits)
    on = {name: [v for s, v in zip(sampled, row_values) if s] for name, row_values in values.items()}
    c = candidate_count(ranks, widest, on)
    unsent = c < widest
    top_k = on.get("top_k", [0] * sum(sampled))
    large_k = any(c < k < vocab for k in top_k)
    top_p_alone = any(p < 1 and not 0 < k <= c for k, p in zip(top_k, on.get("top_p", [])))
    return EnginePlan(rows, c, top_k_search=unsent and large_k, top_p_search=unsent and top_p_alone,
                      draw=unsent, top_n=top_n, search_bits=search_bits,
                      masks=masks_on(on))


def engine_search_script(rows: int, bits: tuple[int, ...] = ENGINE_SEARCH_BITS) -> Script:
    """One threshold search: a histogram all-reduce of ``rows`` rows per round of ``bits``."""
    return tuple(Message("all_reduce", histogram(b), rows) for b in bits)


def engine_sample_script(plan: EnginePlan) -> Script:
    """The fixed script of :meth:`vocabpar.sampling.engine.Sampler.sample` (and, with
    ``plan.drafts``, of ``verify``): the same collectives with the same sizes for any logits."""
    rows = plan.rows
    first = round_one(plan.candidates, ties=True, masks=plan.masks)
    script = (Message("all_gather", folded(first, rows, plan.facts), 1),)
    script += engine_search_script(rows, plan.search_bits) * (plan.top_k_search + plan.top_p_search)
    if plan.draw:
        script += (Message("all_gather", DRAW, rows),)
    if plan.drafts:
        script += Message("all_reduce", MASSES, rows), Message("all_gather", DRAW, rows)
    if plan.top_n is not None:
        script += score_script(rows, plan.top_n)
    return script


def engine_score_script(rows: int, top_n: int, facts: int) -> Script:
    """The fixed script of the engine's ``token_logprobs``: the score all-gather carrying the
    check, then the rank counts."""
    return Message("all_gather", folded(score(top_n), rows, facts), 1), Message("all_reduce", LARGER, rows)


# ---------------------------------------------------------------------- scoring
def score_script(rows: int, top_n: int) -> Script:
    """``token_logprobs`` on ``rows`` rows: one all-gather of each shard's (max, sum-exp, scored
    logit, top-n), one all-reduce of the rank counts."""
    return Message("all_gather", score(top_n), rows), Message("all_reduce", LARGER, rows)


def score_blocks(tokens: int) -> list[int]:
    """Rows of each scoring call when ``tokens`` prompt tokens are scored ``SCORE_ROWS`` at a time."""
    return [SCORE_ROWS] * (tokens // SCORE_ROWS) + [tokens % SCORE_ROWS] * bool(tokens % SCORE_ROWS)


def calls(script: Sequence[Message], ranks: int) -> list[tuple[str, int]]:
    """``(kind, bytes received)`` of each collective of ``script`` on one of ``ranks`` ranks, in
    order, as :func:`vocabpar.comm.recording` lists what was measured (none on one rank)."""
    return [(m.kind, m.traffic(ranks).bytes) for m in script] if ranks > 1 else []

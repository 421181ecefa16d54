"""The planner: what each vocabulary design costs per rank, and which one to use.

:mod:`vocabpar.plan.model` holds the cost model (units and limits, quantities, the workload and
the designs, the traffic of each step, :func:`plan`); :mod:`vocabpar.plan.report` recommends a
design, formats quantities and recomputes the study's figures. The byte formulas themselves are
:mod:`vocabpar.wire`'s; pictures are drawn by :mod:`vocabpar.plots`. Nothing here imports
``torch.distributed`` or matplotlib. The names callers use are re-exported here.
"""

from vocabpar.plan.model import (
    DESIGNS,
    DTYPE_BYTES,
    LATENCY,
    LIMITS,
    SAMPLING_LIMITS,
    Design,
    DesignCost,
    GiB,
    KiB,
    MiB,
    Sampling,
    Workload,
    busiest_owner,
    check_limit,
    compute_time,
    design_cost,
    dtype_bytes,
    embedding_exchange_bytes,
    embedding_traffic,
    greedy_sampling_bytes,
    head_flops,
    hidden_gather_bytes,
    kv_tokens,
    logits_buffer_bytes,
    logits_bytes,
    logits_collection_bytes,
    logits_traffic,
    plan,
    sampler_traffic,
    score_bytes,
    shard_rows,
    step_traffic,
    transfer_time,
    verify_step_traffic,
    verify_traffic,
    weight_bytes,
)
from vocabpar.plan.report import (
    STUDY,
    UNITS,
    Recommendation,
    StudyFigure,
    format_quantity,
    human,
    is_study_shape,
    recommend,
    study_figures,
    winners,
)
from vocabpar.wire.strategies import GREEDY_PAIR_BYTES
from vocabpar.wire.traffic import Traffic, all_gather, all_reduce, exact, maybe

__all__ = [
    "DESIGNS", "DTYPE_BYTES", "GREEDY_PAIR_BYTES", "LATENCY", "LIMITS", "SAMPLING_LIMITS", "STUDY", "UNITS",
    "Design", "DesignCost", "GiB", "KiB", "MiB", "Recommendation", "Sampling", "StudyFigure", "Traffic",
    "Workload", "all_gather", "all_reduce", "busiest_owner", "check_limit", "compute_time", "design_cost",
    "dtype_bytes", "embedding_exchange_bytes", "embedding_traffic", "exact", "format_quantity",
    "greedy_sampling_bytes", "head_flops", "hidden_gather_bytes", "human", "is_study_shape", "kv_tokens",
    "logits_buffer_bytes", "logits_bytes", "logits_collection_bytes", "logits_traffic", "maybe", "plan",
    "recommend", "sampler_traffic", "score_bytes", "shard_rows", "step_traffic", "study_figures",
    "transfer_time", "verify_step_traffic", "verify_traffic", "weight_bytes", "winners",
]

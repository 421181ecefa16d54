"""The planner: what each vocabulary design costs per rank, and which one to use.

:mod:`vocabpar.plan.model` holds the cost model's quantities (units and limits, the workload and
the designs, the traffic of each step); :mod:`vocabpar.plan.machine` the execution modes (seconds
per collective, launch and host read, with sources); :mod:`vocabpar.plan.host` the launches and
host reads each design's code path makes; :mod:`vocabpar.plan.cost` every design priced
(:func:`plan`); :mod:`vocabpar.plan.crossover` the batch below which gathering beats sampling on
shards, and ``strategy="auto"``'s choice; :mod:`vocabpar.plan.report` recommends a design,
formats quantities and recomputes the study's figures. The byte formulas themselves are
:mod:`vocabpar.wire`'s; pictures are drawn by :mod:`vocabpar.plots`. Nothing here imports
``torch.distributed`` or matplotlib. The names callers use are re-exported here.
"""

from vocabpar.plan import host
from vocabpar.plan.cost import (
    STEPS,
    DesignCost,
    design_cost,
    host_work,
    path_time,
    path_traffic,
    plan,
    sampler_key,
    score_traffic,
)
from vocabpar.plan.crossover import GATHER, SHARDS, Crossover, Switch, crossover, crossovers
from vocabpar.plan.host import HostWork
from vocabpar.plan.machine import DEFAULT_MODE, MODES, Mode, mode
from vocabpar.plan.model import (
    DESIGNS,
    DTYPE_BYTES,
    LATENCY,
    LAUNCH,
    LIMITS,
    SAMPLING_LIMITS,
    SYNC,
    Design,
    GiB,
    KiB,
    MiB,
    Sampling,
    Workload,
    busiest_owner,
    check_limit,
    compute_time,
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
from vocabpar.plan.text import format_table, report_text
from vocabpar.wire.strategies import GREEDY_PAIR_BYTES
from vocabpar.wire.traffic import Traffic, all_gather, all_reduce, exact, maybe

__all__ = [
    "Crossover", "DEFAULT_MODE", "DESIGNS", "DTYPE_BYTES", "Design", "DesignCost", "GATHER",
    "GREEDY_PAIR_BYTES", "GiB", "HostWork", "KiB", "LATENCY", "LAUNCH", "LIMITS", "MODES", "MiB", "Mode",
    "Recommendation", "SAMPLING_LIMITS", "SHARDS", "STEPS", "STUDY", "SYNC", "Sampling", "StudyFigure",
    "Switch", "Traffic", "UNITS", "Workload", "all_gather", "all_reduce", "busiest_owner", "check_limit",
    "compute_time", "crossover", "crossovers", "design_cost", "dtype_bytes", "embedding_exchange_bytes",
    "embedding_traffic", "exact", "format_quantity", "format_table", "greedy_sampling_bytes", "head_flops",
    "hidden_gather_bytes", "host", "host_work", "human", "is_study_shape", "kv_tokens",
    "logits_buffer_bytes", "logits_bytes", "logits_collection_bytes", "logits_traffic", "maybe", "mode",
    "path_time", "path_traffic", "plan", "recommend", "report_text", "sampler_key", "sampler_traffic",
    "score_bytes", "score_traffic", "shard_rows", "step_traffic", "study_figures", "transfer_time",
    "verify_step_traffic", "verify_traffic", "weight_bytes", "winners",
]

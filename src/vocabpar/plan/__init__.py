"""The planner: what each vocabulary design costs per rank, and which one to use.

:mod:`vocabpar.plan.model` holds the cost model's quantities (units and limits, the workload and
the designs, the traffic of each step); :mod:`vocabpar.plan.machine` the execution modes (seconds
per collective, launch and host read, with sources); :mod:`vocabpar.plan.host` the launches and
host reads each design's code path makes; :mod:`vocabpar.plan.cost` every design priced
(:func:`plan`); :mod:`vocabpar.plan.crossover` the batch below which gathering beats sampling on
shards, and ``strategy="auto"``'s choice; :mod:`vocabpar.plan.recommend` the design to use;
:mod:`vocabpar.plan.study` the study's figures recomputed. A step's sampling (:class:`Sampling`) is
:mod:`vocabpar.wire.filters`', one field per filter. The byte formulas themselves are
:mod:`vocabpar.wire`'s; the report's text is :mod:`vocabpar.report`'s, pictures
:mod:`vocabpar.plots`'. Nothing here imports ``torch.distributed`` or matplotlib. The names
callers use are re-exported here; everything else is imported from the module that defines it.
"""

from vocabpar.plan.cost import DesignCost, plan
from vocabpar.plan.crossover import Crossover, Switch, crossover, crossovers
from vocabpar.plan.machine import MODES, Mode, mode
from vocabpar.plan.model import DESIGNS, Design, GiB, Workload, dtype_bytes
from vocabpar.plan.recommend import Recommendation, recommend
from vocabpar.wire.filters import Sampling

__all__ = [
    "DESIGNS", "Crossover", "Design", "DesignCost", "GiB", "MODES", "Mode", "Recommendation", "Sampling",
    "Switch", "Workload", "crossover", "crossovers", "dtype_bytes", "mode", "plan", "recommend",
]

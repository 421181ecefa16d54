"""The compile machinery: the sampler's local passes over a shard as plain torch functions
(:mod:`~vocabpar.kernels.fused`), compiled on first use; the compiled programs kept on disk
(:mod:`~vocabpar.kernels.store`); compiling them ahead of time (:mod:`~vocabpar.kernels.warm`,
``vocabpar warm``).

Invariant: a pass gives the same bits compiled or eager, on any input. Nothing here sends or
receives (no :mod:`vocabpar.comm`) or orchestrates a sampler call: from :mod:`vocabpar.sampling`
the passes take only the float steps they compute (``noise``, ``semantics``)."""

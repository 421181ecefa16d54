"""What crosses ranks, as data: the byte model, one record per message, each operation's
collective script beside its price, the collection strategies' facts, and the sampling filters
whose parameters decide what a sampler sends.

Pure: torch dtypes and tensor packing only, never ``torch.distributed``. ``vocabpar.comm`` sends,
the sampler, verifier and scorer pack and unpack with these records, and the planner prices the
same records, so what is sent and what is priced cannot drift apart.
"""

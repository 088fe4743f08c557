"""Embedding tables. The job API's layers (``psctl.job``): ``FeatureEmbedding``
(``layers``), a fixed hashed table, and ``DynamicEmbedding`` (``dynamic``), a table keyed by
raw ids that grows and forgets. Apart from the layers, as TorchRec keeps them: their
sharding over the ps tasks and their updates there, for the fixed tables (``sharded``: the
plan and the shards; ``sparse``: the optimizers' sparse rules) and the dynamic ones
(``dynamic_updates``: the update after a step, eviction passes, counts), and the rules that
change a dynamic table's rows (``rows``), shared by psctl's step on the ps tasks and by
Keras training a layer in one process."""

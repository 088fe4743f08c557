"""Embedding layers of the job API (``psctl.job``): ``FeatureEmbedding`` (``layers``), a
fixed hashed table, and ``DynamicEmbedding`` (``dynamic``), a table keyed by raw ids that
grows and forgets, with the rules that change its rows (``rows``) shared by psctl's step on
the ps tasks and by Keras training it in one process. Their sharding over the ps tasks and
their updates there are training's (training/tables.py, sparse.py, dynamic_updates.py)."""

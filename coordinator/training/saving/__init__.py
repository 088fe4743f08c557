"""What training writes that outlives it: ``checkpoints`` (restore, periodic and requested
saves) over ``sharded_save`` (each ps saves and restores its own variables and table shards)
and ``checkpoint_files`` (a directory's checkpoints, the damaged-one fallback, the state
file); ``saved_model`` (``psctl export``'s SavedModel)."""

"""The training process: strategy, loop, step programs, checkpoints, evaluation."""

"""What a run tells: ``publish`` (status and Prometheus), ``tensorboard``, ``progress`` (the
progress line) and ``summary`` (the run's summary and its JSON)."""

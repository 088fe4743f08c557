"""The job's model as training builds it: ``model`` (the model, its optimizer and metrics,
and the training state on the ps tasks), ``features`` (the dataset's features against the
model's inputs), ``metric_objects``, ``outputs`` (a model's outputs by name) and
``job_check`` (the job checked before any server starts)."""

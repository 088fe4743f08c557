"""The job's model as training builds it: ``model`` (the model, its optimizer and metrics,
and the training state on the ps tasks), ``features`` (the dataset's features against the
model's inputs), ``metric_objects``, ``outputs`` (a model's outputs by name) and
``same_data`` (the warning for workers that would all read the same examples)."""

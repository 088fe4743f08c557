"""The job's input data: the file formats psctl reads (CSV, TFRecord, Criteo's TSV), each
checked before training (``checks``: the shared checks and the dispatch; ``criteo``,
``tfrecord_check``), the listing and cutting of files into pieces checked in parallel
(``files``, ``table_scan``), the datasets the workers read (``readers``, ``criteo``), and the
bad records a reader meets while training (``bad_records``). Free of TensorFlow at import,
but for the readers."""

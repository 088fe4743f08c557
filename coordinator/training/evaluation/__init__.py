"""Evaluation, all three kinds: ``final_eval`` (the run's last, on the coordinator),
``inline_eval`` (``--eval-every``, on the workers), ``sidecar_eval`` (``psctl evaluate``'s),
and their one line format (``report``)."""

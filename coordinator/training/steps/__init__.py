"""What one scheduled call runs: ``programs`` (the ``StepProgram`` protocol, the default and
local-step programs), ``local_step``, ``epochs`` (the ``--epochs`` program), ``packing``
(steps per call) and ``graph_ops``."""

"""Process plumbing every role shares: child processes that die with their parent
(``procs``), stop signals handled on a relay thread (``signals``), log set-up (``logs``),
files written atomically (``files``), systemd's readiness protocol (``sdnotify``) and the
check that a process's Python packages are there (``requirements``)."""

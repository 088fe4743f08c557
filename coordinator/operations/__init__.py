"""What operators see and drive of a job: its state in one plain object (job_state.py, with
the states and transitions of state.py), the task health checks, the Control gRPC service
that translates it (psctl's API, generated under psctl.control.v1), its credentials, the
launcher's front, the client commands and the coordinator's Prometheus metrics."""

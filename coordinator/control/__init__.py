"""The job's control plane: state, the Control gRPC service and client, metrics."""

"""The job's control plane: states and their transitions, the Control gRPC service and
client, metrics."""

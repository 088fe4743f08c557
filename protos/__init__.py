"""psctl's own gRPC API: .proto sources and generated Python."""

"""`worker-server`: a worker task (thin entry point over cluster.server)."""

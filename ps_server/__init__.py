"""`ps-server`: a parameter-server task (thin entry point over cluster.server)."""

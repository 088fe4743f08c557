"""What every psctl role shares: cluster spec parsing and validation, server bootstrap."""

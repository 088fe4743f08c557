"""Built-in psctl jobs."""

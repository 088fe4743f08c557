"""Starting processes: the training process, its supervisor, local clusters."""

"""`python -m pisft doctor`: whether this node can run the configured training (see checks)."""

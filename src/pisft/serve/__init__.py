"""pisft.serve: the model over openpi's websocket policy protocol."""

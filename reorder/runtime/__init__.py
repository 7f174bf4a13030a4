"""The iterator a training loop holds: windows read, exchanged (optionally in the background) and served."""

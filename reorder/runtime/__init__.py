"""The iterator a training loop holds: windows read, exchanged (optionally in the background) and served."""

from reorder.runtime.buffer import PassThroughBuffer, ReorderingBuffer

__all__ = ["PassThroughBuffer", "ReorderingBuffer"]

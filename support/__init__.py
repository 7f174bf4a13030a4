"""Test support (not installed): the emulated-collective harness and the invariant checks against `spec/`."""

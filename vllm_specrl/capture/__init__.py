"""Capture: stream the target's hidden states for committed tokens out of the worker."""

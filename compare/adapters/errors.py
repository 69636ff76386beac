"""The error a port's broken promise raises (a module of its own, so that the adapters that
raise it need not import the package that imports them)."""

from __future__ import annotations

from llamaspec import LlamaParityError


class PortError(LlamaParityError, ValueError):
    """A port's capture returned something other than what the protocol and its taps
    promise, or raised; the message names the port, the tap, the expected and the actual."""

"""The one exception type the commands raise for bad input or failed steps."""

from __future__ import annotations


class E2Error(Exception):
    """A failure the user can act on: what went wrong, and what to do next.

    The CLI prints ``message`` and ``hint`` and exits non-zero; no traceback.
    """

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 1):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"

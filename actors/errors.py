"""Errors in the user's training code or data, raised where they are found.

A ``UserError`` stops the whole job (retrying the same code on another node cannot help):
the elastic controller re-raises it in the driver, and the CLI prints it on one line. It
pickles cleanly, so it crosses the actor boundary intact.
"""

from __future__ import annotations


class UserError(ValueError):
    """``str()`` is ``"<what>: <message>"`` on one line; ``what`` names the part to fix
    (``model``, ``loss``, ``optimizer``, ``data``, ``state``)."""

    def __init__(self, what: str, message: str) -> None:
        self.what = what
        self.message = " ".join(str(message).split())
        super().__init__(f"{what}: {self.message}")

    def __reduce__(self):
        return (type(self), (self.what, self.message))


def find_user_error(exc: BaseException) -> UserError | None:
    """A plain ``UserError`` like the one behind ``exc`` (a Ray task error wraps it as its
    cause, in a class that is both), or None."""
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(exc, UserError):
            return UserError(exc.what, exc.message)
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None

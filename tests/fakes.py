"""Test doubles shared by the unit tests: one place for each."""

from __future__ import annotations

UNAVAILABLE = 14


class FakeOpError(Exception):
    """What psctl's code sees of ``tf.errors.OpError``: an int ``error_code`` (a gRPC
    status code), a str ``message``, and ``str(err) == message`` (checked against
    TensorFlow 2.21). No TensorFlow needed."""

    def __init__(self, error_code: int, message: str) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.message = message

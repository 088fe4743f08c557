"""Typed entry points into the generated gRPC code for psctl.control.v1.Control.

``control_pb2_grpc`` is generated without annotations; the client and the server reach it
only through this module, which states the types they rely on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from psctl.control.v1 import control_pb2, control_pb2_grpc


class ControlStub(Protocol):
    """The client stub: one callable per RPC (request, timeout=...) -> response."""

    GetStatus: Callable[..., control_pb2.Status]
    WatchStatus: Callable[..., Iterator[control_pb2.Status]]
    Checkpoint: Callable[..., control_pb2.CheckpointResponse]
    Pause: Callable[..., control_pb2.PauseResponse]
    Resume: Callable[..., control_pb2.ResumeResponse]
    Stop: Callable[..., control_pb2.StopResponse]


def control_stub(channel: grpc.Channel) -> ControlStub:
    new: Callable[[grpc.Channel], ControlStub] = control_pb2_grpc.ControlStub
    return new(channel)


def add_control_servicer(servicer: control_pb2_grpc.ControlServicer, server: Any) -> None:
    """Register ``servicer`` on ``server`` (a ``grpc.Server``)."""
    add: Callable[[control_pb2_grpc.ControlServicer, Any], None] = (
        control_pb2_grpc.add_ControlServicer_to_server
    )
    add(servicer, server)

"""The error every attnd call raises: :class:`AttndError` (a gRPC status code and the server's
message)."""

from __future__ import annotations

import grpc

__all__ = ["AttndError"]


class AttndError(Exception):
    """A failed attnd call: ``code`` is the grpc.StatusCode, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> AttndError:
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = error.details() if callable(getattr(error, "details", None)) else None
        if code == grpc.StatusCode.CANCELLED and details == "CANCELLED":
            # gRPC's word for a call that reached a server as it shut down, before a handler
            # took it (grpc/grpc#41785; newer gRPC says UNAVAILABLE). A call this client cancels
            # says "Locally cancelled by application!": this one is the server going away.
            return cls(grpc.StatusCode.UNAVAILABLE,
                       "the server shut down before handling the call (gRPC said CANCELLED); "
                       "retry")
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(error))


class _StreamClosed(RuntimeError):
    """A call on a closed Step stream (one cancelled from another thread, say): nothing was sent,
    so a plane it staged on learns nothing of the server (:meth:`DataPlane.failed`)."""

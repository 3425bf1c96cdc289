"""Stand-ins for what the unit tests must pin down: the coordinator's transport."""

from __future__ import annotations

from idlegrad.common import protocol as proto


class RecordingTransport:
    """The coordinator's transport, recording what it would send: (route, decoded message)."""

    def __init__(self):
        self.sent: list[tuple[bytes, proto.Message]] = []
        self.handling = False

    async def send(self, route: bytes, frames: list, track: bool):
        self.sent.append((route, proto.decode([bytes(memoryview(f)) for f in frames])))
        return None

    def to(self, route: bytes, kind: type) -> list:
        return [msg for r, msg in self.sent if r == route and isinstance(msg, kind)]

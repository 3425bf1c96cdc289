"""One error tree for idlegrad.

Three families, so callers can tell who is at fault:
- `ConfigError`: the person running idlegrad asked for something impossible (bad flag, bad job
  spec, an address that cannot be bound). The CLI prints these as one line and exits non-zero.
- `ProtocolError`: a peer sent something invalid. It is counted, logged and dropped; it never
  takes a loop down.
- `PeerGone` / `Closed`: the peer broke versus we closed it.
Library errors (zmq, msgpack, torch) are translated into these at the boundary.
"""


class IdlegradError(Exception):
    """Base of every error idlegrad raises on purpose."""


class ConfigError(IdlegradError):
    """Invalid user input: CLI flags, configuration, addresses."""


class JobError(ConfigError):
    """A job spec that cannot be loaded, or a job that fails to build or is malformed."""


class CheckpointError(IdlegradError):
    """A checkpoint that cannot be written, read, or does not belong to this job."""


class ProtocolError(IdlegradError):
    """A message from the network that is malformed, oversized, or of the wrong version."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # short stable key, used for counting rejections
        self.detail = detail


class GradientRejected(IdlegradError):
    """A gradient that must not be applied (non-finite, wrong size)."""


class Refused(IdlegradError):
    """The peer refused us for good (wrong job, wrong protocol version): retrying cannot help."""


class PeerGone(IdlegradError):
    """The other side went away or stopped answering."""


class Closed(IdlegradError):
    """We closed it ourselves (shutdown in progress)."""

"""Every exception memsnap raises, in one place.

All of them are plain ``Exception`` subclasses whose constructor takes a single message
string, so they survive pickling by Ray when they cross an actor boundary.
"""


class MemsnapError(Exception):
    """Base class of every error memsnap raises on purpose."""


class ConfigError(MemsnapError, ValueError):
    """A configuration value or command-line input is out of range or of the wrong type."""


# --- codec -------------------------------------------------------------------------------
class CodecError(MemsnapError, ValueError):
    """Bad arguments to the Reed-Solomon codec."""


class TooFewShardsError(CodecError):
    """Fewer than k shards survive: the stripe cannot be rebuilt."""


class ShardSizeError(CodecError):
    """Shards of one stripe differ in length, or a buffer has the wrong size."""


# --- state layer ---------------------------------------------------------------------------
class StateMismatchError(MemsnapError, ValueError):
    """A snapshot does not fit the live state: missing/extra keys, shape or dtype mismatch."""


class ChecksumError(MemsnapError):
    """Bytes read back do not match the checksum recorded when they were written."""


class UnsupportedStateError(MemsnapError, TypeError):
    """A state holds a value of a type the JSON skeleton cannot represent exactly."""


class SnapshotBufferError(MemsnapError, ValueError):
    """A buffer handed to capture or apply is too small, read-only or not contiguous."""


class SnapshotNotFoundError(MemsnapError, FileNotFoundError):
    """No committed snapshot exists where one was asked for."""


# --- durable format ------------------------------------------------------------------------
class StorageError(MemsnapError, OSError):
    """Durable storage refused a write or read (full disk, permissions, network)."""


class FormatError(MemsnapError, ValueError):
    """A manifest, skeleton, commit marker or wire header is malformed (damaged or forged)."""


class WeightsOnlyError(MemsnapError, ValueError):
    """A save holds model weights but no optimizer state and was not asked to."""


# --- runtime -------------------------------------------------------------------------------
class MemoryBudgetError(MemsnapError):
    """A snapshot does not fit the agent's memory budget."""


class UnsafeShmError(MemsnapError, PermissionError):
    """The arena directory or an arena file is not safely this user's (a symlink, another
    owner, loose permissions, not a regular file)."""


class TransportError(MemsnapError):
    """A chunk could not be moved between agents."""


class StepGivenUp(TransportError):
    """A holder refused a push because the job gave up its step (a node skipped or replaced
    it, or it failed elsewhere): the step will never commit, and nothing failed here. A
    store's ``reserve`` raises it; the transport carries it to the sender as itself."""


class PushCancelled(TransportError):
    """The sender called a push off between two chunks (``cancel`` said so: its step was given
    up, or a push of the same snapshot to another holder failed). Nothing failed at the peer;
    the chunks it already took are dropped with the step."""


class AuthenticationError(TransportError):
    """A peer failed the data-plane handshake."""


class CommitError(MemsnapError):
    """A snapshot could not be committed (a rank or holder failed before acknowledging)."""


class VersionStateError(CommitError):
    """A snapshot version was asked to move to a state its current one cannot become (a bug:
    ``memsnap.node.versions.ALLOWED`` lists the moves)."""


class JobInUseError(ConfigError):
    """A rank of another run that still runs holds this rank under the same job name: the two
    runs would share their snapshots (a distinct job name, or the same run id, fixes it)."""


class StalenessError(MemsnapError):
    """The newest committed snapshot is older than the configured staleness bound."""


# --- device tier ---------------------------------------------------------------------------
class DeviceError(MemsnapError):
    """The device tier refused something: a buffer that cannot be allocated, shared or opened
    (CUDA IPC refused), a handle of another backend, a capture larger than its buffer."""

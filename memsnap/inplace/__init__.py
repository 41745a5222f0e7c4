"""Recovery in place: the surviving ranks keep their processes when a peer is lost.

``group``: a process group re-formed per generation on a store that outlives every rank;
``heartbeat``: members' beats and the controller's view of them; ``member``: one rank or
standby process; ``controller``: ``InplaceJob``, which decides, fences and re-forms."""

from memsnap.inplace.controller import InplaceJob, Recovery, RecoveryError
from memsnap.inplace.group import PeerLost, RecoverableGroup
from memsnap.inplace.member import Context

__all__ = ["Context", "InplaceJob", "PeerLost", "RecoverableGroup", "Recovery", "RecoveryError"]

"""Recovery in place: the surviving ranks keep their processes when a peer is lost.

``group``: a process group re-formed per generation on a store that outlives every rank;
``heartbeat``: members' beats and the controller's view of them; ``member``: one rank or
standby process; ``assignment``: what the controller writes for each generation (who is which
rank); ``report``: what a member tells of one; ``live``: a live takeover (the survivors' state
straight to a standby); ``ddp``, ``fsdp``: the models on the re-formed group; ``controller``:
``InplaceJob``, which decides, fences and re-forms."""

from memsnap.inplace.controller import InplaceJob, Recovery, RecoveryError
from memsnap.inplace.group import PeerLost, RecoverableGroup
from memsnap.inplace.member import Context

__all__ = ["Context", "InplaceJob", "PeerLost", "RecoverableGroup", "Recovery", "RecoveryError"]

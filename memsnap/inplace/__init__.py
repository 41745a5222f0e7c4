"""Recovery in place: the surviving ranks keep their processes when a peer is lost.

``controller``: ``InplaceJob``, which runs the job's members on Ray actors, decides who is
lost, fences it, writes the next generation and warms the next standby. What it drives lies
below it: each member's recovery loop is ``memsnap.rank.member`` (a rank, or a standby waiting
to become one), and the process group that survives a lost peer, its heartbeats, DDP and FSDP2
on it and the live takeover are ``memsnap.collective``."""

from memsnap.collective.group import PeerLost, RecoverableGroup
from memsnap.inplace.controller import InplaceJob, Recovery, RecoveryError
from memsnap.rank.member import Context

__all__ = ["Context", "InplaceJob", "PeerLost", "RecoverableGroup", "Recovery", "RecoveryError"]

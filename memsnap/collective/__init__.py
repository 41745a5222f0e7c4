"""The process group that outlives a lost peer, and what rides on it (recovery in place).

``group``: a gloo group re-formed per generation on a store that outlives every rank, whose
collectives end in ``PeerLost`` instead of hanging; ``heartbeat``: members' beats and the
controller's view of them; ``ddp``, ``fsdp``: data-parallel and FSDP2 models on the re-formed
group; ``live``: the live takeover (where the ranks are replicas, a replacement takes the
survivors' state, nothing rolled back); ``assignment``: the job store's keys and what the
controller writes for each generation; ``report``: what a member tells of one.
"""

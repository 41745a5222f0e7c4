"""The job's coordinator: membership, the two-phase commit and the collective restore decision.

``coordinator`` (``CoordinatorCore``), ``membership`` and ``placement`` (which ranks run
where, which nodes hold whose shards), ``commit`` (the two-phase commit's log), ``coverage``
(who can load what: the restore plan), ``rounds`` (the restore's barrier rounds),
``liveness`` (memsnap's own verdict on a node), ``reprotect`` (shards rebuilt after a
loss).
"""

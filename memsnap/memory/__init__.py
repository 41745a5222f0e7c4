"""Host memory the agent owns: ``arena`` (shared-memory files under /dev/shm that ranks capture
into and the memory budget they count against), ``shmdir`` (this user's private directory for
them: made, locked, swept) and ``pinning`` (page-locking an arena for CUDA copies, once).
"""

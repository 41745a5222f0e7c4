"""Finding a job's actors by name: each node's agent (handles cached) and the live nodes,
and calling many agents at once with one deadline for all."""

from __future__ import annotations

import logging

import ray

from memsnap import naming

log = logging.getLogger("memsnap.directory")


class Directory:
    def __init__(self, job: str):
        self.job = job
        self._agents: dict[str, object] = {}

    def agent(self, node: str):
        """The live agent of the job on ``node``, or None."""
        handle = self._agents.get(node)
        if handle is None:
            handle = find_agent(self.job, node)
            if handle is not None:
                self._agents[node] = handle
        return handle

    def forget(self, node: str) -> None:
        self._agents.pop(node, None)

    @staticmethod
    def alive() -> set[str]:
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    def call_all(self, nodes, method: str, *args, timeout: float) -> dict:
        """``method(*args)`` on the agent of every node in ``nodes`` at once: ``{node: answer}``
        for those that answered within ``timeout`` (the others are logged and left out)."""
        refs = {}
        for node in nodes:
            handle = self.agent(node)
            if handle is not None:
                refs[getattr(handle, method).remote(*args)] = node
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout) if refs else ([], [])
        out = {}
        for ref in ready:
            try:
                out[refs[ref]] = ray.get(ref)
            except Exception as exc:  # a dead agent does not stop the others
                log.warning("%s on the agent of %s failed: %s", method, refs[ref][:12], exc)
                self.forget(refs[ref])
        for ref in late:
            log.warning("%s on the agent of %s did not answer within %.0f s", method, refs[ref][:12], timeout)
        return out


def find_agent(job: str, node: str):
    """The live agent of ``job`` on ``node``, or None."""
    try:
        return ray.get_actor(naming.agent(job, node), namespace=naming.NAMESPACE)
    except ValueError:
        return None

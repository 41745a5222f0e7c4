"""The job's data-plane secret: made once, kept in Ray's GCS key-value store, read there by
each rank and agent (never an actor argument, so it is not in any task spec), deleted when
the job is shut down. Anyone who is a Ray client of the cluster can read it, as Ray assumes
of its clients (see the threat model in docs/data-plane.md)."""

from __future__ import annotations

import secrets

from memsnap import naming


def job_secret(job: str) -> bytes:
    """The job's 32-byte secret, made by whoever asks first."""
    from ray.experimental import internal_kv

    key = naming.secret_key(job)
    internal_kv._internal_kv_put(key, secrets.token_bytes(32), overwrite=False, namespace=naming.NAMESPACE)
    return internal_kv._internal_kv_get(key, namespace=naming.NAMESPACE)


def drop_secret(job: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(naming.secret_key(job), namespace=naming.NAMESPACE)

"""The step-directory format over ``pyarrow.fs``: writing rank files and the commit marker,
listing and reading steps (checked as they are read, ``verify.py``), retention.

Under a root URI (a local path, ``file://``, ``s3://``, ``gs://``, ``hdfs://``) each step is a
directory laid out as ``layout.py`` names it; one without ``COMMITTED`` does not exist for
readers.

Call protocol of a save (the runtime's spill thread follows the same two calls)::

    1. store.write_rank(step, rank, manifest, buf)   (all ranks) -> RankRecord
       (or store.write_rank_stream(step, rank, stream): the bytes as they are produced,
       e.g. straight from the tensors by ``stream.TensorStream``, as ``memsnap.save`` does)
    2. the caller's barrier: every rank's write_rank has returned
    3. store.commit(step, world_size, metadata)      (one rank, e.g. rank 0)
    4. store.retain(policy)                           (optional, the committing rank)

On a local filesystem every file is written under a temporary name of its own
(``<name>.<pid>.<random>.tmp``, created ``O_EXCL|O_NOFOLLOW``: two writers never share one
and a planted symlink is never followed), fsynced, renamed and the directory fsynced; on object stores a file appears whole when its upload completes and ``COMMITTED``
is uploaded last. A crash at any point therefore leaves either the previous committed step
or the new one, never a readable half.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import warnings
from collections.abc import Iterable

import pyarrow.fs as pafs
import xxhash

from memsnap.durable import localfs
from memsnap.durable.layout import (
    MARKER,
    RANK_FILE_RE,
    STEP_RE,
    RankRecord,
    RankStream,
    files_tag,
    rank_name,
    step_name,
)
from memsnap.durable.lineage import (
    LEGACY,
    Commit,
    Lineage,
    Retention,
    descent,
    head_of,
    kept_steps,
    next_lineage,
    parent_map,
)
from memsnap.durable.localfs import (
    Progress,
    Throttle,
    allocate,
    open_local,
    read_upto,
    readinto_full,
    regular,
    slices,
    tmp_name,
    write_local,
    write_stream,
)
from memsnap.durable.verify import Verifier
from memsnap.errors import ChecksumError, ConfigError, FormatError, MemsnapError, SnapshotNotFoundError, StorageError
from memsnap.state import validate
from memsnap.state.checksum import fill_checksums
from memsnap.state.manifest import Manifest

__all__ = [
    "MARKER",
    "Commit",
    "Lineage",
    "Progress",
    "RankRecord",
    "Retention",
    "Store",
    "rank_name",
    "step_name",
    "tmp_name",
    "slices",
]

_RESUMED: dict[str, int] = {}  # per root: the step this process's run continues from
_WARNED: set[tuple[str, str]] = set()  # (root, lineage) warned about saving behind newer steps
_HISTORY: dict[str, dict[int, tuple[tuple, Commit]]] = {}  # per root: marker stat -> parsed commit


def resolve(uri: str, endpoint: str | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and path of ``uri``.

    ``s3://bucket/prefix`` takes its endpoint from ``endpoint`` or ``AWS_ENDPOINT_URL``
    (``http://127.0.0.1:9000``), credentials and region from the usual AWS variables.
    """
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    scheme, rest = uri.split("://", 1)
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if scheme == "s3" and endpoint:
        ep_scheme, _, host = endpoint.rpartition("://")
        fs = pafs.S3FileSystem(
            endpoint_override=host.rstrip("/"),
            scheme=ep_scheme or "https",
            region=os.environ.get("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1")),
        )
        return fs, rest.rstrip("/")
    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as exc:
        raise ValueError(
            f"cannot open storage URI {uri!r}: {exc}; use a local path or file://, s3://, gs://, hdfs:// URI"
        ) from exc


class Store:
    """One checkpoint root: writes rank files and markers, lists, reads, and prunes steps."""

    def __init__(self, fs: pafs.FileSystem, root: str, uri: str | None = None):
        self.fs, self.root, self.uri = fs, root.rstrip("/") or "/", uri or root
        self.local = isinstance(fs, pafs.LocalFileSystem)
        self.key = f"{fs.type_name}:{self.root}"  # the root, for this process's lineage records
        self._tags: dict[int, str | None] = {}  # per step read: its rank files' name tag

    @classmethod
    def open(cls, uri: str, endpoint: str | None = None) -> Store:
        fs, root = resolve(uri, endpoint)
        return cls(fs, root, uri)

    def path(self, step: int, name: str | None = None) -> str:
        d = f"{self.root}/{step_name(step)}"
        return d if name is None else f"{d}/{name}"

    # --- writing ---------------------------------------------------------------------------
    def write_rank(
        self,
        step: int,
        rank: int,
        manifest: Manifest,
        buf,
        *,
        throttle_bps: float | None = None,
        progress: Progress | None = None,
    ) -> RankRecord:
        """(all ranks) Write ``buf`` and ``manifest`` as this rank's files of ``step`` (the
        checksums of tensors the manifest has none for computed from ``buf``)."""
        mv = memoryview(buf).cast("B")
        if mv.nbytes < manifest.nbytes:
            raise ValueError(
                f"buffer has {mv.nbytes} bytes but the manifest says {manifest.nbytes}; "
                "pass the buffer capture() returned with this manifest"
            )
        mv = mv[: manifest.nbytes]
        if any(t.alias_of is None and t.checksum is None for t in manifest.tensors):
            manifest = fill_checksums(manifest, mv)  # every stored tensor's checksum is recorded
        self.fs.create_dir(self.path(step), recursive=True)
        tag = self._write_tag(step)
        bin_path = self.path(step, rank_name(rank, "bin", tag))
        digest = self._write(bin_path, slices(mv), mv.nbytes, Throttle(throttle_bps), progress)
        return self._write_manifest(step, rank, manifest, digest, tag)

    def write_rank_stream(
        self,
        step: int,
        rank: int,
        stream: RankStream,
        *,
        throttle_bps: float | None = None,
        progress: Progress | None = None,
    ) -> RankRecord:
        """(all ranks) Like ``write_rank``, with the data file written piece by piece as
        ``stream`` yields it (no staging buffer), and the manifest (with the per-tensor
        checksums the stream computed on the way) written after it."""
        self.fs.create_dir(self.path(step), recursive=True)
        tag = self._write_tag(step)
        bin_path = self.path(step, rank_name(rank, "bin", tag))
        digest = self._write(bin_path, iter(stream), stream.nbytes, Throttle(throttle_bps), progress)
        return self._write_manifest(step, rank, stream.manifest(), digest, tag)

    def _write_manifest(self, step: int, rank: int, manifest: Manifest, digest: str, tag: str | None) -> RankRecord:
        """Write the rank's manifest, recording its data file's size and ``digest``."""
        missing = [t.path for t in manifest.tensors if t.alias_of is None and t.checksum is None]
        if missing:
            raise ValueError(
                f"rank {rank}'s manifest has no checksum for {missing[:3]}; a stored "
                "tensor always has one (fill_checksums)"
            )
        meta = dict(manifest.meta, data_file={"bytes": manifest.nbytes, "xxh3": digest})
        raw = Manifest(manifest.tensors, manifest.tree, manifest.nbytes, meta).to_json()
        self._write(self.path(step, rank_name(rank, "json", tag)), [memoryview(raw)], len(raw), Throttle(None), None)
        return RankRecord(rank, manifest.nbytes, digest, len(raw), xxhash.xxh3_64_hexdigest(raw))

    def _write_tag(self, step: int) -> str | None:
        """The name tag of the rank files a save of ``step`` writes: None for a new step; for
        a committed one (a re-save: another lineage's step of that number, or a damaged one),
        a tag derived from its current marker, so that every rank and the committer pick the
        same one and the committed files stay whole until the new marker replaces the old."""
        path = self.path(step, MARKER)
        if not self.fs.get_file_info(path).is_file:
            return None
        return "r" + xxhash.xxh3_64_hexdigest(self._read_small(path))

    def commit(self, step: int, world_size: int, metadata: dict | None = None) -> dict:
        """(one rank, after every rank's write_rank) Make ``step`` visible by writing its marker.

        The marker records the step's ``Lineage`` (from the step this process resumed from,
        or last committed, under this root; else the newest commit). A step of that number
        committed before is replaced in one marker write: until it lands, the old marker and
        files stay as they were. Saving behind newer steps of another lineage warns once."""
        tag = self._write_tag(step)
        ranks = [self._rank_record(step, r, tag).to_dict() for r in range(world_size)]
        history = self.history()
        lineage = next_lineage(step, history, _RESUMED.get(self.key))
        doc = {
            "format": "memsnap",
            "version": 1,
            "step": step,
            "world_size": world_size,
            "metadata": metadata or {},
            "ranks": ranks,
            "lineage": lineage.to_dict(),
        }
        if tag is not None:
            doc["files"] = tag
        raw = json.dumps(doc, indent=1, allow_nan=False).encode()
        self._write(self.path(step, MARKER), [memoryview(raw)], len(raw), Throttle(None), None)
        _HISTORY.get(self.key, {}).pop(step, None)
        self._tags[step], _RESUMED[self.key] = tag, step
        if tag is not None:
            self._drop_replaced(step, {rank_name(r, ext, tag) for r in range(world_size) for ext in ("bin", "json")})
        self._warn_behind(step, lineage, history)
        return doc

    def _rank_record(self, step: int, rank: int, tag: str | None) -> RankRecord:
        jpath = self.path(step, rank_name(rank, "json", tag))
        bpath = self.path(step, rank_name(rank, "bin", tag))
        try:
            raw = self._read_small(jpath)
        except FileNotFoundError as exc:
            raise StorageError(
                f"cannot commit step {step}: rank {rank} has not written {jpath}; "
                "call commit only after every rank's write_rank returned"
            ) from exc
        data = json.loads(raw)["meta"]["data_file"]
        size = self.fs.get_file_info(bpath).size
        if size != data["bytes"]:
            raise StorageError(
                f"cannot commit step {step}: {bpath} has {size} bytes, its manifest says {data['bytes']}"
            )
        return RankRecord(rank, data["bytes"], data["xxh3"], len(raw), xxhash.xxh3_64_hexdigest(raw))

    def _drop_replaced(self, step: int, live: set[str]) -> None:
        """Delete the rank files of ``step`` its new marker does not name (the replaced save's)."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(step), allow_not_found=True))
        for info in infos:
            if RANK_FILE_RE.fullmatch(info.base_name) and info.base_name not in live:
                self._discard(info.path)

    def _warn_behind(self, step: int, lineage: Lineage, history: list[Commit]) -> None:
        """Warn (once per root and lineage in this process) when ``step`` was saved while
        another lineage has newer steps: they stop being what ``load(step=None)`` resumes."""
        newer = [c.step for c in history if c.step > step and c.lineage.id != lineage.id]
        if not newer or (self.key, lineage.id) in _WARNED:
            return
        _WARNED.add((self.key, lineage.id))
        top = max(newer)
        warnings.warn(
            f"saving step {step} behind newer committed step {top} of another lineage "
            f"under {self.uri}; load(step=None) will resume this lineage; step {top} is "
            "kept until this lineage has keep_last steps of its own (retention) or it is "
            "deleted by hand",
            stacklevel=4,
        )

    def resumed(self, step: int) -> None:
        """Record that this process's run continues from ``step`` (``load`` calls it): the
        next commit under this root descends from it."""
        _RESUMED[self.key] = step

    def descends_from(self, step: int) -> bool:
        """Whether this process's run continues from the intact committed ``step`` (the step it
        resumed from, or last committed, or the newest commit, and their ancestors): such a
        step is never saved over. Another lineage's step, or a damaged one, may be."""
        history = self.history()
        if not any(c.step == step and c.intact for c in history):
            return False
        start = _RESUMED.get(self.key, head_of(history).step)
        return step in descent(parent_map(history), start)

    def _write(
        self, path: str, parts: Iterable[memoryview], nbytes: int, throttle: Throttle, progress: Progress | None
    ) -> str:
        """Write ``parts`` (``nbytes`` in all) as ``path``; return the whole file's xxh3."""
        try:
            if self.local:
                return write_local(path, parts, nbytes, throttle, progress)  # removes its own debris
            return write_stream(self.fs, path, parts, nbytes, throttle, progress)
        except BaseException as exc:
            if not self.local:  # closing the stream on the way out uploaded what there was
                self._discard(path)
            if not isinstance(exc, OSError):
                raise
            raise StorageError(
                f"writing {path} failed: {exc.strerror or exc}; nothing of this step is visible and "
                f"earlier committed steps under {self.uri} are intact (free space or fix access, then "
                "save again)"
            ) from exc

    def _discard(self, path: str) -> None:
        try:
            self.fs.delete_file(path)
        except (OSError, FileNotFoundError):
            pass

    # --- reading ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Every committed step, oldest first."""
        return [s for s, _ in self._markers()]

    def _markers(self) -> list[tuple[int, pafs.FileInfo]]:
        """Every committed step with its marker's file info, by step."""
        found = sorted(s for s, _ in self._step_dirs())
        if not found:
            return []
        infos = self.fs.get_file_info([self.path(s, MARKER) for s in found])
        return [(s, info) for s, info in zip(found, infos) if info.type == pafs.FileType.File]

    def history(self) -> list[Commit]:
        """Every committed step in commit order: legacy (and unreadable) markers first, by
        step, then by recorded commit sequence. A marker is read once per process while its
        size and modification time stay the same."""
        cache = _HISTORY.setdefault(self.key, {})
        markers = self._markers()
        for gone in set(cache) - {s for s, _ in markers}:
            cache.pop(gone, None)
        out = []
        for step, info in markers:
            stat = (info.size, info.mtime_ns)
            hit = cache.get(step)
            if hit is None or hit[0] != stat or info.mtime_ns is None:
                hit = cache[step] = (stat, self._read_commit(step))
            out.append(hit[1])
        return sorted(out, key=lambda c: c.order)

    def _read_commit(self, step: int) -> Commit:
        try:
            doc = self.marker(step)
        except (MemsnapError, OSError, ValueError):
            return Commit(step, LEGACY, False)
        metadata = doc.get("metadata", {})
        return Commit(step, Lineage.parse(doc.get("lineage")) or LEGACY, True, bool(metadata.get("milestone")))

    def resume_order(self) -> list[int]:
        """The committed steps in the order ``load(step=None)`` tries them: a step whose marker
        is damaged and numbered beyond every intact commit (its lineage is unknown: it may be
        the newest), then the newest commit (the newest step of the newest lineage), the steps
        it descends from, and the rest, newest commit first."""
        history = self.history()
        intact = [c for c in history if c.intact]
        if not intact:
            return [c.step for c in reversed(history)]
        first = sorted((c.step for c in history if not c.intact and c.step > intact[-1].step), reverse=True)
        chain = descent(parent_map(history), intact[-1].step)
        return first + chain + [c.step for c in reversed(history) if c.step not in {*first, *chain}]

    def _step_dirs(self) -> list[tuple[int, str]]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except FileNotFoundError:
            return []
        out = []
        for info in infos:
            m = STEP_RE.fullmatch(info.base_name)
            if m and info.type == pafs.FileType.Directory:
                out.append((int(m.group(1)), info.path))
        return out

    def latest(self) -> int:
        """The step ``load(step=None)`` tries first: the newest step of the newest lineage (the
        step committed last), or a damaged one numbered beyond it (see ``resume_order``)."""
        order = self.resume_order()
        if not order:
            raise SnapshotNotFoundError(f"no committed step under {self.uri}; save one first (or check the URI)")
        return order[0]

    def marker(self, step: int) -> dict:
        """The parsed, validated ``COMMITTED`` of ``step``; SnapshotNotFoundError if it is not
        committed, FormatError if it is malformed or cannot be read as a regular file of at
        most ``validate.MAX_MARKER_BYTES``."""
        path = self.path(step, MARKER)
        try:
            raw = self._read_small(path, validate.MAX_MARKER_BYTES)
        except FileNotFoundError:
            have = self.steps()
            raise SnapshotNotFoundError(
                f"step {step} is not committed under {self.uri} (committed steps: {have[-10:] or 'none'})"
            ) from None
        except ChecksumError as exc:  # nothing to compare against: the marker itself is damaged
            raise FormatError(str(exc)) from None
        doc = validate.marker(validate.parse_json(raw, path), step, path)
        self._tags[step] = files_tag(doc, path)
        return doc

    def _rank_path(self, step: int, rank: int, ext: str, marker: dict | None = None) -> str:
        """The path of a rank's file of committed ``step`` (named as its marker says)."""
        if marker is not None:
            tag = files_tag(marker, self.path(step, MARKER))
        else:
            if step not in self._tags:
                self.marker(step)
            tag = self._tags[step]
        return self.path(step, rank_name(rank, ext, tag))

    def manifest(self, step: int, rank: int, marker: dict | None = None) -> Manifest:
        """Rank ``rank``'s manifest of ``step``, read only up to the size the marker records,
        checked against the marker's checksum and size and validated (``FormatError``), with a
        checksum for every stored tensor."""
        marker = marker or self.marker(step)
        rec = self._record(marker, rank)
        path = self._rank_path(step, rank, "json", marker)
        try:
            raw = self._read_small(path, validate.MAX_MANIFEST_BYTES, size=rec["json_bytes"])
        except FileNotFoundError:
            raise ChecksumError(
                f"{path} is missing although step {step} is committed; the step is damaged, load another step or copy"
            ) from None
        if xxhash.xxh3_64_hexdigest(raw) != rec["json_xxh3"]:
            raise ChecksumError(
                f"{path} is corrupted: {len(raw)} bytes, xxh3 "
                f"{xxhash.xxh3_64_hexdigest(raw)}; COMMITTED recorded "
                f"{rec['json_bytes']} bytes, xxh3 {rec['json_xxh3']}"
            )
        manifest = Manifest.from_json(raw, path)
        if manifest.nbytes != rec["bin_bytes"]:
            raise FormatError(
                f"{path}: describes a {manifest.nbytes}-byte buffer but COMMITTED records "
                f"{rec['bin_bytes']} bytes for its data file; the step is damaged, load "
                "another step or copy"
            )
        validate.stored_checksums(manifest, path)
        return manifest

    def _record(self, marker: dict, rank: int) -> dict:
        ranks = marker["ranks"]
        if not 0 <= rank < len(ranks):
            raise ConfigError(
                f"rank {rank} out of range: step {marker['step']} was saved by "
                f"{len(ranks)} ranks; pass a rank in 0..{len(ranks) - 1}"
            )
        return ranks[rank]

    def read_rank(
        self,
        step: int,
        rank: int,
        *,
        marker: dict | None = None,
        manifest: Manifest | None = None,
        out=None,
        progress: Progress | None = None,
    ) -> tuple[Manifest, memoryview]:
        """The one verified read of a rank's files, which every reader goes through (load,
        resharding, ``verify``, ``export``, ``average``): its manifest (``manifest``, the one
        ``Store.manifest`` gave for this marker, or read now) and its data file's bytes, read
        into ``out`` or, with none, a buffer of their own (on a local disk a private mapping of
        the file: no staging copy, page-cache pages shared).

        The data file must be a regular file (opened without following a symlink, also for
        the step directory) of exactly the size ``COMMITTED`` records, checked before any
        memory is allocated; its xxh3 must match ``COMMITTED`` and every stored tensor its
        manifest's checksum (one pass over the bytes). Any failure is ``ChecksumError`` (or
        ``FormatError``): the step is damaged."""
        marker = marker or self.marker(step)
        rec = self._record(marker, rank)
        manifest = manifest or self.manifest(step, rank, marker)
        path = self._rank_path(step, rank, "bin", marker)
        check = Verifier(path, manifest, rec)
        try:
            if out is None and self.local:
                data = self._map_checked(path, rec["bin_bytes"], check, progress)
            else:
                data = self._read_checked(path, rec["bin_bytes"], out, check, progress)
        except FileNotFoundError:
            raise ChecksumError(
                f"{path} is missing although step {step} is committed; the step is damaged, load another step or copy"
            ) from None
        except OSError as exc:
            raise _unreadable(path, exc) from None
        check.finish()
        return manifest, data

    def read_rank_into(
        self, step: int, rank: int, out, *, marker: dict | None = None, progress: Progress | None = None
    ) -> None:
        """Read rank ``rank``'s data file of ``step`` into ``out``, verified like ``read_rank``."""
        self.read_rank(step, rank, marker=marker, out=out, progress=progress)

    def map_rank(
        self, step: int, rank: int, *, marker: dict | None = None, progress: Progress | None = None
    ) -> memoryview:
        """Rank ``rank``'s data file of ``step``, verified like ``read_rank`` (on a local disk
        mapped copy-on-write)."""
        return self.read_rank(step, rank, marker=marker, progress=progress)[1]

    def _map_checked(self, path: str, size: int, check: Verifier, progress: Progress | None) -> memoryview:
        fd = open_local(path)
        try:
            regular(path, os.fstat(fd), size)
            if size == 0:
                return memoryview(bytearray(0))
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
        finally:
            os.close(fd)
        if hasattr(mapped, "madvise"):  # start readahead of a cold file; faster than MAP_POPULATE here
            mapped.madvise(mmap.MADV_WILLNEED)
        mv = memoryview(mapped)
        for start in range(0, size, localfs.IO_CHUNK):
            check.feed(start, mv[start : start + localfs.IO_CHUNK])
            if progress:
                progress(min(start + localfs.IO_CHUNK, size), size)
        return mv

    def _read_checked(self, path: str, size: int, out, check: Verifier, progress: Progress | None) -> memoryview:
        """Open ``path`` as a regular file of ``size`` bytes, then read it into ``out`` (or a
        new buffer of that size), feeding ``check`` as the pieces arrive."""
        with self._open_data(path, size) as (f, _):
            if out is None:
                mv = allocate(path, size)
            else:
                mv = memoryview(out).cast("B")
                if mv.nbytes != size:
                    raise ConfigError(
                        f"destination has {mv.nbytes} bytes, {path} holds {size}; "
                        "pass a buffer of the size COMMITTED records"
                    )
            for start in range(0, size, localfs.IO_CHUNK):
                part = mv[start : start + localfs.IO_CHUNK]
                got = readinto_full(f, part)
                if got != part.nbytes:
                    raise ChecksumError(f"{path} is truncated: ended {start + got} bytes in, {size} expected")
                check.feed(start, part)
                if progress:
                    progress(start + got, size)
        return mv

    @contextlib.contextmanager
    def _open_data(self, path: str, size: int | None):
        """``path`` open for reading as a regular file (of ``size`` bytes when given), never
        through a symlink on a local disk; on other filesystems its ``FileInfo`` must say File."""
        if self.local:
            fd = open_local(path)
            try:
                st = os.fstat(fd)
                regular(path, st, size)
                f = os.fdopen(fd, "rb", buffering=0)
            except BaseException:
                os.close(fd)
                raise
            with f:
                yield f, st.st_size
            return
        info = self.fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        if info.type != pafs.FileType.File:
            raise ChecksumError(
                f"{path} is not a regular file ({info.type.name}); the step is damaged, load another step or copy"
            )
        if size is not None and info.size != size:
            raise ChecksumError(
                f"{path} is truncated or damaged: {info.size} bytes on storage, COMMITTED recorded {size}"
            )
        with self.fs.open_input_file(path) as f:
            yield f, info.size

    def read_range(self, step: int, rank: int, offset: int, out) -> None:
        """Read ``len(out)`` bytes at ``offset`` of a rank's data file (no checksum: the
        caller verifies what it reads; ``read_rank`` is the verified read)."""
        path = self._rank_path(step, rank, "bin")
        mv = memoryview(out).cast("B")
        with self._open_data(path, None) as (f, _):
            f.seek(offset)
            got = readinto_full(f, mv)
        if got != mv.nbytes:
            raise ChecksumError(f"{path} is truncated: ended {offset + got} bytes in, {offset + mv.nbytes} expected")

    def _read_small(self, path: str, limit: int = validate.MAX_MANIFEST_BYTES, size: int | None = None) -> bytes:
        """The whole of a small file (a marker or a manifest): a regular file, never read
        through a symlink, of exactly ``size`` bytes when given and at most ``limit``, its size
        checked before anything is read. FileNotFoundError if it is absent, ChecksumError for
        anything else."""
        try:
            with self._open_data(path, size) as (f, have):
                if have > limit:
                    raise ChecksumError(
                        f"{path} has {have} bytes, more than the {limit} memsnap reads "
                        "for such a file; the step is damaged or was not written by memsnap"
                    )
                raw = read_upto(f, have + 1)  # one byte more: a file that grew is caught
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _unreadable(path, exc) from None
        if len(raw) != have:
            raise ChecksumError(
                f"{path} changed while it was read ({len(raw)} bytes read, {have} "
                "expected); the step is damaged, load another step or copy"
            )
        return raw

    # --- pruning ---------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        """Remove a step: its marker first, so it is never seen half-deleted."""
        self._discard(self.path(step, MARKER))
        try:
            self.fs.delete_dir(self.path(step))
        except FileNotFoundError:
            pass

    def retain(self, policy: Retention) -> list[int]:
        """Delete committed steps outside ``policy`` and debris of crashed saves older than the
        newest commit. Returns the deleted steps."""
        history = self.history()
        if not history:
            return []
        committed = {c.step for c in history}
        doomed = sorted(committed - kept_steps(history, policy))
        doomed += [s for s, _ in self._step_dirs() if s < head_of(history).step and s not in committed]
        for s in sorted(doomed):
            self.delete_step(s)
        return sorted(doomed)


def _unreadable(path: str, exc: OSError) -> Exception:
    """What a read of ``path`` that failed with ``exc`` raises: a ``StorageError`` as it is
    (its own message), anything else as a damaged or unreachable step."""
    if isinstance(exc, StorageError):
        return exc
    return ChecksumError(
        f"{path} cannot be read: {exc.strerror or exc}; the step is damaged "
        "or the storage unreachable, load another step or copy"
    )

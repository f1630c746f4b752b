"""Downloading corpus archives: resumable, verified, atomic.

``download`` fetches a URL with ``urllib`` into ``<dest>.part``. An interrupted transfer is resumed
with an HTTP ``Range`` request (a server that ignores Range sends the whole file, and the download
restarts cleanly from byte 0). Once complete, the sha256 (and the MD5, where a public project pins
one) is checked and the file renamed to ``dest``, so ``dest`` only ever holds a whole, verified file.
Given several URLs (mirrors of the same bytes), it tries them in order: a mirror that is down, refuses
the request or serves other bytes is skipped for the next. A host name that does not resolve (offline, or
a name that no longer exists) is not retried: the next mirror is tried at once. A progress bar is shown on stderr when
``tqdm`` is installed (the ``cli`` extra). ``extract`` unpacks zip and tar(.gz)
archives without letting a member escape the target directory.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import logging
import os
import platform
import shutil
import socket
import stat
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from txl.fileio import WriteError

log = logging.getLogger(__name__)

CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def md5_of(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _verify(path: Path, url: str, sha256: str | None, md5: str | None = None) -> str:
    digest = sha256_of(path)
    if sha256 is None and md5 is None:
        log.warning("no published sha256 is recorded for %s, so it cannot be verified; the downloaded "
                    "file's sha256 is %s", url, digest)
    elif sha256 is not None and digest != sha256.lower():
        raise ValueError(f"checksum mismatch for {path} (from {url}): expected sha256 {sha256}, "
                         f"got {digest}; the file is corrupt or changed upstream: delete {path} and "
                         "download again")
    if md5 is not None and (got := md5_of(path)) != md5.lower():
        raise ValueError(f"checksum mismatch for {path} (from {url}): expected md5 {md5}, got {got}; the "
                         f"file is corrupt or changed upstream: delete {path} and download again")
    return digest


def _progress_bar(name: str, total: int | None, start: int):
    """A tqdm bar on stderr, or None when tqdm is not installed (downloads work without it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, unit="B", unit_scale=True, unit_divisor=1024, desc=name,
                leave=False, disable=None)  # disable=None: no bar when stderr is not a terminal


class _Interrupted(Exception):
    pass


class _Unresolvable(Exception):
    """The URL's host name does not resolve: not a transient error, so the mirror is not tried again."""


def _host_unresolved(err: BaseException) -> bool:
    """Whether ``err`` (as urllib raises it) is a failed name lookup (socket.gaierror)."""
    return isinstance(err, socket.gaierror) or isinstance(getattr(err, "reason", None), socket.gaierror)


def _fetch_once(url: str, part: Path, timeout: float, progress: bool = False) -> None:
    """One request: resume ``part`` from its current size, or start it. Raises _Interrupted if cut."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "txl-data/1"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as err:
        if err.code == 416 and offset:  # nothing left to send: the part file is already whole
            log.info("%s: server has no bytes past %d; checking the file", url, offset)
            return
        raise
    except (urllib.error.URLError, OSError) as err:
        if _host_unresolved(err):
            host = urllib.parse.urlsplit(url).hostname
            raise _Unresolvable(f"cannot resolve the host name {host} ({getattr(err, 'reason', err)})") from err
        raise _Interrupted(str(err)) from err
    with resp:
        length = resp.headers.get("Content-Length")
        if offset and resp.status == 206 and (resp.headers.get("Content-Range") or "").startswith(
                f"bytes {offset}-"):
            mode, start = "ab", offset
            log.info("resuming %s at byte %d", url, offset)
        else:
            if offset:
                log.warning("%s: server did not honour the Range request (status %d); restarting the "
                            "download from byte 0", url, resp.status)
            mode, start = "wb", 0
        expected = start + int(length) if length is not None else None
        written = start
        bar = _progress_bar(part.name.removesuffix(".part"), expected, start) if progress else None
        with open(part, mode) as f:
            try:
                while block := resp.read(CHUNK):
                    f.write(block)
                    written += len(block)
                    if bar is not None:
                        bar.update(len(block))
            except (http.client.HTTPException, OSError) as err:
                raise _Interrupted(f"{err!r} after {written} bytes") from err
            finally:
                if bar is not None:
                    bar.close()
        if expected is not None and written < expected:
            # http.client returns a short read, not an error, when the server closes early.
            raise _Interrupted(f"connection closed after {written} of {expected} bytes")


def _download_one(url: str, dest: Path, part: Path, *, sha256: str | None, md5: str | None, retries: int,
                  timeout: float, progress: bool) -> Path:
    for attempt in range(retries + 1):
        try:
            _fetch_once(url, part, timeout, progress)
            break
        except _Unresolvable as err:  # offline or a dead name: asking again gives the same answer
            raise ConnectionError(f"could not download {url}: {err}") from None
        except _Interrupted as err:
            size = part.stat().st_size if part.exists() else 0
            if attempt == retries and size == 0:  # never connected (offline, DNS, firewall): nothing kept
                raise ConnectionError(f"could not download {url}: {err} (tried {retries + 1} times, nothing "
                                      "was received)") from None
            if attempt == retries:
                raise ConnectionError(f"download of {url} was interrupted ({err}); {size} bytes are kept in "
                                      f"{part}: run the same command again to resume") from None
            if size:
                log.warning("download of %s interrupted (%s); resuming from byte %d", url, err, size)
            else:
                log.warning("could not reach %s (%s); trying again", url, err)
    _verify(part, url, sha256, md5)
    os.replace(part, dest)
    return dest


def download(url: str | Sequence[str], dest: str | Path, *, sha256: str | None, md5: str | None = None,
             retries: int = 3, timeout: float = 60.0, progress: bool = True) -> Path:
    """Fetch ``url`` to ``dest`` (resuming ``dest.part``), verify ``sha256`` and ``md5``, and return ``dest``.

    ``url`` may be a sequence of mirrors serving the same bytes, tried in order: one that fails (not
    found, refused, cut off after ``retries`` resumptions, or other bytes than the checksums say) is
    reported in a warning and the next is tried, from byte 0. ``sha256=None`` and ``md5=None`` mean no
    checksum is known: the file is kept but a warning says so. A checksum mismatch raises ValueError
    naming both digests; the bad file is left at ``dest.part``. When every mirror fails, the error
    names each one's failure.
    """
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ValueError(f"no URL to download {dest} from")
    dest = Path(dest)
    if dest.exists():
        _verify(dest, urls[0], sha256, md5)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    failures: list[tuple[str, Exception]] = []
    for i, mirror in enumerate(urls):
        if i:  # another server: its bytes are checked from the start, not appended to the last one's
            part.unlink(missing_ok=True)
        try:
            return _download_one(mirror, dest, part, sha256=sha256, md5=md5, retries=retries, timeout=timeout,
                                 progress=progress)
        except (urllib.error.URLError, ConnectionError, ValueError, OSError) as err:
            failures.append((mirror, err))
            if i + 1 < len(urls):
                log.warning("%s failed (%s); trying the next mirror, %s", mirror, err, urls[i + 1])
    if len(failures) == 1:
        raise failures[0][1]
    reasons = "; ".join(f"{u}: {e}" for u, e in failures)
    kind = ValueError if all(isinstance(e, ValueError) for _, e in failures) else ConnectionError
    raise kind(f"every mirror of {dest.name} failed ({reasons})")


def _inside(root: Path, name: str) -> Path:
    target = (root / name).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"archive member {name!r} would be written outside {root}; refusing to extract")
    return target


UNVERIFIED_RATIO = 20
"""An archive no checksum vouches for may unpack to at most this many times its own size. Natural text
compresses about 3-4x under gzip (enwik8 2.9x), so a real corpus fits with room to spare; a gzip of zeros
(1000x) or a crafted zip bomb does not."""


def extract(archive: str | Path, into: str | Path, *, max_bytes: int | None = None) -> list[str]:
    """Unpack a .zip, .tar, .tar.gz/.tgz archive into ``into``; return the member names.

    Every member is checked before anything is written, so a refused archive extracts nothing: no path
    outside ``into``, no link (a zip stores a symlink as a member whose later siblings could write through
    it; a tar's links must pass tarfile's 'data' filter), no device, and (``max_bytes``) no more than that
    many bytes unpacked in all, counted from the members' recorded sizes, which the readers enforce.
    """
    archive, into = Path(archive), Path(into)
    into.mkdir(parents=True, exist_ok=True)
    root = into.resolve()
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            infos = z.infolist()
            for info in infos:
                _inside(root, info.filename)
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise ValueError(f"archive member {info.filename!r} of {archive} is a symbolic link; refusing "
                                     "to extract it: the archive is not the expected one")
            _check_size(archive, sum(i.file_size for i in infos), max_bytes)
            _unpack(archive, into, lambda: z.extractall(into))
        return [i.filename for i in infos]
    if tarfile.is_tarfile(archive):
        with tarfile.open(archive) as t:
            members = t.getmembers()
            for member in members:
                _inside(root, member.name)
                _check_tar_member(archive, member, root)
            _check_size(archive, sum(m.size for m in members if m.isfile()), max_bytes)
            if hasattr(tarfile, "data_filter"):
                _unpack(archive, into, lambda: t.extractall(into, members=members, filter="data"))
            else:
                _unpack(archive, into, lambda: _extract_plain(t, members, root))
        return [m.name for m in members]
    raise ValueError(f"{archive} is neither a zip nor a tar archive; cannot extract it")


def _check_tar_member(archive: Path, member: tarfile.TarInfo, root: Path) -> None:
    """Refuse a member tarfile's 'data' filter refuses (a link or device pointing outside, an absolute path).
    Pythons older than 3.10.12 / 3.11.4 lack the filter (Debian 12's 3.11.2): there only plain files and
    directories pass, which is all a corpus archive holds."""
    if hasattr(tarfile, "data_filter"):
        try:
            tarfile.data_filter(member, str(root))
        except tarfile.FilterError as err:
            raise ValueError(f"archive member {member.name!r} of {archive} is unsafe ({err}); refusing to "
                             "extract it: the archive is not the expected one") from None
    elif not (member.isfile() or member.isdir()):
        raise ValueError(f"archive member {member.name!r} of {archive} is unsafe (a link or special file, which this "
                         f"Python {platform.python_version()} cannot check: it lacks tarfile's 'data' filter); "
                         "refusing to extract it: the archive is not the expected one")


def _extract_plain(t: tarfile.TarFile, members: list[tarfile.TarInfo], root: Path) -> None:
    """Write checked plain files and directories with this process's owner and default permissions (what the
    'data' filter would keep), without tarfile's extraction of owners, modes and links."""
    for member in members:
        target = root / member.name
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with t.extractfile(member) as source, open(target, "wb") as out:  # type: ignore[union-attr]
            shutil.copyfileobj(source, out)


def _check_size(archive: Path, total: int, max_bytes: int | None) -> None:
    if max_bytes is not None and total > max_bytes:
        raise ValueError(f"{archive} would unpack to {total:,} bytes, more than the {max_bytes:,} allowed for an "
                         f"archive no checksum vouches for ({UNVERIFIED_RATIO}x its size); it is not the expected "
                         "archive: delete it and download it again")


def _unpack(archive: Path, into: Path, run: Callable[[], object]) -> None:
    """Run an extraction, turning what the checks cannot foresee (a member whose path crosses a file that
    an earlier member wrote, a truncated stream, a full disk) into one line."""
    try:
        run()
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EROFS):
            raise WriteError(into, err, f"extracting {archive.name} stopped") from None
        raise ValueError(f"could not extract {archive} ({type(err).__name__}: {err}); it is damaged or not the "
                         "expected archive: delete it and download it again") from None
    except (EOFError, zipfile.BadZipFile, tarfile.TarError) as err:
        raise ValueError(f"could not extract {archive} ({type(err).__name__}: {err}); it is damaged or not the "
                         "expected archive: delete it and download it again") from None

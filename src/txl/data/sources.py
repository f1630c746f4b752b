"""Reading corpus files: byte ranges, streamed in chunks, decoded strictly as UTF-8.

A split of a corpus is a list of :class:`Source` byte ranges (a whole file, or the first 90M bytes of
enwik8). Text is read in chunks that never cut a line (word and BPE levels) or a UTF-8 character
(char level), so encoding can stream through corpora far larger than memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CHUNK_BYTES = 1 << 24  # 16 MiB: large enough to amortise Python overhead, small enough to stream
Boundary = Literal["byte", "char", "line"]


@dataclass(frozen=True)
class Source:
    """Bytes ``[start, end)`` of ``path``; ``end=None`` means to the end of the file."""

    path: Path
    start: int = 0
    end: int | None = None

    def stop(self) -> int:
        size = self.path.stat().st_size
        return size if self.end is None else min(self.end, size)

    def size(self) -> int:
        return max(0, self.stop() - self.start)


def file_sha256(path: Path, chunk: int = CHUNK_BYTES) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def snap(path: Path, offset: int, boundary: Boundary) -> int:
    """The first offset >= ``offset`` that starts a line / a UTF-8 character (byte: unchanged)."""
    size = path.stat().st_size
    if boundary == "byte" or offset <= 0 or offset >= size:
        return min(max(offset, 0), size)
    with open(path, "rb") as f:
        if boundary == "char":
            f.seek(offset)
            head = f.read(4)
            k = 0
            while k < len(head) and head[k] & 0xC0 == 0x80:  # continuation byte: not a char start
                k += 1
            return offset + k
        f.seek(offset - 1)
        pos = offset - 1
        while block := f.read(1 << 16):
            i = block.find(b"\n")
            if i >= 0:
                return pos + i + 1
            pos += len(block)
        return size


def iter_bytes(source: Source, chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(absolute offset, bytes) chunks of the source."""
    stop = source.stop()
    with open(source.path, "rb") as f:
        f.seek(source.start)
        pos = source.start
        while pos < stop:
            block = f.read(min(chunk, stop - pos))
            if not block:
                break
            yield pos, block
            pos += len(block)


def iter_text(source: Source, boundary: Boundary, chunk: int = CHUNK_BYTES) -> Iterator[str]:
    """Decoded text chunks ending on a line (``line``) or character (``char``) boundary.

    Raises ValueError naming the file and the byte offset of the first byte that is not UTF-8.
    """
    carry, carry_at = b"", source.start
    for _, block in iter_bytes(source, chunk):
        data = carry + block
        base = carry_at
        if boundary == "line":
            cut = data.rfind(b"\n") + 1
        else:
            cut = len(data)
            back = 0
            # Cut before a trailing incomplete multi-byte character (at most 3 bytes long).
            while back < min(3, len(data)) and data[len(data) - 1 - back] & 0xC0 == 0x80:
                back += 1
            if back < len(data) and data[len(data) - 1 - back] >= 0xC0:
                cut = len(data) - 1 - back
        head, carry, carry_at = data[:cut], data[cut:], base + cut
        if head:
            yield _decode(head, source.path, base)
    if carry:
        yield _decode(carry, source.path, carry_at)


def _decode(data: bytes, path: Path, base: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: invalid byte 0x{data[err.start]:02x} at byte offset "
                         f"{base + err.start}; use level='byte' for binary or non-UTF-8 data") from None

"""Jane Austen's six novels, read from Debian's `r-cran-janeaustenr` package.

Source: Debian package `r-cran-janeaustenr` 1.0.0-1 (bookworm, section gnu-r), the CRAN
package janeaustenr by Julia Silge (MIT licence); the novels themselves are Project Gutenberg
texts in the public domain. Install with `apt-get install r-cran-janeaustenr`, or without R:
`apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb DIR` and pass
`DIR/usr/lib/R/site-library/janeaustenr` as `package_dir`.

R keeps a package's data in a "lazy-load database": `data/Rdata.rdb` is a run of
zlib-compressed entries, each `uint32 big-endian length + zlib stream`, and each entry is one R
object in R's XDR serialization. Every novel is a plain character vector (one Gutenberg line per
element), so a reader for that one type is all we need; anything else raises `ValueError`.
"""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

DEFAULT_PACKAGE_DIR = Path("/usr/lib/R/site-library/janeaustenr")
INSTALL_HINT = ("install Debian's r-cran-janeaustenr (apt-get install r-cran-janeaustenr) or "
                "pass the folder of an unpacked copy (see jaxserve.training.corpus)")
STRSXP = 16  # R's SEXP type of a character vector
NA_STRING_LENGTH = -1
MIN_WORDS = 4


def _read_character_vector(blob: bytes) -> list[str]:
    """Decode one XDR-serialized R character vector (format version 2 or 3)."""
    if blob[:2] != b"X\n":
        raise ValueError("not an XDR-serialized R object")
    pos = 2
    version = struct.unpack_from(">i", blob, pos)[0]
    pos += 12  # version, writer R version, minimal reader R version
    if version == 3:
        encoding_length = struct.unpack_from(">i", blob, pos)[0]
        pos += 4 + encoding_length
    flags, length = struct.unpack_from(">ii", blob, pos)
    pos += 8
    if flags & 0xFF != STRSXP:
        raise ValueError(f"expected an R character vector, found SEXP type {flags & 0xFF}")
    lines = []
    for _ in range(length):
        _, size = struct.unpack_from(">ii", blob, pos)
        pos += 8
        if size == NA_STRING_LENGTH:
            lines.append("")
            continue
        lines.append(blob[pos:pos + size].decode("utf-8"))
        pos += size
    return lines


def read_novels(package_dir: str | Path = DEFAULT_PACKAGE_DIR) -> list[list[str]]:
    """The six novels as lists of text lines, in the package's storage order."""
    path = Path(package_dir) / "data" / "Rdata.rdb"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {INSTALL_HINT}")
    data = path.read_bytes()
    novels, pos = [], 0
    while pos < len(data):
        expected = struct.unpack_from(">I", data, pos)[0]
        inflater = zlib.decompressobj()
        blob = inflater.decompress(data[pos + 4:])
        if len(blob) != expected:
            raise ValueError(f"corrupt entry at byte {pos} of {path}")
        novels.append(_read_character_vector(blob))
        pos = len(data) - len(inflater.unused_data)
    return novels


def paragraphs(lines: list[str]) -> list[str]:
    """Join wrapped lines into paragraphs; drop _italic_ marks, headings (all capitals) and
    stubs under `MIN_WORDS` words ("Chapter 1", "By Jane Austen", "Finis")."""
    result, current = [], []
    for line in lines + [""]:
        line = line.strip()
        if line:
            current.append(line)
            continue
        text = " ".join(current).replace("_", "")
        text = re.sub(r"\s+", " ", text).strip()
        current = []
        if len(text.split()) >= MIN_WORDS and text.upper() != text:
            result.append(text)
    return result

"""Wire encoding of docs/format.md section 2 (bincode 1 compatible, little-endian).

:class:`Encoder` builds bytes; :class:`Decoder` reads them back with bounds and
cap checks, reporting every failure with the absolute byte offset in the file
(``base`` is the file offset of the first decoded byte).
"""

import struct

__all__ = ["Encoder", "Decoder", "WireError", "MAX_STRING"]

#: Longest string a decoder accepts (docs/format.md section 7: strings 1 MiB).
MAX_STRING = 1 << 20


class WireError(ValueError):
    """A decoding failure at absolute byte ``offset``: ``what`` says what is wrong."""

    def __init__(self, offset, what):
        super().__init__(f"byte {offset}: {what}")
        #: Absolute byte offset of the failure.
        self.offset = offset
        #: Description of the failure.
        self.what = what


class Encoder:
    """Appends wire-encoded values to a growing byte buffer (``self.buf``)."""

    def __init__(self):
        self.buf = bytearray()

    def u8(self, v):
        """Appends one byte."""
        self.buf += struct.pack("<B", v)
        return self

    def bool(self, v):
        """Appends a bool as 0 or 1."""
        return self.u8(1 if v else 0)

    def u32(self, v):
        """Appends a little-endian u32."""
        self.buf += struct.pack("<I", v)
        return self

    def u64(self, v):
        """Appends a little-endian u64."""
        self.buf += struct.pack("<Q", v)
        return self

    def length(self, n):
        """Appends a sequence length (u64)."""
        return self.u64(n)

    def str(self, s):
        """Appends a String: u64 byte length then UTF-8 bytes (``bytes`` are taken as is)."""
        b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
        self.u64(len(b))
        self.buf += b
        return self

    def raw(self, b):
        """Appends raw bytes with no length (fixed arrays such as 32-byte digests)."""
        self.buf += b
        return self

    def opt_u32(self, v):
        """Appends an Option<u32>: 0 for None, 1 then the value for Some."""
        if v is None:
            return self.u8(0)
        return self.u8(1).u32(v)

    def pairs(self, pairs):
        """Appends a Vec<(String, String)>."""
        self.length(len(pairs))
        for k, v in pairs:
            self.str(k).str(v)
        return self

    def bytes(self):
        """The encoded bytes."""
        return bytes(self.buf)


class Decoder:
    """Reads wire-encoded values from ``data``; ``base`` is the file offset of ``data[0]``."""

    def __init__(self, data, base=0):
        self.data = memoryview(data)
        self.pos = 0
        self.base = base

    def offset(self):
        """Absolute file offset of the next byte to read."""
        return self.base + self.pos

    def remaining(self):
        """Bytes left to decode."""
        return len(self.data) - self.pos

    def error(self, what, at=None):
        """A :class:`WireError` at ``at`` (default: the current offset)."""
        return WireError(self.offset() if at is None else at, what)

    def take(self, n, what):
        """Returns the next ``n`` bytes or fails naming ``what``."""
        if n > self.remaining():
            raise self.error(f"{what}: needs {n} bytes, only {self.remaining()} remain")
        b = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return b

    def u8(self, what):
        """Reads one byte."""
        return self.take(1, what)[0]

    def bool(self, what):
        """Reads a bool (0 or 1; other values are invalid)."""
        at = self.offset()
        v = self.u8(what)
        if v > 1:
            raise self.error(f"{what}: invalid bool value {v}", at)
        return v == 1

    def u32(self, what):
        """Reads a little-endian u32."""
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what):
        """Reads a little-endian u64."""
        return struct.unpack("<Q", self.take(8, what))[0]

    def length(self, what, min_elem, cap):
        """Reads a sequence length, rejecting lengths above ``cap`` or that cannot fit
        in the remaining bytes at ``min_elem`` bytes per element."""
        at = self.offset()
        n = self.u64(what)
        if n > cap:
            raise self.error(f"{what}: length {n} exceeds the limit {cap}", at)
        if n * min_elem > self.remaining():
            raise self.error(f"{what}: length {n} cannot fit in the {self.remaining()} remaining bytes", at)
        return n

    def str(self, what, cap=MAX_STRING):
        """Reads a String of at most ``cap`` bytes, rejecting invalid UTF-8."""
        n = self.length(what, 1, cap)
        at = self.offset()
        b = self.take(n, what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{what}: invalid UTF-8 ({e.reason})", at + e.start) from None

    def array32(self, what):
        """Reads a 32-byte array (a digest)."""
        return self.take(32, what)

    def opt_u32(self, what):
        """Reads an Option<u32> (tags other than 0 and 1 are invalid)."""
        at = self.offset()
        tag = self.u8(what)
        if tag == 0:
            return None
        if tag == 1:
            return self.u32(what)
        raise self.error(f"{what}: invalid option tag {tag}", at)

    def pairs(self, what, cap=4096):
        """Reads a Vec<(String, String)>."""
        n = self.length(what, 16, cap)
        return [(self.str(what), self.str(what)) for _ in range(n)]

    def finish(self, what):
        """Fails if bytes remain undecoded."""
        if self.remaining():
            raise self.error(f"{what}: {self.remaining()} trailing bytes after the last field")

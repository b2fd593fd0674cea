# Types of the C extension built from _copycrc.c (see there).

AVAILABLE: int
LANE: int

def copy_crc32c(dst: object, src: object, crc: int, /) -> int: ...

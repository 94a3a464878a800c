"""The in-kernel hazard record: what a launch's checked mode (``ACCEL_SANITIZE``) writes,
shared by the firmware (which writes it) and the runtime (which reads it).

A launch asks for the checked mode with a trailing argument record
``{ARG_HAZARD, 0, va, bytes}`` (docs/kernels.md "Launch ABI"): ``bytes`` (at least
``RECORD_BYTES``) of the context's memory at ``va``, zeroed by the client, where the
firmware leaves the first hazard the launch's threads made. The kernel then runs a
separately compiled variant (its own JIT cache entry) that tracks every shared-memory
access of each block between barriers (docs/sanitizer.md, "In-kernel hazards").

The record is ``RECORD_WORDS`` little-endian int64 words at the indices below; ``COUNT``
is the number of hazards found (0: none), the other words describe the first one.
"""

from __future__ import annotations

from typing import Final

#: The argument record kind that names the hazard record (after the parameters' records).
ARG_HAZARD: Final = 3

COUNT: Final = 0      #: hazards found (the first claims the record)
KIND: Final = 1       #: KIND_RACE
ARRAY: Final = 2      #: the shared array's position among the kernel's shared arrays
ELEMENT: Final = 3    #: the element's flat index in that array
BYTE: Final = 4       #: its byte offset in the block's shared memory of that array
BLOCK: Final = 5      #: the block's linear id (x fastest)
FIRST: Final = 6      #: the earlier access: thread (linear id in its block), line, mode
SECOND: Final = 9     #: the later access: thread, line, mode
RECORD_WORDS: Final = 12
RECORD_BYTES: Final = RECORD_WORDS * 8

#: KIND values
KIND_RACE: Final = 1

#: access modes as recorded; names as reports print them
READ, WRITE, ATOMIC, READ_WRITE = 0, 1, 2, 3
MODE_NAMES: Final = ("read", "write", "atomic", "read+write")

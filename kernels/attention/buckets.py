"""Sequence-length buckets shared by the attention kernel's autotuner and the attention dispatcher.

Another image size changes every attention length a little (SD1.5 at 640x512 after 512x512: 5120, 1280, 320 and 80
tokens after 4096, 1024, 256 and 64). A kernel config, or a backend choice, that suits one length suits the others
of its power-of-two bucket, so the autotuner keys on the buckets and the dispatcher narrows its measurement by them.
Imports nothing (no Triton), so the engine can use it without Triton installed.
"""

from __future__ import annotations


def length_bucket(n: int) -> int:
    """The bucket of a sequence length ``n`` (>= 0): the largest power of two <= n, at least 16."""
    return max(16, 1 << (max(int(n), 1).bit_length() - 1))

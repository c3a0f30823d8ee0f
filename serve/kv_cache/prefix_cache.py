"""The identity of a full block of tokens, for automatic prefix caching.

A block's hash covers its tokens and, through the previous block's hash, every token
before it: equal hashes mean equal prefixes, so equal K/V. SHA-256 rather than Python's
`hash()`: a collision would hand one request another's cached K/V, and Python's 64-bit
tuple hash can be collided on purpose by a client who controls prompts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# The chain's root. Anything else that changes a block's K/V (an adapter) is mixed into
# it (`root_hash`), so that such blocks never match across it.
ROOT_HASH = hashlib.sha256(b"serve-prefix-cache-v1").digest()


def root_hash(cache_key: str) -> bytes:
    """The chain's root for sequences whose K/V also depend on `cache_key` ("": none)."""
    if not cache_key:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + cache_key.encode()).digest()


def hash_block(
    parent_hash: bytes, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> bytes:
    """`extra_keys`: what else decides the block's K/V (the content hashes of the images
    whose placeholder tokens it holds: equal tokens, other pixels)."""
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        digest.update(b"\x00" + key.encode())
    return digest.digest()

"""Key routing: which shard a keyed publish goes to.

``shard_for_key(key, shards) = crc32c(key) mod shards``, where crc32c is
CRC-32C (Castagnoli). It is part of the protocol: the broker routes a keyed
publish with it, and the client uses it to send the publish straight to the
core that owns that shard.
"""

from typing import List

__all__ = ["crc32c", "shard_for_key"]

_POLY = 0x82F63B78  # CRC-32C, reflected


def _make_table() -> List[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _make_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``: ``crc32c(b"123456789") == 0xE3069283``."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def shard_for_key(key: bytes, shards: int) -> int:
    """The shard a record with routing ``key`` goes to among ``shards``
    shards (0 when ``shards`` is 0, as in the broker)."""
    if shards == 0:
        return 0
    return crc32c(key) % shards

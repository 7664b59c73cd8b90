'use strict';

/**
 * CRC-32C (Castagnoli) and the protocol's key routing function.
 * @module felix-client/crc32c
 */

const POLY = 0x82f63b78; // reflected Castagnoli polynomial

const TABLE = (() => {
  const t = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let c = i;
    for (let k = 0; k < 8; k++) c = c & 1 ? (c >>> 1) ^ POLY : c >>> 1;
    t[i] = c >>> 0;
  }
  return t;
})();

/**
 * CRC-32C of `bytes` (as iSCSI/ext4: `crc32c("123456789") === 0xE3069283`).
 * @param {Uint8Array} bytes
 * @returns {number} unsigned 32-bit checksum
 */
function crc32c(bytes) {
  let c = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) c = TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/**
 * The shard a routing key is published to: `crc32c(key) % shards`, exactly
 * as the broker and the Rust client route it (part of the protocol).
 * `shards === 0` gives 0.
 * @param {Buffer|Uint8Array|string} key a string is routed by its UTF-8 bytes
 * @param {number} shards the stream's shard count
 * @returns {number}
 */
function shardForKey(key, shards) {
  if (shards === 0) return 0;
  const bytes = typeof key === 'string' ? Buffer.from(key, 'utf8') : key;
  return crc32c(bytes) % shards;
}

module.exports = { crc32c, shardForKey };

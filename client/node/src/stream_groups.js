'use strict';

// Consumer-group admin over every shard of a stream, shared by `Client` and
// `ClusterClient`: each is the per-shard call run on shards 0..n in order,
// through the `describeStream` and `group*` methods of the client given (one
// broker's, or a cluster client's, which sends each to the shard's leader).

const args = require('./args');
const { InvalidArgumentError } = require('./errors');

/**
 * `shards`, unless `start` is an offset and the stream has more than one
 * shard: a call on every shard refuses it, since an offset is per shard.
 * @param {import('../index').StreamArg} stream
 * @param {number} shards
 * @param {'earliest'|'latest'|bigint|undefined} start checked
 * @returns {number}
 */
function checkStreamStart(stream, shards, start) {
  if (shards > 1 && typeof start === 'bigint') {
    const ref = args.streamRef(stream);
    throw new InvalidArgumentError(
      `${ref.tenant}/${ref.namespace}/${ref.stream} has ${shards} shards and offsets are per shard; use 'earliest' or 'latest', or the per-shard call`,
    );
  }
  return shards;
}

/** The stream's shard count through `client`, with `start` checked. */
async function streamShards(client, stream, start) {
  return checkStreamStart(stream, (await client.describeStream(stream)).shards, start);
}

async function groupCreateStream(client, stream, group, start) {
  const ref = args.streamRef(stream);
  const at = args.startPosition(start);
  const shards = await streamShards(client, ref, at);
  for (let shard = 0; shard < shards; shard++) await client.groupCreate(ref, shard, group, at);
}

async function groupSeekStream(client, stream, group, start) {
  const ref = args.streamRef(stream);
  const at = args.startPosition(start);
  const shards = await streamShards(client, ref, at);
  for (let shard = 0; shard < shards; shard++) await client.groupSeek(ref, shard, group, at);
}

async function groupDescribeStream(client, stream, group) {
  const ref = args.streamRef(stream);
  const shards = await streamShards(client, ref, undefined);
  const out = [];
  for (let shard = 0; shard < shards; shard++) out.push(await client.groupDescribe(ref, shard, group));
  return out;
}

async function groupDeleteStream(client, stream, group) {
  const ref = args.streamRef(stream);
  const shards = await streamShards(client, ref, undefined);
  for (let shard = 0; shard < shards; shard++) await client.groupDelete(ref, shard, group);
}

module.exports = {
  checkStreamStart,
  streamShards,
  groupCreateStream,
  groupSeekStream,
  groupDescribeStream,
  groupDeleteStream,
};

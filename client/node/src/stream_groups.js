'use strict';

// Consumer-group admin over every shard of a stream, shared by `Client` and
// `ClusterClient`: each is the per-shard call run on shards 0..n in order,
// through the `describeStream`, `describeShard` and `group*` methods of the
// client given (one broker's, or a cluster client's, which sends each to the
// shard's leader).
//
// A group comes into being shard by shard, on its first poll there, and a
// call can fail on one shard and not the others. So every shard is tried
// whatever the others answered; a delete counts a shard without the group
// as done, a seek creates the group there at the position (when another
// shard's seek found it), a describe gives
// such a shard as a first poll will make it (at the shard's start, owing
// everything it holds); a group on no shard is `NotFoundError` (the seek
// creates nothing); and a failure on any shard rejects with the first, in
// shard order, its message naming its shard and where the call was done.

const args = require('./args');
const { InvalidArgumentError, NotFoundError } = require('./errors');

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

/** Whether a per-shard group call failed because the group is not there. */
function groupMissing(err) {
  return err instanceof NotFoundError;
}

/** A delete, seek or describe that found the group on no shard. */
function nowhere(ref, group) {
  const err = new NotFoundError(`group ${group} does not exist on any shard of ${ref.tenant}/${ref.namespace}/${ref.stream}`);
  err.notApplied = true;
  return err;
}

/**
 * Resolve when every shard's call succeeded; else reject with the first
 * failure (shard order), its message naming its shard and the shards the
 * call was done on.
 * @param {Array<{ok: true} | {ok: false, err: Error}>} results in shard order
 */
function settle(results) {
  const done = results.flatMap((r, shard) => (r.ok ? [shard] : []));
  const shard = results.findIndex((r) => !r.ok);
  if (shard < 0) return;
  const err = results[shard].err;
  const where = done.length === 0 ? 'done on no shard' : `done on shard(s) ${done.join(', ')}`;
  err.message = `${err.message} (shard ${shard}; ${where})`;
  // The call as a whole did something, whatever this part says.
  if (done.length > 0) err.notApplied = false;
  throw err;
}

/** The outcome of `call()`, as `settle` takes it. */
async function outcome(call) {
  try {
    await call();
    return { ok: true };
  } catch (err) {
    return { ok: false, err };
  }
}

async function groupCreateStream(client, stream, group, start) {
  const ref = args.streamRef(stream);
  const at = args.startPosition(start);
  const shards = await streamShards(client, ref, at);
  const results = [];
  for (let shard = 0; shard < shards; shard++) results.push(await outcome(() => client.groupCreate(ref, shard, group, at)));
  settle(results);
}

async function groupSeekStream(client, stream, group, start) {
  const ref = args.streamRef(stream);
  const at = args.startPosition(start);
  const shards = await streamShards(client, ref, at);
  const results = [];
  const missing = [];
  for (let shard = 0; shard < shards; shard++) {
    const r = await outcome(() => client.groupSeek(ref, shard, group, at));
    if (!r.ok && groupMissing(r.err)) missing.push(shard);
    results.push(r);
  }
  if (missing.length === shards) throw nowhere(ref, group);
  // Created only beside a shard that proved the group exists: with the rest
  // failing it may exist nowhere (a mistyped name).
  const found = results.some((r) => r.ok);
  for (const shard of found ? missing : []) {
    // Created where the seek puts it; the seek after it moves it there even
    // if a first poll created it meanwhile.
    results[shard] = await outcome(async () => {
      await client.groupCreate(ref, shard, group, at);
      await client.groupSeek(ref, shard, group, at);
    });
  }
  settle(results);
}

async function groupDescribeStream(client, stream, group) {
  const ref = args.streamRef(stream);
  const shards = await streamShards(client, ref, undefined);
  const described = [];
  for (let shard = 0; shard < shards; shard++) {
    try {
      described.push(await client.groupDescribe(ref, shard, group));
    } catch (err) {
      if (!groupMissing(err)) {
        err.message = `${err.message} (shard ${shard})`;
        throw err;
      }
      described.push(undefined);
    }
  }
  if (described.every((info) => info === undefined)) throw nowhere(ref, group);
  const out = [];
  for (let shard = 0; shard < shards; shard++) {
    out.push(described[shard] ?? (await notYetPolled(client, ref, shard, group)));
  }
  return out;
}

/** The group on a shard it has not polled yet, as its first poll there will make it. */
async function notYetPolled(client, ref, shard, group) {
  let held;
  try {
    held = await client.describeShard(ref, shard);
  } catch (err) {
    err.message = `${err.message} (shard ${shard})`;
    throw err;
  }
  return {
    group,
    position: held.startOffset,
    endOffset: held.endOffset,
    startOffset: held.startOffset,
    inFlight: 0,
    owed: 0,
    delayed: 0,
    deadLetters: 0,
    oldestInFlightAgeMs: undefined,
    oldestOwedAgeMs: undefined,
    lastActiveMs: undefined,
    lag: held.endOffset > held.startOffset ? held.endOffset - held.startOffset : 0n,
  };
}

async function groupDeleteStream(client, stream, group) {
  const ref = args.streamRef(stream);
  const shards = await streamShards(client, ref, undefined);
  const results = [];
  let missing = 0;
  for (let shard = 0; shard < shards; shard++) {
    const r = await outcome(() => client.groupDelete(ref, shard, group));
    if (!r.ok && groupMissing(r.err)) {
      missing++;
      results.push({ ok: true });
    } else {
      results.push(r);
    }
  }
  if (missing === shards) throw nowhere(ref, group);
  settle(results);
}

module.exports = {
  checkStreamStart,
  streamShards,
  groupCreateStream,
  groupSeekStream,
  groupDescribeStream,
  groupDeleteStream,
  settle,
};

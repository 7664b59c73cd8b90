'use strict';

// close() leaves nothing behind: a process that closes its client exits.

const test = require('node:test');
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const path = require('node:path');
const { ADDR, freshStream } = require('../test-support/helpers');

// Run `script` in a child Node process: it must print `closed` and exit 0
// within 5 s (nothing it left open keeps the process alive).
async function exitsCleanly(script) {
  const started = Date.now();
  const child = spawn(process.execPath, ['-e', script], { env: { ...process.env, FELIX_ADDR: ADDR } });
  let out = '';
  child.stdout.on('data', (d) => { out += d; });
  child.stderr.on('data', (d) => { out += d; });
  const code = await new Promise((resolve) => child.on('exit', resolve));
  assert.equal(code, 0, out);
  assert.match(out, /closed/);
  assert.ok(Date.now() - started < 5_000, `exited after ${Date.now() - started} ms`);
}

const SCRIPT = `
const { Client, DisconnectedError } = require(${JSON.stringify(path.join(__dirname, '..', 'src'))});
(async () => {
  const client = await Client.connect(process.env.FELIX_ADDR);
  const stream = ${JSON.stringify(freshStream('exit'))};
  await client.createStream(stream, 4);
  for (let shard = 0; shard < 4; shard++) await client.publish(stream, shard, 'x');
  const poll = client.read(stream, 0, 'latest', { waitMs: 20000 });
  setTimeout(() => client.close(), 100);
  await poll.then(() => process.exit(3), (err) => { if (!(err instanceof DisconnectedError)) throw err; });
  console.log('closed');
})().catch((err) => { console.error(err); process.exit(2); });
`;

test('the process exits after close(), even with a long poll in flight', async () => {
  await exitsCleanly(SCRIPT);
});

const SHARDED_SCRIPT = `
const { Client } = require(${JSON.stringify(path.join(__dirname, '..', 'src'))});
(async () => {
  const client = await Client.connect(process.env.FELIX_ADDR);
  const stream = ${JSON.stringify(freshStream('exit-sg'))};
  await client.createStream(stream, 2);
  const g = await client.shardedGroup(stream, 'g', { waitSliceMs: 300 });
  // Abandoned by the caller with its waiting polls out.
  const r = await Promise.race([g.poll({ maxRecords: 10, waitMs: 20000 }), new Promise((res) => setTimeout(res, 100, 'timeout'))]);
  if (r !== 'timeout') process.exit(3);
  await g.close();
  const timers = process.getActiveResourcesInfo().filter((k) => k === 'Timeout');
  if (timers.length > 0) { console.error('timers left after close:', timers.length); process.exit(4); }
  client.close();
  console.log('closed');
})().catch((err) => { console.error(err); process.exit(2); });
`;

test('a closed ShardedGroup leaves no timer behind: the process exits', async () => {
  await exitsCleanly(SHARDED_SCRIPT);
});

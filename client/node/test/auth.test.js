'use strict';

// Token authentication, against FELIX_AUTH_ADDR (a broker with a tokens
// file listing FELIX_AUTH_TOKEN for FELIX_AUTH_PRINCIPAL). Skipped when unset.

const test = require('node:test');
const assert = require('node:assert/strict');
const felix = require('../src');
const { ADDR, freshStream } = require('../test-support/helpers');

const { FELIX_AUTH_ADDR, FELIX_AUTH_TOKEN, FELIX_AUTH_PRINCIPAL } = process.env;
const skip = !(FELIX_AUTH_ADDR && FELIX_AUTH_TOKEN && FELIX_AUTH_PRINCIPAL)
  && 'FELIX_AUTH_ADDR, FELIX_AUTH_TOKEN and FELIX_AUTH_PRINCIPAL are not all set';

test('a listed token connects and works', { skip }, async () => {
  const client = await felix.Client.connect(FELIX_AUTH_ADDR, { token: FELIX_AUTH_TOKEN });
  try {
    const stream = freshStream('auth');
    const info = await client.createStream(stream, 2);
    for (let shard = 0; shard < 2; shard++) assert.equal(await client.publish(stream, shard, 'x'), 0n);
    assert.equal(new Set(info.placement).size, 2, 'both cores reached with the token');
  } finally {
    client.close();
  }
});

test('a bad or missing token is refused with UnauthorizedError', { skip }, async () => {
  const refused = (err) => err instanceof felix.UnauthorizedError && err.code === 'unauthorized';
  await assert.rejects(felix.Client.connect(FELIX_AUTH_ADDR, { token: `${FELIX_AUTH_TOKEN}-wrong` }), refused);
  await assert.rejects(felix.Client.connect(FELIX_AUTH_ADDR), refused);
});

test('a broker without tokens refuses a token', async () => {
  await assert.rejects(felix.Client.connect(ADDR, { token: 'anything' }), felix.UnauthorizedError);
});

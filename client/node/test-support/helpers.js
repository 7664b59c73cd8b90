'use strict';

// Shared setup for tests against a real broker (FELIX_ADDR).

const crypto = require('node:crypto');
const { Client } = require('../src');

const ADDR = process.env.FELIX_ADDR;
if (!ADDR) {
  throw new Error(
    'FELIX_ADDR is not set: these tests need a running broker with durable storage and 2 cores, started with ' +
      'FELIX_GROUP_MAX_ATTEMPTS=3 (e.g. FELIX_GROUP_MAX_ATTEMPTS=3 ./target/release/felix serve --data-dir DIR ' +
      '--listen 127.0.0.1:7400 --cores 2); then export FELIX_ADDR=127.0.0.1:7400. ' +
      'The broker-free tests: node --test test/client-fake.test.js test/*-unit.test.js',
  );
}

/** A fresh stream path, unique per call. */
function freshStream(prefix = 's') {
  return `node/test/${prefix}-${crypto.randomBytes(6).toString('hex')}`;
}

/** A client on FELIX_ADDR, closed after the test by `t.after`. */
async function connect(t, options) {
  const client = await Client.connect(ADDR, options);
  t.after(() => client.close());
  return client;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

module.exports = { ADDR, freshStream, connect, sleep };

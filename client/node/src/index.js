'use strict';

/**
 * Node.js client for the Felix broker.
 * @module felix-client
 */

const { Client } = require('./client');
const { ClusterClient } = require('./cluster');
const { Subscription } = require('./subscription');
const { ShardedGroup } = require('./sharded');
const { shardForKey, crc32c } = require('./crc32c');
const { FEATURES, FEATURES_ALL, PROTOCOL_VERSION } = require('./wire');
const errors = require('./errors');

module.exports = {
  Client,
  ClusterClient,
  Subscription,
  ShardedGroup,
  shardForKey,
  crc32c,
  FEATURES,
  FEATURES_ALL,
  PROTOCOL_VERSION,
  ...errors,
};

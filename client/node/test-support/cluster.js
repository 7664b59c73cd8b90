'use strict';

// Three brokers of a cluster of their own, for the cluster tests: started
// from FELIX_TEST_BROKER (the felix-test-broker binary, as `cargo test`
// builds it), killed with SIGKILL and restarted on the same data directory
// and ports. Each start costs seconds: start one cluster per test file.

const { spawn } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');

const BROKER = process.env.FELIX_TEST_BROKER;
if (!BROKER) {
  throw new Error(
    'FELIX_TEST_BROKER is not set: the cluster tests start three brokers of their own from the felix-test-broker ' +
      'binary (usage: felix-test-broker DATA_DIR LISTEN CORES). Build it with ' +
      'cargo build -p felix-tests --bin felix-test-broker, then export ' +
      'FELIX_TEST_BROKER=$PWD/target/debug/felix-test-broker (cargo test sets it).',
  );
}

/** How long a broker may take to say it listens. */
const START_DEADLINE_MS = 20_000;
const NODES = [1, 2, 3];
/** Signals that end the test process: its brokers are killed first. */
const SIGNALS = ['SIGINT', 'SIGTERM', 'SIGHUP'];

/** `n` distinct free ports on 127.0.0.1, from the OS (held open together, then released). */
async function freePorts(n) {
  const servers = [];
  try {
    for (let i = 0; i < n; i++) {
      const server = net.createServer();
      servers.push(server);
      await new Promise((resolve, reject) => {
        server.once('error', reject);
        server.listen(0, '127.0.0.1', resolve);
      });
    }
    return servers.map((s) => s.address().port);
  } finally {
    await Promise.all(servers.map((s) => new Promise((resolve) => s.close(() => resolve()))));
  }
}

/** The environment of a broker: this process's, less any FELIX_* setting, plus `own`. */
function brokerEnv(own) {
  const env = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('FELIX_')) env[k] = v;
  return { ...env, ...own };
}

/**
 * A running cluster of three brokers, nodes 1 to 3. `addrs[i - 1]` is
 * node i's client address.
 */
class TestCluster {
  /** @type {Map<number, {child: import('node:child_process').ChildProcess, exited: Promise<void>}>} */
  #running = new Map();
  #dir;
  #nodes;
  #secret;
  #onExit;
  #onSignal;

  constructor(dir, secret, addrs, nodes) {
    this.#dir = dir;
    this.#secret = secret;
    /** @type {string[]} */
    this.addrs = addrs;
    this.#nodes = nodes;
    // Should the test process end without stop() (a crash, or a stop
    // signal), no broker is left behind.
    this.#onExit = () => {
      for (const { child } of this.#running.values()) child.kill('SIGKILL');
      this.#running.clear();
      try {
        fs.rmSync(this.#dir, { recursive: true, force: true });
      } catch {
        // A broker still going down may hold it a moment: it is a temporary directory.
      }
    };
    this.#onSignal = (signal) => {
      this.#onExit();
      // Then as if it were not handled here (this listener is gone now),
      // unless someone else handles it.
      if (process.listenerCount(signal) === 0) process.kill(process.pid, signal);
    };
    process.on('exit', this.#onExit);
    for (const signal of SIGNALS) process.once(signal, this.#onSignal);
  }

  /** The node (1 to 3) whose client address is `addr`. */
  nodeOf(addr) {
    const i = this.addrs.indexOf(addr);
    if (i < 0) throw new Error(`${addr} is not a broker of this cluster (${this.addrs.join(', ')})`);
    return i + 1;
  }

  /** Where node i writes its log (stderr). */
  logOf(i) {
    return path.join(this.#dir, `n${i}.log`);
  }

  /** The last `lines` lines node i logged, for a failure message. */
  tail(i, lines = 20) {
    try {
      return fs.readFileSync(this.logOf(i), 'utf8').trimEnd().split('\n').slice(-lines).join('\n');
    } catch {
      return '(no log)';
    }
  }

  /** Start node i (again: same data directory and ports) and wait until it says it listens. */
  async start(i) {
    if (this.#running.has(i)) throw new Error(`node ${i} is running`);
    const data = path.join(this.#dir, `n${i}`);
    fs.mkdirSync(data, { recursive: true });
    const log = fs.openSync(this.logOf(i), 'a');
    let child;
    try {
      child = spawn(BROKER, [data, this.addrs[i - 1], '1'], {
        env: brokerEnv({
          FELIX_NODE_ID: String(i),
          FELIX_CLUSTER_NODES: this.#nodes,
          FELIX_CLUSTER_SECRET_FILE: this.#secret,
          FELIX_METRICS_LISTEN: '',
          FELIX_GROUP_MAX_ATTEMPTS: '3',
          RUST_LOG: process.env.FELIX_TEST_LOG ?? 'warn',
        }),
        stdio: ['ignore', 'pipe', log],
      });
    } finally {
      fs.closeSync(log);
    }
    // 'close': the process is gone and its stdout pipe closed.
    const exited = new Promise((resolve) => child.once('close', () => resolve()));
    this.#running.set(i, { child, exited });
    child.once('close', () => {
      if (this.#running.get(i)?.child === child) this.#running.delete(i);
    });
    await new Promise((resolve, reject) => {
      let seen = '';
      let listening = false;
      const fail = (why) => {
        clearTimeout(timer);
        child.kill('SIGKILL');
        reject(new Error(`broker node ${i} (${this.addrs[i - 1]}) ${why}; its log ends:\n${this.tail(i)}`));
      };
      const timer = setTimeout(() => fail(`did not say it listens within ${START_DEADLINE_MS} ms`), START_DEADLINE_MS);
      child.once('error', (err) => fail(`could not be started: ${err.message}`));
      child.once('exit', (code, signal) => {
        if (!listening) fail(`exited (${signal ?? code}) before it listened`);
      });
      // Read stdout to its end (a full pipe would block the broker); the
      // line that matters comes first.
      child.stdout.setEncoding('utf8');
      child.stdout.on('data', (chunk) => {
        if (listening) return;
        seen += chunk;
        if (/^felix: listening on \S+/m.test(seen)) {
          listening = true;
          clearTimeout(timer);
          resolve();
        }
      });
    });
  }

  /** `kill -9` node i: no shutdown, no flush. Resolves once it is gone. */
  async kill9(i) {
    const run = this.#running.get(i);
    if (!run) throw new Error(`node ${i} is not running`);
    run.child.kill('SIGKILL');
    await run.exited;
  }

  /** Start node i again after `kill9`. */
  async restart(i) {
    await this.start(i);
  }

  /** Whether node i runs. */
  running(i) {
    return this.#running.has(i);
  }

  /** Kill every broker, wait for them to go, and remove the data. */
  async stop() {
    const runs = [...this.#running.values()];
    for (const { child } of runs) child.kill('SIGKILL');
    await Promise.all(runs.map((r) => r.exited));
    process.removeListener('exit', this.#onExit);
    for (const signal of SIGNALS) process.removeListener(signal, this.#onSignal);
    fs.rmSync(this.#dir, { recursive: true, force: true });
  }
}

/**
 * Start a cluster of three brokers on free ports, sharing a secret; stop
 * it (`await cluster.stop()`) in an `after` hook.
 * @returns {Promise<TestCluster>}
 */
async function startCluster() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'felix-node-cluster-'));
  const secret = path.join(dir, 'cluster.secret');
  fs.writeFileSync(secret, 'a secret for the node cluster tests\n', { mode: 0o600 });
  fs.chmodSync(secret, 0o600);
  const ports = await freePorts(6);
  const addrs = NODES.map((i) => `127.0.0.1:${ports[i - 1]}`);
  const nodes = NODES.map((i) => `${i}=${addrs[i - 1]}/127.0.0.1:${ports[2 + i]}`).join(',');
  const cluster = new TestCluster(dir, secret, addrs, nodes);
  try {
    await Promise.all(NODES.map((i) => cluster.start(i)));
  } catch (err) {
    await cluster.stop();
    throw err;
  }
  return cluster;
}

module.exports = { startCluster, NODES };

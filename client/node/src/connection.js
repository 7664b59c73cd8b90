'use strict';

/**
 * One TCP connection to one core of a broker: HELLO, then any number of
 * requests in flight, paired with their answers by request id.
 * @module felix-client/connection
 */

const net = require('node:net');
const wire = require('./wire');
const {
  ConnectionError,
  DisconnectedError,
  InvalidArgumentError,
  ProtocolError,
  TimeoutError,
  UnsupportedError,
  errorFromWire,
} = require('./errors');

/** Request id of HELLO (as the Rust client); ids of later requests start at 1. */
const HELLO_ID = 0n;
/** TCP keepalive: first probe after this much idle time. */
const KEEPALIVE_MS = 30_000;
/** Longest delay `setTimeout` honours (a longer one fires after 1 ms). */
const MAX_TIMER_MS = 2 ** 31 - 1;
/** A connection open this long counts as healthy even if nothing was answered yet (as the Rust client). */
const PROVED_AFTER_MS = 5_000;

/** `ms` as a delay `setTimeout` keeps: at most 2^31-1 ms (about 24.8 days). */
function timerDelay(ms) {
  return Math.min(Math.max(ms, 0), MAX_TIMER_MS);
}

/**
 * What the broker answered to HELLO on one connection.
 * @typedef {object} HelloInfo
 * @property {number} version
 * @property {number} features the intersection of ours and the broker's
 * @property {number} cores
 * @property {number} core the core serving this connection
 * @property {number} maxFrameBytes largest frame the broker accepts
 * @property {string} broker
 */

/**
 * A live connection. Open one with `Connection.open`.
 */
class Connection {
  /**
   * @param {net.Socket} socket connected, HELLO done
   * @param {HelloInfo} hello
   * @param {wire.FrameParser} parser carrying bytes already read after HELLO's answer
   */
  constructor(socket, hello, parser) {
    this.socket = socket;
    this.hello = hello;
    this.parser = parser;
    this.nextId = 1n;
    /** @type {Map<bigint, {resolve: Function, reject: Function, timer: NodeJS.Timeout}>} */
    this.pending = new Map();
    /** Why the connection ended; set once. */
    this.closedReason = undefined;
    /** A connection-level error the broker sent (request id 0) before closing. */
    this.brokerNotice = undefined;
    /** The broker answered at least one request (a sign the connection was healthy). */
    this.answered = false;
    this.openedAt = Date.now();
    /** Frames waiting for the socket to drain, in request order. */
    this.outbox = [];
    this.queuedBytes = 0;
    /** The socket's last `write` returned false: wait for 'drain' before writing more. */
    this.needDrain = false;
    socket.on('data', (chunk) => this.onData(chunk));
    socket.on('drain', () => this.onDrain());
    socket.on('error', (err) => this.fail(new DisconnectedError(`connection lost: ${err.message}`, { cause: err })));
    socket.on('close', () => this.fail(new DisconnectedError(this.disconnectMessage('the broker closed the connection'))));
  }

  /**
   * Whether the connection proved healthy: the broker answered a request
   * on it, or it stayed open 5 s. One that closes at once without answering
   * counts as a failed attempt (the reconnect backoff keeps growing).
   */
  get proved() {
    return this.answered || Date.now() - this.openedAt >= PROVED_AFTER_MS;
  }

  /**
   * Connect, say HELLO and wait for its answer, all within `connectTimeoutMs`.
   * @param {object} options
   * @param {string} options.host
   * @param {number} options.port
   * @param {number} [options.wantCore] ask to be served by this core
   * @param {string} [options.token]
   * @param {string} options.clientName
   * @param {number} options.connectTimeoutMs
   * @param {number} options.maxFrameBytes largest frame accepted from the broker
   * @param {AbortSignal} [options.signal] aborting it ends the attempt with `DisconnectedError`
   * @returns {Promise<Connection>}
   */
  static open(options) {
    return new Promise((resolve, reject) => {
      const { signal } = options;
      if (signal?.aborted) {
        reject(new DisconnectedError('the client is closed'));
        return;
      }
      const parser = new wire.FrameParser(options.maxFrameBytes);
      const socket = net.connect({ host: options.host, port: options.port });
      let settled = false;
      const listeners = {
        error: (err) => finish(new ConnectionError(`cannot connect to ${options.host}:${options.port}: ${err.message}`, { cause: err })),
        close: () => finish(new ConnectionError('the broker closed the connection during HELLO')),
        connect: () => {
          socket.setNoDelay(true);
          socket.setKeepAlive(true, KEEPALIVE_MS);
          socket.write(helloFrame(options));
        },
        data: (chunk) => onHelloData(chunk),
      };
      const onAbort = () => finish(new DisconnectedError('the client was closed while connecting'));
      /** Stop the HELLO exchange: its listeners (only ours), timer and abort hook go either way. */
      const settle = () => {
        if (settled) return false;
        settled = true;
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
        for (const [event, fn] of Object.entries(listeners)) socket.removeListener(event, fn);
        return true;
      };
      const finish = (err) => {
        if (!settle()) return;
        socket.destroy();
        reject(err);
      };
      const timer = setTimeout(
        () => finish(new TimeoutError(`no answer to HELLO from ${options.host}:${options.port} within ${options.connectTimeoutMs} ms`)),
        timerDelay(options.connectTimeoutMs),
      );
      signal?.addEventListener('abort', onAbort);
      // After an error the socket is destroyed; a later one must not go unhandled.
      socket.on('error', () => {});
      for (const [event, fn] of Object.entries(listeners)) socket.on(event, fn);
      let start = Buffer.alloc(0); // the answer's first bytes, until there are 4
      const onHelloData = (chunk) => {
        if (start.length < 4) {
          start = Buffer.concat([start, chunk]).subarray(0, 4);
          const wrong = start.length === 4 && notAFrame(start, options);
          if (wrong) {
            finish(new ProtocolError(wrong));
            return;
          }
        }
        let frames;
        try {
          frames = parser.push(chunk);
        } catch (err) {
          finish(new ProtocolError(`bad answer to HELLO: ${err.message}`));
          return;
        }
        if (frames.length === 0) return;
        let hello;
        try {
          hello = helloAnswer(frames[0], options.wantCore);
        } catch (err) {
          finish(err);
          return;
        }
        if (!settle()) return;
        const conn = new Connection(socket, hello, parser);
        resolve(conn);
        // Frames after HELLO's answer cannot exist (nothing else was sent), but
        // they must not be dropped silently.
        if (frames.length > 1) conn.fail(new ProtocolError('the broker answered requests never sent'));
      };
    });
  }

  /** Whether the connection can no longer carry requests. */
  get closed() {
    return this.closedReason !== undefined;
  }

  /**
   * Send a request and wait for its answer.
   * @param {object} req
   * @param {string} req.name snake_case request name, for messages
   * @param {number} req.opcode
   * @param {(w: wire.Writer) => void} req.body
   * @param {number} [req.features] feature bits the request needs as sent
   * @param {number} [req.sizeHint]
   * @param {number} timeoutMs
   * @returns {Promise<{type: string} & Record<string, any>>} the answer; an `Error` answer rejects with its typed error
   */
  call(req, timeoutMs) {
    if (this.closed) return Promise.reject(this.closedReason);
    const missing = (req.features ?? 0) & ~this.hello.features;
    if (missing !== 0) {
      return Promise.reject(new UnsupportedError(
        `${req.name} needs feature bits 0x${missing.toString(16)}, which the broker on this connection did not advertise`,
        { local: true },
      ));
    }
    const id = this.nextId++;
    const frame = wire.encodeRequest(id, req.opcode, req.body, req.sizeHint);
    if (frame.length - 4 > this.hello.maxFrameBytes) {
      return Promise.reject(new InvalidArgumentError(
        `${req.name} request is ${frame.length - 4} bytes, over the broker's frame limit of ${this.hello.maxFrameBytes} bytes`,
      ));
    }
    return new Promise((resolve, reject) => {
      const entry = { frame, sent: false };
      const timer = setTimeout(() => {
        this.pending.delete(id);
        if (!entry.sent) {
          // Still queued behind a full socket: it never goes out.
          this.queuedBytes -= entry.frame.length;
          entry.frame = undefined;
          reject(new TimeoutError(`${req.name} was not sent within ${timeoutMs} ms (the connection is backed up); it was not applied`));
          return;
        }
        reject(new TimeoutError(`no answer to ${req.name} within ${timeoutMs} ms; it may or may not have been applied`));
      }, timerDelay(timeoutMs));
      this.pending.set(id, { resolve, reject, timer });
      this.send(entry);
    });
  }

  /**
   * Write a frame now, or queue it (keeping request order) while the
   * socket waits to drain: once the socket holds more than its high-water
   * mark (`write` returned false, the kernel is not taking bytes as fast as
   * they come), nothing more is handed to it until 'drain'. `queuedBytes`
   * says how much waits here.
   */
  send(entry) {
    if (this.needDrain || this.outbox.length > 0) {
      this.outbox.push(entry);
      this.queuedBytes += entry.frame.length;
      return;
    }
    this.write(entry);
  }

  write(entry) {
    entry.sent = true;
    const frame = entry.frame;
    entry.frame = undefined;
    if (!this.socket.write(frame)) this.needDrain = true;
  }

  onDrain() {
    this.needDrain = false;
    while (this.outbox.length > 0 && !this.needDrain && !this.closed) {
      const entry = this.outbox.shift();
      if (entry.frame === undefined) continue; // timed out while queued
      this.queuedBytes -= entry.frame.length;
      this.write(entry);
    }
  }

  /** Close the socket; requests in flight reject with `DisconnectedError`. */
  close() {
    this.fail(new DisconnectedError('the client was closed before the answer arrived'));
  }

  /** @param {Buffer} chunk */
  onData(chunk) {
    let frames;
    try {
      frames = this.parser.push(chunk);
    } catch (err) {
      this.fail(new ProtocolError(`undecodable bytes from the broker: ${err.message}`));
      return;
    }
    for (const frame of frames) {
      if (this.closed) return;
      this.onFrame(frame);
    }
  }

  onFrame(frame) {
    let msg;
    try {
      msg = checkedResponse(frame);
    } catch (err) {
      // The frame's length was fine and it was consumed whole, so the
      // connection is still in sync: fail only the request it answers.
      this.settle(frame.requestId, (waiter) => waiter.reject(
        new ProtocolError(`undecodable answer (request id ${frame.requestId}, opcode 0x${frame.opcode.toString(16)}): ${err.message}`),
      ));
      return;
    }
    this.answered = true;
    const waiter = this.pending.get(frame.requestId);
    if (!waiter) {
      // Request id 0 carries a connection-level error before the broker
      // closes; anything else answers a request that already timed out.
      if (frame.requestId === HELLO_ID && msg.type === 'error') this.brokerNotice = msg.message;
      return;
    }
    this.settle(frame.requestId, (w) => {
      if (msg.type === 'error') w.reject(errorFromWire(msg.code, msg.message, msg.core, msg.leader, msg.notApplied));
      else w.resolve(msg);
    });
  }

  /** Hand request `id`'s waiter to `done`; an id nobody waits for (timed out) is ignored. */
  settle(id, done) {
    const waiter = this.pending.get(id);
    if (!waiter) return;
    this.pending.delete(id);
    clearTimeout(waiter.timer);
    done(waiter);
  }

  disconnectMessage(what) {
    const notice = this.brokerNotice ? ` (${this.brokerNotice})` : '';
    return `${what}${notice}; a request in flight may or may not have been applied`;
  }

  /** Mark the connection dead, drop the socket and reject every request in flight with `err`. */
  fail(err) {
    if (this.closed) return;
    this.closedReason = err;
    this.socket.destroy();
    this.outbox = [];
    this.queuedBytes = 0;
    for (const waiter of this.pending.values()) {
      clearTimeout(waiter.timer);
      waiter.reject(err);
    }
    this.pending.clear();
  }
}

/**
 * Why the first 4 bytes answering HELLO cannot start a Felix frame (an HTTP
 * answer, e.g. from the metrics port, or a length no HELLO answer could
 * have), or `undefined` if they can.
 * @param {Buffer} start
 * @param {{host: string, port: number, maxFrameBytes: number}} options
 * @returns {string | undefined}
 */
function notAFrame(start, options) {
  const where = `${options.host.includes(':') ? `[${options.host}]` : options.host}:${options.port}`;
  if (start.toString('latin1') === 'HTTP') {
    return `not a Felix broker at ${where} (it answered HTTP: the metrics port?)`;
  }
  const len = start.readUInt32LE(0);
  if (len > options.maxFrameBytes || len < wire.HEADER_AFTER_LEN) {
    return `not a Felix broker at ${where}: its first answer declares a ${len}-byte frame`;
  }
  return undefined;
}

/** The HELLO frame for `options`. */
function helloFrame(options) {
  return wire.encodeRequest(HELLO_ID, wire.OP.HELLO, (w) => {
    w.u16(wire.PROTOCOL_VERSION);
    w.u64(BigInt(wire.FEATURES_ALL));
    w.opt(options.wantCore, w.u32);
    w.str(options.clientName);
    w.opt(options.token, w.str);
  });
}

/**
 * Validate a frame's header and decode its body.
 * @throws {wire.DecodeError}
 */
function checkedResponse(frame) {
  if (frame.kind !== wire.KIND_RESPONSE) throw new wire.DecodeError(`unexpected frame kind ${frame.kind}`);
  if (frame.flags !== 0) throw new wire.DecodeError('invalid flags');
  return wire.decodeResponse(frame.opcode, frame.body);
}

/**
 * The HelloInfo from the first answer on a connection.
 * @returns {HelloInfo}
 * @throws {import('./errors').FelixError}
 */
function helloAnswer(frame, wantCore) {
  let msg;
  try {
    msg = checkedResponse(frame);
  } catch (err) {
    throw new ProtocolError(`bad answer to HELLO: ${err.message}`);
  }
  if (msg.type === 'error') throw errorFromWire(msg.code, msg.message, msg.core);
  if (msg.type !== 'hello_ok') throw new ProtocolError(`broker answered HELLO with ${msg.type}`);
  if (msg.version !== wire.PROTOCOL_VERSION) {
    throw new UnsupportedError(`broker speaks protocol version ${msg.version}, this client version ${wire.PROTOCOL_VERSION}`);
  }
  if (wantCore !== undefined && msg.core !== wantCore) {
    throw new ConnectionError(`broker put the connection on core ${msg.core} instead of core ${wantCore}`);
  }
  return {
    version: msg.version,
    // Keep only bits we offered: the intersection, whatever the broker sent.
    features: Number(msg.features & BigInt(wire.FEATURES_ALL)),
    cores: msg.cores,
    core: msg.core,
    maxFrameBytes: msg.maxFrameBytes,
    broker: msg.broker,
  };
}

module.exports = { Connection, timerDelay, MAX_TIMER_MS };

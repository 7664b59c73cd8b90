'use strict';

// A scripted stand-in for a broker, for what a real one will not do:
// malformed bytes, hanging, dropping connections, withholding features,
// changing its core count, answering in unusual ways.

const net = require('node:net');
const wire = require('../src/wire');

/** A response frame: header + body. */
function responseFrame(requestId, opcode, body = Buffer.alloc(0), { kind = 2, len, flags = 0 } = {}) {
  const head = Buffer.alloc(16);
  head.writeUInt32LE(len ?? 12 + body.length, 0);
  head[4] = kind;
  head[5] = opcode;
  head.writeUInt16LE(flags, 6);
  head.writeBigUInt64LE(BigInt(requestId), 8);
  return Buffer.concat([head, body]);
}

/** A response frame whose body `write(w)` writes with a wire.Writer. */
function answer(requestId, opcode, write = () => {}) {
  const w = new wire.Writer();
  write(w);
  return responseFrame(requestId, opcode, Buffer.from(w.finish()));
}

/** An Error answer. */
function errorFrame(requestId, code, message, core) {
  return answer(requestId, 0xff, (w) => {
    w.u16(code);
    w.str(message);
    w.opt(core, w.u32);
  });
}

/** HelloOk: version 1, `features`, `cores` cores, on `core`, 16 MiB frames, broker "fake". */
function helloOk(requestId, features, cores = 1, core = 0) {
  return answer(requestId, 0x01, (w) => {
    w.u16(1);
    w.u64(BigInt(features));
    w.u32(cores);
    w.u32(core);
    w.u32(16 << 20);
    w.str('fake');
  });
}

/** The `want_core` of a HELLO body (undefined when absent). */
function wantCoreOf(body) {
  // u16 version, u64 features, then opt<u32>.
  return body[10] === 1 ? body.readUInt32LE(11) : undefined;
}

/** The StreamRef at the start of a request body, and the offset after it. */
function streamRefOf(body) {
  const r = new wire.Reader(body);
  const parts = [r.str('t'), r.str('n'), r.str('s')];
  return { path: parts.join('/'), rest: r.pos };
}

/**
 * Start a fake broker. `onRequest(frame, socket, state)` is called for every
 * request after HELLO. HELLO is answered by `onHello(wantCore, state)` when
 * given (it returns `{cores, core}`, or `{error: [code, message]}` to refuse
 * and close), else with `features`, one core, core 0; `hang` leaves it
 * unanswered. Each frame carries `core`: the core its connection is on;
 * `state.offered` is the feature bits the latest HELLO offered (a bigint).
 * @returns {Promise<{addr: string, state: object, close(): Promise<void>, drop(): void}>}
 */
async function fakeBroker({ features = 0x3f, onRequest = () => {}, onHello }) {
  const state = { requests: [], hellos: [], connections: 0, sockets: new Set() };
  const server = net.createServer((socket) => {
    state.connections++;
    state.sockets.add(socket);
    socket.on('close', () => state.sockets.delete(socket));
    socket.on('error', () => {});
    let buf = Buffer.alloc(0);
    let core = 0;
    socket.on('data', (chunk) => {
      buf = Buffer.concat([buf, chunk]);
      while (buf.length >= 4 && buf.length >= 4 + buf.readUInt32LE(0)) {
        const len = buf.readUInt32LE(0);
        const frame = { opcode: buf[5], requestId: buf.readBigUInt64LE(8), body: buf.subarray(16, 4 + len), core };
        buf = buf.subarray(4 + len);
        if (frame.opcode === 0x01) {
          const want = wantCoreOf(frame.body);
          state.hellos.push(want);
          // u16 version, then the u64 features the client offers.
          state.offered = frame.body.readBigUInt64LE(2);
          const h = onHello ? onHello(want, state) : { cores: 1, core: 0 };
          if (h.hang) continue;
          if (h.error) {
            socket.end(errorFrame(frame.requestId, h.error[0], h.error[1]));
            return;
          }
          core = h.core;
          socket.write(helloOk(frame.requestId, h.features ?? features, h.cores, h.core));
        } else {
          state.requests.push(frame);
          onRequest(frame, socket, state);
        }
      }
    });
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    addr: `127.0.0.1:${server.address().port}`,
    state,
    /** Drop every connection (a broker restart). */
    drop: () => {
      for (const s of state.sockets) s.destroy();
    },
    close: () => {
      for (const s of state.sockets) s.destroy();
      return new Promise((resolve) => server.close(resolve));
    },
  };
}

module.exports = { fakeBroker, responseFrame, answer, errorFrame, streamRefOf };

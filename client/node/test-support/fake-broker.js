'use strict';

// A scripted stand-in for a broker, for what a real one will not do:
// malformed bytes, hanging, dropping connections, withholding features.

const net = require('node:net');

/** A response frame: header + body. */
function responseFrame(requestId, opcode, body = Buffer.alloc(0), { kind = 2, len } = {}) {
  const head = Buffer.alloc(16);
  head.writeUInt32LE(len ?? 12 + body.length, 0);
  head[4] = kind;
  head[5] = opcode;
  head.writeBigUInt64LE(BigInt(requestId), 8);
  return Buffer.concat([head, body]);
}

/** HelloOk body: version 1, `features`, 2 cores, core 0, 16 MiB frames, broker "fake". */
function helloOk(requestId, features) {
  const body = Buffer.alloc(2 + 8 + 4 + 4 + 4 + 2 + 4);
  let o = body.writeUInt16LE(1, 0);
  o = body.writeBigUInt64LE(BigInt(features), o);
  o = body.writeUInt32LE(1, o); // one core: no placement lookups
  o = body.writeUInt32LE(0, o);
  o = body.writeUInt32LE(16 << 20, o);
  o = body.writeUInt16LE(4, o);
  body.write('fake', o);
  return responseFrame(requestId, 0x01, body);
}

/**
 * Start a fake broker. `onRequest(frame, socket, conn)` is called for every
 * request after HELLO (which is answered with `features`).
 * @returns {Promise<{addr: string, state: {requests: object[], connections: number}, close(): Promise<void>}>}
 */
async function fakeBroker({ features = 0x3f, onRequest }) {
  const state = { requests: [], connections: 0, sockets: new Set() };
  const server = net.createServer((socket) => {
    state.connections++;
    state.sockets.add(socket);
    socket.on('close', () => state.sockets.delete(socket));
    socket.on('error', () => {});
    let buf = Buffer.alloc(0);
    socket.on('data', (chunk) => {
      buf = Buffer.concat([buf, chunk]);
      while (buf.length >= 4 && buf.length >= 4 + buf.readUInt32LE(0)) {
        const len = buf.readUInt32LE(0);
        const frame = { opcode: buf[5], requestId: buf.readBigUInt64LE(8), body: buf.subarray(16, 4 + len) };
        buf = buf.subarray(4 + len);
        if (frame.opcode === 0x01) {
          socket.write(helloOk(frame.requestId, features));
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
    close: () => {
      for (const s of state.sockets) s.destroy();
      return new Promise((resolve) => server.close(resolve));
    },
  };
}

module.exports = { fakeBroker, responseFrame };

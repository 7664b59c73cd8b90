//! A connection's first request: HELLO, with the client's credentials,
//! the protocol version and features both sides speak, and the core the
//! client wants (the connection is handed to it).

use super::{hand_off, log_refusal, ConnInfo, HandOff, Outbox, Shared, STOPPING};
use crate::broker::{wire_err, Core};
use bytes::BytesMut;
use felix_engine::storage::Storage;
use felix_wire::{ErrorCode, Request, Response};
use std::rc::Rc;

/// What became of a connection's first request.
pub(super) enum Hello {
    /// HELLO is through and answered: requests follow.
    Said,
    /// Refused (answered, with the reason): the connection closes.
    Close,
    /// The connection went to the core its HELLO asked for, with the HELLO
    /// and what followed it (`rest`), to be answered there.
    HandedOff,
}

/// Take the connection's first request `req` (id `id`), followed in the
/// read buffer by `rest`. `handed` says the connection was handed here
/// already: it stays, whatever core its HELLO names.
#[allow(clippy::too_many_arguments)]
pub(super) fn hello<S: Storage>(
    core: &Rc<Core<S>>,
    info: &ConnInfo,
    outbox: &Outbox,
    sock: &Shared,
    handed: bool,
    id: u64,
    req: Request,
    rest: &BytesMut,
) -> Hello {
    let conn_id = info.id;
    let max_frame = core.shared.config.max_frame_bytes;
    match req {
        Request::Hello {
            version,
            features,
            want_core,
            ref client_name,
            ..
        } => {
            // A stopping broker takes no new clients.
            if core.stopping.get() {
                outbox.push(id, &wire_err(ErrorCode::Unavailable, STOPPING));
                return Hello::Close;
            }
            // Then credentials: a client that has not
            // authenticated learns nothing and is not
            // handed to another core.
            let token = match &req {
                Request::Hello { token, .. } => token.as_deref(),
                _ => None,
            };
            let who =
                core.with_security(|sec| crate::auth::authenticate(sec.tokens.as_ref(), token));
            match who {
                Ok(principal) => *info.principal.borrow_mut() = principal,
                Err(why) => {
                    log_refusal(conn_id, sock, client_name, &why);
                    core.metrics.count_error(ErrorCode::Unauthorized);
                    outbox.push(id, &wire_err(ErrorCode::Unauthorized, why));
                    return Hello::Close;
                }
            }
            if let Some(want) = want_core.filter(|w| *w >= core.shared.cores) {
                outbox.push(
                    id,
                    &wire_err(
                        ErrorCode::InvalidRequest,
                        format!(
                            "HELLO asks for core {want}; this broker runs cores 0..{}",
                            core.shared.cores
                        ),
                    ),
                );
                return Hello::Close;
            }
            if let Some(want) = want_core {
                if !handed && want != core.core_id() {
                    // Re-encode the HELLO in front of what
                    // follows and hand the socket over.
                    let mut all = BytesMut::new();
                    felix_wire::encode_request(id, &req, &mut all);
                    all.extend_from_slice(rest);
                    match hand_off(core, sock, want, all.to_vec()) {
                        HandOff::Sent => {
                            outbox.handed_off.set(true);
                            return Hello::HandedOff;
                        }
                        // Answered from here: `HelloOk`
                        // names this core, and a client
                        // that wanted another (ours does)
                        // reconnects to try again.
                        HandOff::Kept => {}
                        // Only a core that is stopping
                        // takes no hand-off.
                        HandOff::Refused => {
                            outbox.push(
                                id,
                                &wire_err(
                                    ErrorCode::Unavailable,
                                    format!("core {want} takes no connections now: {STOPPING}"),
                                ),
                            );
                            return Hello::Close;
                        }
                    }
                }
            }
            if version == 0 {
                outbox.push(
                    id,
                    &wire_err(
                        ErrorCode::Unsupported,
                        format!(
                            "protocol version 0 is not supported; this broker speaks 1..={}",
                            felix_wire::PROTOCOL_VERSION
                        ),
                    ),
                );
                return Hello::Close;
            }
            tracing::debug!(conn = conn_id, client = ?client_name, principal = %info.principal.borrow(), version, "hello");
            // The connection runs at the lower version and
            // the features both sides know.
            let f = core.shared.features() & features;
            info.features.set(f);
            outbox.push(
                id,
                &Response::HelloOk {
                    version: version.min(felix_wire::PROTOCOL_VERSION),
                    features: f,
                    cores: core.shared.cores,
                    core: core.core_id(),
                    max_frame_bytes: max_frame,
                    broker: core.shared.broker_id.clone(),
                },
            );
            Hello::Said
        }
        _ => {
            outbox.push(
                id,
                &wire_err(
                    ErrorCode::InvalidRequest,
                    "the first request on a connection must be HELLO",
                ),
            );
            Hello::Close
        }
    }
}

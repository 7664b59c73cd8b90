//! Consumer-group requests on the shard's owning core.

use crate::broker::{wire_err, Core};
use crate::conn::ConnInfo;
use felix_engine::storage::Storage;
use felix_wire::{ErrorCode, Request, Response};
use std::rc::Rc;

pub(crate) async fn handle<S: Storage>(core: &Rc<Core<S>>, _info: &Rc<ConnInfo>, req: Request) -> Response {
    let _ = core;
    wire_err(
        ErrorCode::Unsupported,
        format!("{} is not supported by this broker", req.name()),
    )
}

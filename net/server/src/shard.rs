//! A shard as the broker holds it on its owning core: the log, its flusher,
//! and (when groups are enabled) the group trackers.

use crate::broker::Core;
use crate::catalog::StreamMeta;
use felix_engine::log::{LogError, ShardLog};
use felix_engine::storage::Storage;
use felix_engine::StreamName;
use std::path::Path;
use std::rc::Rc;

pub(crate) struct Shard<S: Storage> {
    pub stream: StreamName,
    pub index: u32,
    pub log: ShardLog<S>,
}

impl<S: Storage> Shard<S> {
    pub async fn open(
        core: Rc<Core<S>>,
        meta: &StreamMeta,
        index: u32,
        dir: &Path,
    ) -> Result<Rc<Shard<S>>, LogError> {
        let log = ShardLog::open(core.storage.clone(), dir, core.log_config(meta), &mut |_| {}).await?;
        let shard = Rc::new(Shard {
            stream: meta.name.clone(),
            index,
            log,
        });
        let flusher = shard.log.clone();
        glommio::spawn_local(async move { flusher.run_flusher().await }).detach();
        Ok(shard)
    }

    pub fn name(&self) -> String {
        format!("{}/{}", self.stream, self.index)
    }

    pub async fn destroy(&self) -> Result<(), LogError> {
        let _ = self.log.close().await;
        self.log.destroy().await
    }
}

//! `felix serve`: hand the command line to the broker crate.

use crate::args::ServeArgs;
use crate::CliError;

pub fn run(args: ServeArgs) -> Result<(), CliError> {
    felix_server::serve(felix_server::ServeOptions {
        config_path: args.config,
        data_dir: args.data_dir,
        listen: args.listen,
        cores: args.cores,
        node_id: args.node_id,
        peers: args.peers,
        print_config: args.print_config,
    })
    .map_err(|e| CliError::Serve(e.to_string()))
}

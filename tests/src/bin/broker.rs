//! The broker the end-to-end tests start and kill: `felix serve` without the
//! rest of the CLI, so the tests crate can name its binary.
//! Usage: felix-test-broker DATA_DIR|- LISTEN CORES
//! FELIX_TEST_CONFIG names a config file, for settings that have no
//! environment variable (group idle time, segment size, retention checks).

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: felix-test-broker DATA_DIR|- LISTEN CORES");
        std::process::exit(2);
    }
    let data_dir = (args[1] != "-").then(|| args[1].clone().into());
    if data_dir.is_none() {
        std::env::set_var("FELIX_DURABLE_STORAGE_DIR", "");
    }
    let opts = felix_server::ServeOptions {
        config_path: std::env::var_os("FELIX_TEST_CONFIG").map(Into::into),
        data_dir,
        listen: Some(args[2].clone()),
        cores: Some(args[3].clone()),
        node_id: None,
        peers: None,
        print_config: false,
    };
    if let Err(e) = felix_server::serve(opts) {
        eprintln!("felix-test-broker: {e}");
        std::process::exit(1);
    }
}

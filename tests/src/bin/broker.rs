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
        cores: Some(spread(&args[3])),
        node_id: None,
        peers: None,
        print_config: false,
    };
    if let Err(e) = felix_server::serve(opts) {
        eprintln!("felix-test-broker: {e}");
        std::process::exit(1);
    }
}

/// A one-core broker runs on one of the CPUs this process may use, chosen
/// by its process id, rather than always on the first: tests run side by
/// side, and brokers all pinned to one CPU would queue for it while the
/// others idle. Any other core count or list is passed on as given.
fn spread(cores: &str) -> String {
    if cores != "1" {
        return cores.to_string();
    }
    let cpus = core_affinity::get_core_ids().unwrap_or_default();
    match cpus.get(std::process::id() as usize % cpus.len().max(1)) {
        Some(cpu) => format!("{},", cpu.id),
        None => cores.to_string(),
    }
}

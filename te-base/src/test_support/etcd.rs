//! An etcd server started for one test, in a temporary directory, on loopback or inside a network
//! namespace. Killed and its directory removed on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Path of the etcd binary (`TE_ETCD_BIN`, default `/usr/bin/etcd` from Debian's etcd-server).
pub fn etcd_bin() -> String {
    std::env::var("TE_ETCD_BIN").unwrap_or_else(|_| "/usr/bin/etcd".into())
}

/// A running etcd.
pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    /// Client endpoint, `http://ip:port`.
    pub endpoint: String,
    /// Where it runs: namespace, address, client and peer ports (for a restart).
    place: (Option<String>, String, u16, u16),
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl EtcdServer {
    /// Starts etcd listening on `ip` (client port 2379, peer port 2380) inside namespace `ns`, and
    /// waits (bounded) until it answers.
    pub fn start(ns: &str, ip: &str) -> Result<EtcdServer, String> {
        Self::start_at(Some(ns), ip, 2379, 2380, false)
    }

    /// Starts etcd on free loopback ports of this namespace, or returns `None` after printing why
    /// (and panics instead when `TE_REQUIRE` names etcd).
    pub fn start_on_loopback() -> Option<EtcdServer> {
        let ports = super::free_port().and_then(|c| super::free_port().map(|p| (c, p)));
        match ports.and_then(|(client, peer)| Self::start_at(None, "127.0.0.1", client, peer, false)) {
            Ok(server) => Some(server),
            Err(e) => {
                super::skip_or_fail("etcd", &e);
                None
            }
        }
    }

    /// `keep_data`: start on the data directory a previous etcd at this place left (a restart).
    fn start_at(
        ns: Option<&str>,
        ip: &str,
        client_port: u16,
        peer_port: u16,
        keep_data: bool,
    ) -> Result<EtcdServer, String> {
        let bin = etcd_bin();
        if !std::path::Path::new(&bin).exists() {
            return Err(format!("{bin} missing (Debian package etcd-server)"));
        }
        let dir = std::env::temp_dir().join(format!(
            "te-etcd-{}-{}-{client_port}",
            std::process::id(),
            ns.unwrap_or("root")
        ));
        if !keep_data {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let endpoint = format!("http://{ip}:{client_port}");
        let peer = format!("http://{ip}:{peer_port}");
        let mut cmd = match ns {
            Some(ns) => super::netns::Network::command_in(ns, &bin),
            None => Command::new(&bin),
        };
        cmd.arg("--data-dir")
            .arg(dir.join("data"))
            .args(["--name", "te-test", "--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint, "--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("te-test={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd.spawn().map_err(|e| format!("starting etcd: {e}"))?;
        let place = (ns.map(str::to_string), ip.to_string(), client_port, peer_port);
        let server = EtcdServer {
            child,
            dir,
            endpoint,
            place,
        };
        server.wait_ready(ns, ip, client_port)?;
        Ok(server)
    }

    /// Kills etcd and starts a new one on the same address and ports with an empty data
    /// directory: every key and lease is gone, as after losing a single-node cluster's disk.
    pub fn restart_empty(&mut self) -> Result<(), String> {
        self.start_again(false)
    }

    /// Kills etcd (SIGKILL: no clean shutdown) and leaves it down until [`EtcdServer::start_again`].
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts etcd again where it ran, on its data directory (`keep_data`: the keys and leases
    /// it had, as after a crash; etcd extends every lease by its TTL when it comes back) or an
    /// empty one.
    pub fn start_again(&mut self, keep_data: bool) -> Result<(), String> {
        self.stop();
        let (ns, ip, client, peer) = self.place.clone();
        if !keep_data {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        let fresh = Self::start_at(ns.as_deref(), &ip, client, peer, keep_data)?;
        // Take the new process over. The old handle is forgotten, not dropped: its drop would
        // remove the directory, which is the same path the new etcd now uses.
        let old = std::mem::replace(self, fresh);
        std::mem::forget(old);
        Ok(())
    }

    fn wait_ready(&self, ns: Option<&str>, ip: &str, port: u16) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = format!("http://{ip}:{port}/health");
        while Instant::now() < deadline {
            // etcd answers /health once it serves clients; ask from inside its namespace.
            let mut probe = match ns {
                Some(ns) => super::netns::Network::command_in(ns, "bash"),
                None => Command::new("bash"),
            };
            let ok = probe
                .args(["-c", &format!("exec 3<>/dev/tcp/{ip}/{port} && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q true <&3")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!("etcd did not answer {url} within 30 s"))
    }
}

//! An etcd server started for one test, in a temporary directory, optionally inside a network
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
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl EtcdServer {
    /// Starts etcd listening on `ip` (client port 2379, peer port 2380), inside namespace `ns`
    /// when given, and waits (bounded) until its client port accepts connections.
    pub fn start(ns: Option<&str>, ip: &str) -> Result<EtcdServer, String> {
        let bin = etcd_bin();
        if !std::path::Path::new(&bin).exists() {
            return Err(format!("{bin} missing (Debian package etcd-server)"));
        }
        let dir = std::env::temp_dir().join(format!("te-etcd-{}-{}", std::process::id(), ns.unwrap_or("root")));
        let _ = std::fs::remove_dir_all(&dir);
        let endpoint = format!("http://{ip}:2379");
        let peer = format!("http://{ip}:2380");
        let mut cmd = match ns {
            Some(ns) => crate::netns::Network::command_in(ns, &bin),
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
        let server = EtcdServer { child, dir, endpoint };
        server.wait_ready(ns, ip)?;
        Ok(server)
    }

    fn wait_ready(&self, ns: Option<&str>, ip: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = format!("http://{ip}:2379/health");
        while Instant::now() < deadline {
            // etcd answers /health once it serves clients; ask from inside its namespace.
            let mut probe = match ns {
                Some(ns) => crate::netns::Network::command_in(ns, "bash"),
                None => Command::new("bash"),
            };
            let ok = probe
                .args(["-c", &format!("exec 3<>/dev/tcp/{ip}/2379 && printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q true <&3")])
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

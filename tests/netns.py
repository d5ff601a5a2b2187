"""A small cluster of virtual hosts for multi-host tests: network namespaces,
veth pairs on a bridge, one real sshd per host.

    with TestCluster(prefix="pcc", hosts=3, subnet="10.213.7") as cluster:
        cluster.hosts[0].addr          # 10.213.7.11, reachable from this machine
        cluster.write_nodes_file(path) # a nodes.yaml for paicli (key, known_hosts)
        cluster.link_down("h2")        # the host drops off the network
        cluster.leftovers("h1")        # processes on h1 other than its sshd

Each host is a network namespace `<prefix>-<name>` with loopback up and one veth end
(`<prefix><name>` on the bridge side, `<prefix><name>p` inside, renamed eth0) on the
bridge `<prefix>br`, which has the address `<subnet>.1` so this machine reaches every
host. Addresses exist only inside this sandbox: pick a subnet nobody routes
(10.213.x.0/24), one per user of the harness (helpers and test modules), so that two
clusters can live at once.

Each host's sshd runs inside its network namespace AND a private mount namespace
whose /tmp is a fresh tmpfs, so hosts share the filesystem except /tmp: nothing may
lean on a shared job folder. Its config (key auth only, its own host key and
authorized_keys, listening on the host's address) lives in the cluster's state
directory under /var/tmp (not /tmp, which the sshd no longer sees).

Teardown removes everything (sshd, every process in the namespaces, veths, bridge,
namespaces, the state directory) even when a test fails: `close()` is idempotent and
is also registered with atexit. At start, leftovers of an earlier run with the same
prefix whose owner process is gone are swept.

`can_build()` says whether this machine can do it (root, CAP_NET_ADMIN, ip, sshd);
tests skip with its reason otherwise.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"
SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
STATE_ROOT = Path("/var/tmp")
# Each test cluster's state folder is STATE_ROOT / (CLUSTER_PREFIX + its prefix).
CLUSTER_PREFIX = "paicli-cluster-"


def can_build() -> str | None:
    """None when a cluster can be built here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, veth, a bridge)"
    for tool in (IP, UNSHARE, SSH_KEYGEN):
        if not os.path.exists(tool):
            return f"multi-host tests need {tool} (apt-get install iproute2 openssh-client util-linux)"
    if not os.path.exists(SSHD):
        return "multi-host tests need sshd (apt-get install openssh-server; .ci/setup does it)"
    probe = "pcprobe%d" % os.getpid()
    made = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces (no CAP_NET_ADMIN?): {made.stderr.strip()}"
    subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return None


def _run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _default_signals() -> None:
    # Tests may run under nohup or a shell that ignores SIGINT/SIGHUP; the sshd
    # (and so every session it starts) gets default dispositions.
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Host:
    name: str
    netns: str
    addr: str
    veth: str            # the bridge side
    state_dir: Path
    port: int = 22
    sshd: subprocess.Popen | None = field(default=None, repr=False)
    host_key_pub: str = ""

    def exec_argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's network namespace (shared /tmp, though)."""
        return [IP, "netns", "exec", self.netns, *argv]


class TestCluster:
    __test__ = False  # not a pytest class

    def __init__(self, prefix: str, hosts: int = 3, subnet: str = "10.213.7",
                 user: str | None = None):
        if not (prefix.isalnum() and prefix.islower() and len(prefix) <= 6):
            raise ValueError("prefix: up to 6 lowercase letters/digits (interface names are short)")
        self.prefix = prefix
        self.subnet = subnet
        import pwd

        self.user = user or pwd.getpwuid(os.geteuid()).pw_name
        self.bridge = f"{prefix}br"
        self.bridge_addr = f"{subnet}.1"
        self.state = STATE_ROOT / f"{CLUSTER_PREFIX}{prefix}"
        self.hosts: list[Host] = []
        self._count = hosts
        self._closed = False
        self._owned = False
        self.client_key = self.state / "client_ed25519"
        self.known_hosts = self.state / "known_hosts"

    # -- build ------------------------------------------------------------------

    def __enter__(self) -> "TestCluster":
        if self._owned:
            return self   # already started (build_cluster)
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self._claim()
        atexit.register(self.close)
        taken = [line.split()[1] for line in _run([IP, "-o", "-4", "addr", "show"], check=False).stdout.splitlines()
                 if f" {self.subnet}." in line]
        if taken:
            # Two bridges on one subnet: this machine's traffic would reach the other
            # cluster's hosts (a "changed host key" at best). Each user picks its own.
            raise ClusterInUse(f"subnet {self.subnet}.0/24 is already used by {', '.join(taken)}; "
                               "give this TestCluster another subnet")
        _run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", f"paicli-test-{self.prefix}",
              "-f", str(self.client_key)])
        _run([IP, "link", "add", self.bridge, "type", "bridge"])
        _run([IP, "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge])
        _run([IP, "link", "set", self.bridge, "up"])
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        for i in range(self._count):
            self.hosts.append(self._add_host(f"h{i + 1}", f"{self.subnet}.{11 + i}"))
        known = []
        for host in self.hosts:
            self._wait_sshd(host)
            known.append(f"{host.addr} {host.host_key_pub}")
        self.known_hosts.write_text("\n".join(known) + "\n")
        os.chmod(self.known_hosts, 0o600)

    def _add_host(self, name: str, addr: str) -> Host:
        host = Host(name=name, netns=f"{self.prefix}-{name}", addr=addr, veth=f"{self.prefix}{name}",
                    state_dir=self.state / name)
        host.state_dir.mkdir(mode=0o700)
        inner = f"{self.prefix}{name}p"
        _run([IP, "netns", "add", host.netns])
        _run([IP, "link", "add", host.veth, "type", "veth", "peer", "name", inner])
        _run([IP, "link", "set", host.veth, "master", self.bridge])
        _run([IP, "link", "set", host.veth, "up"])
        _run([IP, "link", "set", inner, "netns", host.netns])
        ns = [IP, "-n", host.netns]
        _run([*ns, "link", "set", inner, "name", "eth0"])
        _run([*ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
        _run([*ns, "link", "set", "eth0", "up"])
        _run([*ns, "link", "set", "lo", "up"])
        self._start_sshd(host)
        return host

    def _start_sshd(self, host: Host) -> None:
        key = host.state_dir / "ssh_host_ed25519_key"
        _run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", f"{host.name}", "-f", str(key)])
        pub = Path(f"{key}.pub").read_text().split()
        host.host_key_pub = f"{pub[0]} {pub[1]}"
        authorized = host.state_dir / "authorized_keys"
        shutil.copyfile(f"{self.client_key}.pub", authorized)
        os.chmod(authorized, 0o600)
        config = host.state_dir / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {host.addr}:{host.port}",
            f"HostKey {key}",
            f"AuthorizedKeysFile {authorized}",
            f"PidFile {host.state_dir / 'sshd.pid'}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",
            # MaxSessions stays OpenSSH's default (10): more instances on a node than
            # that must spread over several connections, as on a stock server.
            "MaxStartups 64:30:128",
            # Debian's bash sources ~/.bashrc for `ssh host cmd` unless SHLVL is already
            # set; a ~/.bashrc that runs `pyenv init` then rehashes under a lock on every
            # session (serialising them), and a session killed at teardown leaves that
            # lock behind for every later shell. Test hosts skip it.
            "SetEnv SHLVL=1",
            "ClientAliveInterval 2",
            "ClientAliveCountMax 3",
            f"Subsystem sftp {SFTP_SERVER}",
            "LogLevel INFO",   # INFO: a login is a line ("Accepted publickey"), which tests count
            "",
        ]))
        os.chmod(config, 0o600)
        log = open(host.state_dir / "sshd.log", "ab")
        # Network namespace (ip netns exec), then a private mount namespace whose /tmp is
        # a fresh tmpfs; sshd -D stays in the foreground so the harness owns it. The
        # inner command is fixed text; the paths reach it as arguments ("$@").
        argv = host.exec_argv([
            UNSHARE, "--mount", "--propagation", "private", "--",
            "/bin/sh", "-c", 'mount -t tmpfs -o mode=1777 tmpfs /tmp && exec "$@"', "sh",
            SSHD, "-D", "-e", "-f", str(config),
        ])
        host.sshd = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     start_new_session=True, preexec_fn=_default_signals)
        log.close()

    def _wait_sshd(self, host: Host, timeout: float = 10.0) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if host.sshd.poll() is not None:
                raise RuntimeError(f"sshd on {host.name} exited: "
                                   f"{(host.state_dir / 'sshd.log').read_text()[-500:]}")
            try:
                with socket.create_connection((host.addr, host.port), timeout=0.5) as sock:
                    if sock.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd on {host.name} ({host.addr}) did not answer in {timeout:.0f}s")

    # -- use --------------------------------------------------------------------

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def nodes(self, **extra) -> list[dict]:
        """Node entries for a paicli nodes file; `extra` is added to every node."""
        return [{"name": h.name, "host": h.addr, "port": h.port, "user": self.user,
                 "key": str(self.client_key), **extra} for h in self.hosts]

    def write_nodes_file(self, path: Path, known_hosts: Path | None = None, **extra) -> Path:
        import json  # JSON is YAML: no yaml needed to write it

        path.write_text(json.dumps({"known_hosts": str(known_hosts or self.known_hosts),
                                    "nodes": self.nodes(**extra)}, indent=2))
        os.chmod(path, 0o600)
        return path

    def ssh(self, name: str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run argv on the host through its sshd (so inside its private /tmp)."""
        import shlex

        host = self.host(name)
        return subprocess.run(
            ["ssh", "-i", str(self.client_key), "-o", f"UserKnownHostsFile={self.known_hosts}",
             "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
             "-p", str(host.port), f"{self.user}@{host.addr}", "--", " ".join(shlex.quote(a) for a in argv)],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def link_down(self, name: str) -> None:
        """The host drops off the network (its processes live on, unreachable)."""
        _run([IP, "link", "set", self.host(name).veth, "down"])

    def link_up(self, name: str) -> None:
        _run([IP, "link", "set", self.host(name).veth, "up"])

    def rate_limit(self, rate: str = "100mbit", names: list[str] | None = None) -> None:
        """Shape every (or the named) host's link both ways with a token bucket
        (`tbf`; this kernel has no netem): `rate` like 100mbit or 1gbit."""
        for host in self.hosts:
            if names is not None and host.name not in names:
                continue
            for argv in ([TC, "qdisc", "replace", "dev", host.veth, "root"],
                         [IP, "netns", "exec", host.netns, TC, "qdisc", "replace", "dev", "eth0", "root"]):
                _run([*argv, "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"])

    def pids(self, name: str) -> list[int]:
        """Every process in the host's network namespace."""
        out = _run([IP, "netns", "pids", self.host(name).netns], check=False).stdout
        return [int(p) for p in out.split()]

    def leftovers(self, name: str) -> list[tuple[int, str]]:
        """Live processes on the host other than its sshd listener (and its
        `unshare`/`sh` parents): what a job left behind."""
        host = self.host(name)
        ours = set()
        if host.sshd is not None:
            ours.add(host.sshd.pid)
            pidfile = host.state_dir / "sshd.pid"
            if pidfile.exists():
                try:
                    ours.add(int(pidfile.read_text().split()[0]))
                except (ValueError, IndexError):
                    pass
        found = []
        for pid in self.pids(name):
            if pid in ours or not _pid_alive(pid):
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(SSHD + " -D") or cmd.startswith("sshd: " + SSHD):
                continue  # the listener itself (after exec)
            found.append((pid, cmd.strip()))
        return found

    def all_leftovers(self) -> dict[str, list[tuple[int, str]]]:
        return {h.name: left for h in self.hosts if (left := self.leftovers(h.name))}

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        if self._closed or not self._owned:
            return   # never tear down what another run owns
        self._closed = True
        for host in self.hosts:
            self._kill_namespace(host.netns)
            if host.sshd is not None:
                try:
                    host.sshd.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        self.hosts = []
        self._remove_prefixed(self.prefix)
        shutil.rmtree(self.state, ignore_errors=True)
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    @staticmethod
    def _kill_namespace(netns: str) -> None:
        for _ in range(50):
            out = _run([IP, "netns", "pids", netns], check=False).stdout.split()
            live = [int(p) for p in out if _pid_alive(int(p))]
            if not live:
                return
            for pid in live:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    @classmethod
    def _remove_prefixed(cls, prefix: str) -> None:
        for ns in _run([IP, "netns", "list"], check=False).stdout.splitlines():
            name = ns.split()[0] if ns.split() else ""
            if name.startswith(f"{prefix}-"):
                cls._kill_namespace(name)
                _run([IP, "netns", "del", name], check=False)
        for line in _run([IP, "-o", "link", "show"], check=False).stdout.splitlines():
            parts = line.split(":")
            if len(parts) > 1:
                ifname = parts[1].strip().split("@")[0]
                if ifname.startswith(prefix) and (ifname == f"{prefix}br" or ifname[len(prefix):][:1] == "h"):
                    _run([IP, "link", "del", ifname], check=False)

    def _claim(self) -> None:
        """Own the prefix: its state directory appears whole, with our pid in it, by one
        rename (two runs cannot both get it). A stale one (owner gone) is swept first."""
        for _ in range(2):
            staging = STATE_ROOT / f".{CLUSTER_PREFIX}{self.prefix}.{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(mode=0o700)
            (staging / "owner").write_text(str(os.getpid()))
            try:
                os.rename(staging, self.state)
                self._owned = True
                return
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
            self.sweep()
        raise ClusterInUse(f"cannot claim the test cluster prefix {self.prefix!r}")

    def sweep(self) -> None:
        """Remove what an earlier run with this prefix left, unless its owner lives."""
        owner = self.state / "owner"
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and _pid_alive(pid):
            raise ClusterInUse(f"a test cluster with prefix {self.prefix!r} is in use by pid {pid}")
        self._remove_prefixed(self.prefix)
        shutil.rmtree(self.state, ignore_errors=True)


class ClusterInUse(RuntimeError):
    """Another live run owns this prefix or subnet."""


def build_cluster(hosts: int, prefix: str = "pcc", first_subnet: int = 100, tries: int = 20) -> TestCluster:
    """A started cluster on the first free prefix `PREFIXn` / subnet 10.213.(first_subnet+n),
    so that two runs of the same tests (a developer's and CI's) do not collide."""
    for n in range(tries):
        cluster = TestCluster(prefix=f"{prefix}{n}", hosts=hosts, subnet=f"10.213.{first_subnet + n}")
        try:
            return cluster.__enter__()
        except ClusterInUse:
            continue
    raise ClusterInUse(f"no free test cluster prefix {prefix}0..{prefix}{tries - 1}")


class LoopbackHost:
    """One sshd on 127.0.0.1 in this machine's own namespaces (no private /tmp, the
    machine's own network): a node for what a namespace host cannot do, such as
    provisioning a runtime from the package index. Same key-only config."""

    __test__ = False

    def __init__(self, state: Path, sftp: bool = True):
        import socket

        self.state = state
        self.sftp = sftp
        self.name = "lo"
        self.addr = "127.0.0.1"
        with socket.socket() as sock:
            sock.bind((self.addr, 0))
            self.port = sock.getsockname()[1]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LoopbackHost":
        import pwd

        self.state.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.client_key = self.state / "client_ed25519"
        host_key = self.state / "ssh_host_ed25519_key"
        for key in (self.client_key, host_key):
            _run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
        shutil.copyfile(f"{self.client_key}.pub", self.state / "authorized_keys")
        config = self.state / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {self.addr}:{self.port}", f"HostKey {host_key}",
            f"AuthorizedKeysFile {self.state / 'authorized_keys'}", f"PidFile {self.state / 'sshd.pid'}",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
            "UsePAM no", "StrictModes no", "SetEnv SHLVL=1",
            *([f"Subsystem sftp {SFTP_SERVER}"] if self.sftp else []), "LogLevel ERROR", ""]))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_default_signals)
        pub = Path(f"{host_key}.pub").read_text().split()
        self.known_hosts = self.state / "known_hosts"
        self.known_hosts.write_text(f"[{self.addr}]:{self.port} {pub[0]} {pub[1]}\n")
        import socket

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.addr, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError("the loopback sshd did not start")

    def node(self, **extra) -> dict:
        return {"name": self.name, "host": self.addr, "port": self.port, "user": self.user,
                "key": str(self.client_key), **extra}

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)   # the listener and its sessions
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None
        shutil.rmtree(self.state, ignore_errors=True)


def module_cluster(hosts: int, prefix: str, first_subnet: int, rate: str | None = None, name: str = "cluster"):
    """A module-scoped pytest fixture named `name`: `hosts` SSH hosts built for the
    module's tests (`rate`: every link shaped, e.g. "100mbit"), torn down after them
    even when they fail; skipped with the reason where namespaces cannot be built.
    Each module gives its own prefix and subnet, so two modules never share names."""
    import pytest

    @pytest.fixture(scope="module", name=name)
    def cluster():
        reason = can_build()
        if reason:
            pytest.skip(f"multi-host tests skipped: {reason}")
        built = build_cluster(hosts=hosts, prefix=prefix, first_subnet=first_subnet)
        try:
            if rate:
                built.rate_limit(rate)
            yield built
        finally:
            built.close()

    return cluster


def module_nodes(cpu: int = 100, runtime: str | None = None, cluster: str = "cluster", name: str = "nodes"):
    """A pytest fixture named `name`: a nodes file for the module's SSH hosts (the
    fixture `cluster`), each node `cpu` units for paicli, the runtimes the shared
    cache (`runtime` provisioned first), set as PAI_NODES. After each test, every
    job of its PAI_HOME that has not ended is killed (a test that failed half-way
    may have left one: its master runs on this machine), then nothing may be left
    on any host."""
    import pytest

    @pytest.fixture(name=name)
    def nodes(request, tmp_path, monkeypatch, pai_home):
        from conftest import wait_until
        from paicli.runners.runtimes import get_runtime, runtime_root

        built = request.getfixturevalue(cluster)
        if runtime:
            get_runtime(runtime).ensure(lambda line: None)
        path = built.write_nodes_file(tmp_path / "nodes.yaml", cpu=cpu, runtime_dir=str(runtime_root()))
        monkeypatch.setenv("PAI_NODES", str(path))
        yield path
        kill_unfinished_jobs()
        assert wait_until(lambda: not built.all_leftovers(), timeout=15), \
            f"processes left on the hosts: {built.all_leftovers()}"

    return nodes


def kill_unfinished_jobs() -> list[str]:
    """`pai kill` every job of this PAI_HOME that has not ended; their IDs."""
    import json

    from conftest import pai

    listed = pai("list", "--json", "-n", "200")
    jobs = json.loads(listed.stdout) if listed.returncode == 0 else []
    unfinished = [j["id"] for j in jobs if j["status"] not in ("Succeeded", "Failed", "Cancelled")]
    for job_id in unfinished:
        pai("kill", job_id, timeout=60)
    return unfinished


def bench_cluster(folder: Path, prefix: str, first_subnet: int, host_of: dict[str, int], cpu: int):
    """For the benches that compare pai with a launch by hand on the tests' SSH
    cluster (three namespaced hosts): a context manager yielding the by-hand places
    (instance name -> (address, argv wrapper that runs in the host's namespace), per
    `host_of`: name -> host index) and pai's environment (PAI_NODES: every host,
    `cpu` units). Exits with the reason where namespaces cannot be built; the
    cluster is torn down at the end, whatever happened."""
    import contextlib
    import sys

    from paicli.runners.runtimes import runtime_root

    @contextlib.contextmanager
    def built():
        reason = can_build()
        if reason:
            sys.exit(f"--ssh: {reason}")
        cluster = build_cluster(hosts=3, prefix=prefix, first_subnet=first_subnet)
        try:
            places = {name: (cluster.hosts[i].addr, cluster.hosts[i].exec_argv) for name, i in host_of.items()}
            nodes = cluster.write_nodes_file(folder / "nodes.yaml", cpu=cpu, runtime_dir=str(runtime_root()))
            yield places, {"PAI_NODES": str(nodes)}
        finally:
            cluster.close()

    return built()

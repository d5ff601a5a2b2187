"""The nodes file (cluster/nodes.py) and the pure parts of the SSH backend: which
file is in effect, what a good one gives, one clear line for a bad one (fuzzed),
and path translation from the submitting machine to a node."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paicli.cluster.nodes import NODE_KEYS, load_nodes, load_nodes_file, nodes_file_path, parse_nodes
from paicli.errors import PaiError, UsageError

from conftest import pai


def test_which_file_is_in_effect(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    assert nodes_file_path({"PAI_HOME": str(home)}) is None
    assert load_nodes({"PAI_HOME": str(home)}) is None  # this machine alone
    (home / "nodes.yaml").write_text("nodes: [{name: h1, host: 10.0.0.1}]")
    assert nodes_file_path({"PAI_HOME": str(home)}) == home / "nodes.yaml"
    other = tmp_path / "other.yaml"
    other.write_text("nodes: [{name: x, host: 10.0.0.9}]")
    config = load_nodes({"PAI_HOME": str(home), "PAI_NODES": str(other)})
    assert [n.name for n in config.nodes] == ["x"]


def test_a_good_file(tmp_path):
    path = tmp_path / "nodes.yaml"
    path.write_text("""
known_hosts: kh
nodes:
  - name: h1
    host: 10.0.0.11
    port: 2222
    user: alice
    key: keys/id_ed25519
    cpu: 800
    memory: 16000
    gpu: 2
    runtime_dir: /opt/rt/
  - {name: h2, host: node2.example}
""")
    config = load_nodes_file(path)
    h1, h2 = config.nodes
    assert config.known_hosts == str(tmp_path / "kh")
    assert (h1.port, h1.user, h1.key, h1.cpu, h1.memory, h1.gpu) == \
        (2222, "alice", str(tmp_path / "keys/id_ed25519"), 800, 16000, 2)
    assert h1.runtime_dir == "/opt/rt"
    assert h1.job_root == "/tmp/paicli-alice"
    assert (h2.port, h2.cpu, h2.memory, h2.gpu, h2.key, h2.python) == (22, None, None, None, None, "python3")
    assert config.node("h2") is h2
    with pytest.raises(UsageError, match="no node named 'h3'"):
        config.node("h3")


@pytest.mark.parametrize("text, message", [
    ("nodes: [{name: h1, host: 10.0.0.1, prot: 22}]", "node 'h1': key 'prot': unknown key; did you mean 'port'?"),
    ("nodes: [{name: h1, host: 10.0.0.1, port: http}]", "node 'h1': key 'port': expected a port 1-65535, got 'http'"),
    ("nodes: [{name: h1, host: 10.0.0.1, port: 70000}]", "node 'h1': key 'port': expected a port 1-65535"),
    ("nodes: [{name: h1, host: 10.0.0.1, cpu: -1}]", "node 'h1': key 'cpu': expected PAI cpu units"),
    ("nodes: [{name: h1, host: 10.0.0.1, gpu: yes}]", "node 'h1': key 'gpu': expected a number of GPU cards"),
    ("nodes: [{name: h1}]", "node 'h1': key 'host': missing"),
    ("nodes: [{host: 10.0.0.1}]", "node 1: key 'name': missing"),
    ("nodes: [{name: h1, host: 'a b; rm -rf /'}]", "node 'h1': key 'host': expected a host name or an IP"),
    ("nodes: [{name: h1, host: -oProxyCommand=x}]", "node 'h1': key 'host'"),
    ("nodes: [{name: h1, host: a}, {name: h1, host: b}]", "node 'h1': key 'name': used by an earlier node"),
    ("nodes: [{name: h1, host: a, runtime_dir: rel/dir}]", "node 'h1': key 'runtime_dir': expected an absolute"),
    ("nodes: []", "key 'nodes': expected a non-empty list"),
    ("nodez: []", "key 'nodez': unknown key; did you mean 'nodes'?"),
    ("- just a list", "expected a mapping with a 'nodes' list"),
    ("nodes: [{name: h1, host: a}", "line 1"),
    # a store's password stays out of the line
    ("store: mysql://u:secret@db/pai\nnodes: [{name: h1, host: a}]", "key 'store': expected a PostgreSQL URL, got 'db/pai'"),
])
def test_a_bad_file_is_one_line_naming_file_node_and_key(tmp_path, text, message):
    path = tmp_path / "nodes.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as caught:
        load_nodes_file(path)
    line = str(caught.value)
    assert line.startswith(f"nodes file {path}")
    assert message in line
    assert "\n" not in line


def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path, pai_home):
    path = tmp_path / "nodes.yaml"
    path.write_text("nodes: [{name: h1, host: 10.0.0.1, memory: lots}]")
    result = pai("nodes", env={"PAI_NODES": str(path)})
    assert result.returncode == 2
    assert result.stderr.strip() == (f"pai: error: nodes file {path}: node 'h1': key 'memory': "
                                     "expected memory in MB, a positive integer, got 'lots'")
    assert "Traceback" not in result.stderr


scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 100000), st.text(max_size=12),
                    st.floats(allow_nan=True), st.just("/abs/path"), st.just("10.0.0.1"))
node_maps = st.dictionaries(st.sampled_from([*NODE_KEYS, "prot", "", "gpus"]) | st.text(max_size=5),
                            scalars | st.lists(scalars, max_size=2), max_size=6)
documents = st.one_of(
    st.fixed_dictionaries({"nodes": st.lists(node_maps, max_size=3)},
                          optional={"known_hosts": scalars, "ray": scalars | node_maps, "x": scalars}),
    scalars, st.lists(node_maps, max_size=2))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_fuzz_documents_never_traceback(doc):
    try:
        config = parse_nodes(json.dumps(doc), "fuzz.yaml")
    except UsageError as err:
        assert str(err).startswith("nodes file fuzz.yaml") and "\n" not in str(err)
    else:
        names = [n.name for n in config.nodes]
        assert len(names) == len(set(names))
        for node in config.nodes:
            assert 1 <= node.port <= 65535 and not node.host.startswith("-")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_fuzz_text_never_tracebacks(text):
    try:
        parse_nodes(text, "fuzz.yaml")
    except UsageError as err:
        assert "\n" not in str(err)


def test_snapshot_round_trip(tmp_path):
    from paicli.cluster.nodes import config_from_dict

    config = parse_nodes(yaml.safe_dump({"nodes": [{"name": "a", "host": "h", "cpu": 200}]}), str(tmp_path / "n.yaml"))
    again = config_from_dict(json.loads(json.dumps(config.to_dict())))
    assert again.nodes == config.nodes and again.known_hosts == config.known_hosts


def test_path_translation_for_a_node():
    from paicli.cluster.remote_paths import job_folder, normalise, translate, translate_argv, translate_env

    mapping = normalise([
        ("/root/.cache/paicli/runtimes", "/opt/rt"),
        ("/work/main/runners/", "/tmp/paicli-root/J1/runners"),
        ("/home/me/.pai/jobs/J1", "/tmp/paicli-root/J1"),
        ("/home/me/.pai/jobs/J1/code", "/tmp/paicli-root/J1/code"),
        ("/home/me", "/tmp/paicli-root/J1/code"),          # the cwd of an in-place script
        ("/", "/nowhere"),                                   # never a blanket rewrite
        ("/usr/bin/python3.11", "/usr/bin/python3"),
    ])
    argv = ["/root/.cache/paicli/runtimes/tensorflow/bin/python", "-u", "/work/main/runners/tensorflow_runner.py",
            "/home/me/train.py", "--data=/home/me/data", "-solver=/home/me/.pai/jobs/J1/code/s.prototxt",
            "relative/x.py", "/home/meat/other", "/usr/bin/python3.11", "a=b=/home/me/x", "--lr=0.1"]
    assert translate_argv(argv, mapping) == [
        "/opt/rt/tensorflow/bin/python", "-u", "/tmp/paicli-root/J1/runners/tensorflow_runner.py",
        "/tmp/paicli-root/J1/code/train.py", "--data=/tmp/paicli-root/J1/code/data",
        "-solver=/tmp/paicli-root/J1/code/s.prototxt", "relative/x.py", "/home/meat/other", "/usr/bin/python3",
        "a=b=/home/me/x", "--lr=0.1"]
    assert translate("/home/me", mapping) == "/tmp/paicli-root/J1/code"
    assert translate("/etc/passwd", mapping) == "/etc/passwd"
    env = translate_env({"PAI_JOB_DIR": "/home/me/.pai/jobs/J1", "PYTHONPATH": "/work/main/runners:/x",
                         "PAI_CLUSTER": '{"ps": ["10.0.0.1:5000"]}'}, mapping)
    assert env == {"PAI_JOB_DIR": "/tmp/paicli-root/J1", "PYTHONPATH": "/tmp/paicli-root/J1/runners:/x",
                   "PAI_CLUSTER": '{"ps": ["10.0.0.1:5000"]}'}
    assert job_folder("/tmp/paicli-root/", "20261122abc") == "/tmp/paicli-root/20261122abc"
    for bad in ("", "../x", "a/b", "x y"):
        with pytest.raises(ValueError):
            job_folder("/tmp/r", bad)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="/ab.=-", max_size=12), max_size=4), st.text(alphabet="/ab.=-", max_size=16))
def test_fuzz_translation_only_rewrites_mapped_prefixes(prefixes, value):
    from paicli.cluster.remote_paths import normalise, translate

    mapping = normalise([(p, "/N") for p in prefixes])
    out = translate(value, mapping)
    if out != value:
        path = value if value.startswith("/") else value.partition("=")[2]
        assert any(path == p or path.startswith(p + "/") for p, _ in mapping)
        assert out.endswith(path[len(max((p for p, _ in mapping if path == p or path.startswith(p + "/")), key=len)):])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=20).filter(lambda t: "\0" not in t), min_size=1, max_size=5))
def test_argv_crosses_ssh_quoted_whatever_it_holds(argv):
    import shlex

    from paicli.cluster.ssh_transport import quote_argv

    assert shlex.split(quote_argv(argv)) == argv   # what the node's shell parses is exactly the argv


def test_resources_one_liner_parsing():
    from paicli.cluster.backends.ssh import parse_resources

    assert parse_resources("8\nMemTotal:       16384000 kB\n0\n1\n") == {"cores": 8, "memory": 16000, "gpus": ["0", "1"]}
    assert parse_resources("2\nMemTotal: 2048 kB\n") == {"cores": 2, "memory": 2, "gpus": []}
    with pytest.raises(PaiError, match="declare cpu, memory and gpu"):
        parse_resources("sh: nproc: not found\n")


def test_trusting_a_node_replaces_its_entries_plain_or_hashed(tmp_path):
    import base64

    import paramiko

    from paicli.cluster.nodes import NodeEntry
    from paicli.cluster.ssh_transport import known_key, record_host_key

    old = "AAAAC3NzaC1lZDI1NTE5AAAAIFGg2MshnJ/0kCGuXdLyo0wQJr1/JQWHwffcbqpH7B54"
    new = "AAAAC3NzaC1lZDI1NTE5AAAAIIzwOx4hNJ1AH3/cqEWzTllRXKGCzATMItGDRTo39hwX"
    known = tmp_path / "known_hosts"
    known.write_text(f"{paramiko.HostKeys.hash_host('10.0.0.5')} ssh-ed25519 {old}\n"
                     f"10.0.0.5 ssh-ed25519 {old}\n[10.0.0.5]:2222 ssh-ed25519 {old}\n10.0.0.9 ssh-ed25519 {old}\n")
    key = paramiko.PKey.from_type_string("ssh-ed25519", base64.b64decode(new))
    node = NodeEntry(name="x", host="10.0.0.5")
    record_host_key(node, str(known), key)
    assert known.read_text().splitlines() == [f"[10.0.0.5]:2222 ssh-ed25519 {old}", f"10.0.0.9 ssh-ed25519 {old}",
                                              f"10.0.0.5 ssh-ed25519 {new}"]
    assert known_key(node, str(known)).get_base64() == new
    assert oct(known.stat().st_mode & 0o777) == "0o600"

"""Framework fidelity, MXNet and Caffe side (issue 20): the frameworks' own published
examples (../shared/peer) run unmodified, their own flags and log lines understood,
and a "distributed" job that never talked to its servers said to be so.

Fast tier: the runner's flag detection on the peer scripts and on small scripts of
our own, the parser tables on captured lines, the "not distributed" verdict. The
real jobs of the peer examples are in tests/test_fidelity_mx_jobs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paicli.runners import mxnet_runner

REPO = Path(__file__).resolve().parent.parent
PEER_MX = REPO.parent / "shared" / "peer" / "mxnet" / "image-classification"
needs_peer = pytest.mark.skipif(not PEER_MX.is_dir(), reason="the peer examples are not on this machine")


# ---------------------------------------------------------------------------
# -Dkvstore reaches a script through its own --kv-store / --kvstore flag


@needs_peer
@pytest.mark.parametrize("script", ["train_imagenet.py", "train_mnist.py"])
def test_the_kv_store_flag_is_found_in_the_module_the_peer_script_imports(script):
    # train_*.py define no --kv-store themselves: common/fit.py does, imported as
    # `from common import find_mxnet, data, fit`.
    path = PEER_MX / script
    assert "--kv-store" not in path.read_text()
    assert mxnet_runner.defined_flags(str(path), mxnet_runner.KVSTORE_FLAGS) == ["kv-store"]
    args, said = mxnet_runner.kvstore_flag_args(str(path), ["--network", "lenet"], "dist_async")
    assert args == ["--network", "lenet", "--kv-store=dist_async"] and "-Dkvstore" in said


@needs_peer
@pytest.mark.parametrize("given", [["--kv-store", "local"], ["--kv-store=local"]])
def test_the_users_own_kv_store_flag_wins(given):
    args, said = mxnet_runner.kvstore_flag_args(str(PEER_MX / "train_mnist.py"), given, "dist_sync")
    assert args == given and "was given" in said


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("layout, flag", [
    # Gluon examples: --kvstore in the script itself
    ({"train.py": "import argparse\np = argparse.ArgumentParser()\n"
                  "p.add_argument('--kvstore', type=str, default='device')\n"}, "kvstore"),
    # a short option first, a relative import inside a package two levels down
    ({"train.py": "from pkg.sub import opts\n", "pkg/__init__.py": "", "pkg/sub/__init__.py": "",
      "pkg/sub/opts.py": "from . import flags\n",
      "pkg/sub/flags.py": "parser.add_argument('-k', '--kv-store', default='device')\n"}, "kv-store"),
    # absl-style, in a module imported as `import util.flags`
    ({"train.py": "import util.flags as f\n", "util/__init__.py": "",
      "util/flags.py": "flags.DEFINE_string('kv_store', 'device', 'kvstore type')\n"}, "kv_store"),
])
def test_kvstore_flags_are_found_across_the_scripts_own_imports(tmp_path, layout, flag):
    for name, text in layout.items():
        write(tmp_path / name, text)
    assert mxnet_runner.defined_flags(str(tmp_path / "train.py"), mxnet_runner.KVSTORE_FLAGS) == [flag]
    args, _ = mxnet_runner.kvstore_flag_args(str(tmp_path / "train.py"), [], "dist_sync")
    assert args == [f"--{flag}=dist_sync"]


def test_a_script_without_a_kvstore_flag_gets_no_flag(tmp_path):
    # A module of the same name outside the script's folder is not followed, nor is a
    # flag that only resembles one (--kv-store-type), nor a syntax error fatal.
    write(tmp_path / "other" / "fit.py", "parser.add_argument('--kv-store')\n")
    write(tmp_path / "job" / "train.py", "import fit\nimport broken\np.add_argument('--kv-store-type')\n")
    write(tmp_path / "job" / "broken.py", "def (:\n")
    script = str(tmp_path / "job" / "train.py")
    assert mxnet_runner.defined_flags(script, mxnet_runner.KVSTORE_FLAGS) == []
    assert mxnet_runner.kvstore_flag_args(script, ["--lr", "0.1"], "dist_sync") == (["--lr", "0.1"], None)

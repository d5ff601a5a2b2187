"""Reads the folder --buckets names and reports it: `bucket=PATH files=N sha=HEX
readonly=BOOL` (used by tests/test_tables_nodes.py and tests/test_envs_nodes.py)."""

import argparse
import hashlib
import os

parser = argparse.ArgumentParser()
parser.add_argument("--buckets", default="")
args, _ = parser.parse_known_args()
path = args.buckets[len("file://"):] if args.buckets.startswith("file://") else args.buckets
digest, count = hashlib.sha256(), 0
writable = []   # by mode: root could write anyway
for top, dirs, files in os.walk(path):
    dirs.sort()
    writable += [top] if os.stat(top).st_mode & 0o222 else []
    for name in sorted(files):
        full = os.path.join(top, name)
        writable += [full] if os.stat(full).st_mode & 0o222 else []
        digest.update(os.path.relpath(full, path).encode() + b"\0")
        with open(full, "rb") as f:
            digest.update(f.read())
        count += 1
readonly = not writable
print(f"bucket={path} files={count} sha={digest.hexdigest()} readonly={readonly} "
      f"role={os.environ.get('PAI_ROLE')}", flush=True)

"""A worker that reads its slice of --tables through paitables and reports it:
`slice=I rows=N checksum=HEX lo=FIRST_ID hi=LAST_ID`; with --outputs it writes
(id, twice the id) for each of its rows. Used by tests/test_tables*.py."""

import argparse
import hashlib
import json
import os

import paitables

parser = argparse.ArgumentParser()
parser.add_argument("--tables", default="")
parser.add_argument("--outputs", default="")
parser.add_argument("--fail", action="store_true")
parser.add_argument("--unfetchable", action="store_true", help="slice 1 leaves a part its node cannot send")
parser.add_argument("--hold", type=float, default=0.0, help="slice 1's first attempt waits this long")
args, _ = parser.parse_known_args()

if not args.tables:     # a job without tables: paitables imports all the same
    print(f"imported={os.path.relpath(paitables.__file__, os.environ['PAI_JOB_DIR'])} "
          f"role={os.environ.get('PAI_ROLE')}", flush=True)
    raise SystemExit(0)
table = paitables.open_table(args.tables.split(",")[0])
digest, ids = hashlib.sha256(), []
for batch in table.read(100):
    for row in batch:
        digest.update(json.dumps([str(v) for v in row]).encode())
        ids.append(int(row[0]))
print(f"slice={table.slice_id} of={table.slice_count} rows={table.row_count} seen={len(ids)} "
      f"checksum={digest.hexdigest()} lo={min(ids)} hi={max(ids)} cols={','.join(table.columns)} "
      f"role={os.environ.get('PAI_ROLE')}", flush=True)
if args.hold and table.slice_id == 1 and os.environ.get("PAI_ATTEMPT") == "0":
    import time

    time.sleep(args.hold)
if args.outputs:
    with paitables.open_writer(args.outputs, ["id", "double"]) as out:
        for i in ids:
            out.write([i, 2 * i])
if args.unfetchable and table.slice_id == 1:   # a folder where a part file should be: unreadable
    os.mkdir(os.path.join(paitables.load_index()["outputs"][0]["parts"], "part-worker-99999.jsonl"))
if args.fail and table.slice_id == 1:
    raise SystemExit(3)

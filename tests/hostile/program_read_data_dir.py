import gzip

with gzip.open("$DATA_DIR/humaneval/HumanEval.jsonl.gz", "rt") as fh:
    print(fh.readline()[:80])

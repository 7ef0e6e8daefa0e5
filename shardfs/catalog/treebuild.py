"""Child-process entry point: merge shard index files into a tree file.

Run by the daemon as `python -m shardfs.catalog.treebuild LIST_FILE OUT_TREE`; prints a JSON report.
A separate process keeps the build's transient memory (every path as an object, a sort over
all of them) out of the long-running daemon.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shardfs.catalog.shardindex import decode_index
from shardfs.catalog.tree import build_tree


def main(argv: list[str]) -> int:
    list_file, out = argv
    paths = [Path(p) for p in Path(list_file).read_text().splitlines() if p]
    indexes = [decode_index(p.read_bytes()) for p in paths]
    skipped: dict[str, int] = {}
    for index in indexes:
        for reason, count in index.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    tree = build_tree(indexes)
    tree.save(Path(out))
    r = tree.report
    print(json.dumps({"entries": len(tree), "files": tree.count_files(), "members": r.members,
                      "shadowed": r.shadowed, "conflicts": r.conflicts,
                      "dangling_links": r.dangling_links, "skipped": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m bench run [--quick] [...]`, `python -m bench node [...]`,
`python -m bench httpcpu [...]`, `python -m bench bodycost [...]`,
`python -m bench cpusplit [...]`, `python -m bench s3 [...]` and
`python -m bench report RECORD.json --docs PAGE`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["run", *argv]  # `python -m bench --quick` means `run --quick`
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description="shardfs benchmarks against the alternatives")
    sub = parser.add_subparsers(dest="command", required=True)
    from bench.run import add_run_arguments, run_command

    run = sub.add_parser("run", help="run the benchmark and write a JSON record (and docs)")
    add_run_arguments(run)
    report = sub.add_parser("report", help="regenerate the docs page from a JSON record")
    report.add_argument("record")
    report.add_argument("--docs", default="docs/benchmarks.md")
    report.add_argument("--png", default=None)
    from bench.node import add_arguments as add_node_arguments
    from bench.node import node_command

    node = sub.add_parser("node", help="many reader processes against one mount vs ext4")
    add_node_arguments(node)
    from bench.httpcpu import add_arguments as add_httpcpu_arguments
    from bench.httpcpu import httpcpu_command

    httpcpu = sub.add_parser("httpcpu", help="CPU per GB received by the HTTP source")
    add_httpcpu_arguments(httpcpu)
    from bench.bodycost import add_arguments as add_bodycost_arguments
    from bench.bodycost import bodycost_command

    bodycost = sub.add_parser("bodycost", help="CPU of a download's bytes: spliced into the "
                              "page cache, or received into memory (and written O_DIRECT)")
    add_bodycost_arguments(bodycost)
    from bench.cpusplit import add_arguments as add_cpusplit_arguments
    from bench.cpusplit import cpusplit_command

    cpusplit = sub.add_parser("cpusplit", help="a cold file's CPU per process, thread and kind")
    add_cpusplit_arguments(cpusplit)
    from bench.s3bench import add_arguments as add_s3_arguments
    from bench.s3bench import s3_command

    s3 = sub.add_parser("s3", help="shardfs and litdata, Streaming, webdataset, Ray Data "
                        "from one S3 bucket")
    add_s3_arguments(s3)
    s3report = sub.add_parser("s3-report", help="the s3 section from one or more records")
    s3report.add_argument("records", nargs="+")
    s3report.add_argument("--docs", default="docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.command == "cpusplit":
        return cpusplit_command(args, argv[1:])
    if args.command == "s3-report":
        from bench.s3report import report_command as s3_report_command

        return s3_report_command(args)
    if args.command == "s3":
        if args.argv is None:
            args.argv = "python -m bench " + " ".join(argv)
        return s3_command(args)
    if args.command == "node":
        return node_command(args, argv[1:])
    if args.command == "httpcpu":
        return httpcpu_command(args)
    if args.command == "bodycost":
        return bodycost_command(args)
    if args.command == "run":
        if args.argv is None:
            args.argv = "python -m bench " + " ".join(argv)
        return run_command(args)
    from bench.report import report_command

    return report_command(args)


if __name__ == "__main__":
    sys.exit(main())

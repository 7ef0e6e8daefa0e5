"""`shardfs csi-mounter`'s command line (kept apart from the server: parsing needs no grpcio)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, metavar="unix:///PATH/mounter.sock",
                   help="the socket the node plugin connects to")
    p.add_argument("--state-dir", required=True, metavar="DIR",
                   help="what a restarted mounter needs (volume records with their "
                   "secrets, mode 0600); a host directory")
    p.add_argument("--cache-root", required=True, metavar="DIR",
                   help="one cache dir per volume under it; a host directory")
    p.add_argument("--cache-size", metavar="SIZE",
                   help="budget of the cache root, e.g. 200G: each volume's default "
                   "cache_size, and the bound for kept caches of released volumes "
                   "(default: 80%% of the free space there, at most 50 GiB)")
    p.add_argument("--no-spares", action="store_true",
                   help="do not keep a spare daemon per volume standing by (saves its memory; "
                   "a daemon's death then costs a full start instead of a takeover)")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"),
                   help="how much goes to stderr (default: info); secrets are never logged")

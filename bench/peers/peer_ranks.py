# What the rank-per-process peers share: fork TP rank processes at once, as an
# engine's ranks would, run `rank_main(rank)` in each, and exit 1 when any failed.
import os
import sys


def run_ranks(tp, rank_main):
    pids = []
    for rank in range(tp):
        pid = os.fork()
        if pid == 0:
            rank_main(rank)
            os._exit(0)
        pids.append(pid)
    status = 0
    for pid in pids:
        _, s = os.waitpid(pid, 0)
        status |= s
    sys.exit(1 if status else 0)

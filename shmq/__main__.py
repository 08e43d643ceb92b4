"""``python -m shmq [list|clean] [--dry-run]``: show or remove shmq segments
in /dev/shm whose creating process is gone (left by a crash or a kill)."""

import argparse
import sys

from shmq import segment


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmq", description=__doc__)
    parser.add_argument("command", choices=["list", "clean"], nargs="?", default="list")
    parser.add_argument("--dry-run", action="store_true", help="clean: only say what would go")
    args = parser.parse_args(argv)
    if args.command == "list":
        segments = segment.list_segments()
        for s in segments:
            owner = "live" if s.alive else "stale"
            print(f"{s.name}\t{s.size_bytes}\tcreator pid {s.creator_pid}\t{owner}")
        print(f"{len(segments)} segment(s), {sum(not s.alive for s in segments)} stale")
        return 0
    removed = segment.remove_stale(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for s in removed:
        print(f"{verb} {s.name} ({s.size_bytes} bytes, creator pid {s.creator_pid} is gone)")
    print(f"{verb} {len(removed)} stale segment(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

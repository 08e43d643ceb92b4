"""``python -m shmq [list|clean] [--dry-run] [--force]``: show or remove shmq
segments in /dev/shm whose creating process is gone (left by a crash or a
kill).  A segment made in another pid namespace (another container sharing
/dev/shm) cannot be checked from here: `list` shows it as unknown, and
`clean` removes it only with --force."""

import argparse
import sys

from shmq import segment


def _namespace(s: segment.SegmentInfo) -> str:
    return f"pidns {s.pidns}" if s.pidns else "pidns unrecorded"


def _list() -> int:
    segments = segment.list_segments()
    for s in segments:
        print(f"{s.name}\t{s.size_bytes}\tcreator pid {s.creator_pid}\t{_namespace(s)}\t{s.state}")
    unknown = sum(s.state not in (segment.LIVE, segment.STALE) for s in segments)
    print(f"{len(segments)} segment(s), {sum(s.state == segment.STALE for s in segments)} stale, "
          f"{unknown} unknown (this is pidns {segment.own_pidns() or 'unknown'})")
    return 0


def _clean(dry_run: bool, force: bool) -> int:
    removed = segment.remove_stale(dry_run=dry_run, force=force)
    verb = "would remove" if dry_run else "removed"
    for s in removed:
        why = "is gone" if s.state == segment.STALE else f"is {s.state}, --force"
        print(f"{verb} {s.name} ({s.size_bytes} bytes, creator pid {s.creator_pid} {why})")
    print(f"{verb} {len(removed)} stale segment(s)")
    if not force:
        kept = [s for s in segment.list_segments()
                if s.state not in (segment.LIVE, segment.STALE)]
        for s in kept:
            print(f"kept {s.name} ({s.size_bytes} bytes, creator pid {s.creator_pid}, "
                  f"{_namespace(s)}): {s.state}")
        if kept:
            print(f"kept {len(kept)} segment(s) whose creator cannot be checked from this pid "
                  f"namespace; run clean where they were made, or pass --force if you know "
                  f"they are dead")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmq", description=__doc__)
    parser.add_argument("command", choices=["list", "clean"], nargs="?", default="list")
    parser.add_argument("--dry-run", action="store_true", help="clean: only say what would go")
    parser.add_argument("--force", action="store_true",
                        help="clean: also remove segments whose creator cannot be checked "
                             "(another pid namespace, or none recorded)")
    args = parser.parse_args(argv)
    if args.command == "list":
        return _list()
    return _clean(args.dry_run, args.force)


if __name__ == "__main__":
    sys.exit(main())

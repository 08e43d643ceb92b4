"""``python -m shmq [list|clean] [--dry-run] [--force]``: show or remove shmq
segments in /dev/shm whose creating process is gone (left by a crash or a
kill).  A segment made in another pid namespace (another container sharing
/dev/shm) cannot be checked from here: `list` shows it as unknown, and
`clean` removes it only with --force.  `clean` removes every stale segment
it may remove, and skips (and names) another user's that it may not: only
that user or root can.  Exit status: 0 when it ran to the end, skipped
segments included; 2 for a usage error."""

import argparse
import sys

from shmq import segment


def _namespace(s: segment.SegmentInfo) -> str:
    return f"pidns {s.pidns}" if s.pidns else "pidns unrecorded"


def _owner(s: segment.SegmentInfo) -> str:
    return f"owner {segment.user_name(s.owner_uid)}"


def _list() -> int:
    segments = segment.list_segments()
    for s in segments:
        print(f"{s.name}\t{s.size_bytes}\t{_owner(s)}\tcreator pid {s.creator_pid}\t"
              f"{_namespace(s)}\t{s.state}")
    unknown = sum(s.state not in (segment.LIVE, segment.STALE) for s in segments)
    print(f"{len(segments)} segment(s), {sum(s.state == segment.STALE for s in segments)} stale, "
          f"{unknown} unknown (this is pidns {segment.own_pidns() or 'unknown'})")
    return 0


def _clean(dry_run: bool, force: bool) -> int:
    removed, not_permitted = segment.remove_stale(dry_run=dry_run, force=force)
    verb = "would remove" if dry_run else "removed"
    for s in removed:
        why = "is gone" if s.state == segment.STALE else f"is {s.state}, --force"
        print(f"{verb} {s.name} ({s.size_bytes} bytes, creator pid {s.creator_pid} {why})")
    print(f"{verb} {len(removed)} stale segment(s)")
    for s in not_permitted:
        print(f"skipped {s.name} ({s.size_bytes} bytes, creator pid {s.creator_pid}, "
              f"{_owner(s)}): not permitted to remove it")
    if not_permitted:
        print(f"skipped {len(not_permitted)} stale segment(s) of other users: only their owners "
              f"(or root) may remove them, with `python -m shmq clean`")
    if not force:
        _report_kept()
    return 0


def _report_kept() -> None:
    kept = [s for s in segment.list_segments() if s.state not in (segment.LIVE, segment.STALE)]
    for s in kept:
        print(f"kept {s.name} ({s.size_bytes} bytes, creator pid {s.creator_pid}, "
              f"{_namespace(s)}): {s.state}")
    if kept:
        print(f"kept {len(kept)} segment(s) whose creator cannot be checked from this pid "
              f"namespace; run clean where they were made, or pass --force if you know "
              f"they are dead")


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

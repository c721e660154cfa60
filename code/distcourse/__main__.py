"""``python -m distcourse doctor``: what this machine gives the course (see runtime/doctor.py)."""

import sys

COMMANDS = {"doctor": "what this machine gives the course: torch, devices, launches, /dev/shm, fonts"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m distcourse <command> [options]\n\ncommands:")
        for name, what in COMMANDS.items():
            print(f"  {name:<8} {what}")
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    from .runtime import doctor

    return doctor.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

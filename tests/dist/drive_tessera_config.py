"""Answers `tessera config`'s questionnaire through a pseudo-terminal, as a person would.

usage: drive_tessera_config.py TESSERA CONFIG_FILE ANSWER...

Each answer is typed after the next prompt (a line ending in ': '); the screen is printed.
"""
import os
import pty
import select
import sys

tessera, config_file, answers = sys.argv[1], sys.argv[2], sys.argv[3:]
pid, fd = pty.fork()
if pid == 0:
    os.execv(tessera, [tessera, "config", "--config_file", config_file])
screen = b""
pending = list(answers)
while True:
    ready, _, _ = select.select([fd], [], [], 30)
    if not ready:
        break
    try:
        chunk = os.read(fd, 4096)
    except OSError:
        break
    if not chunk:
        break
    screen += chunk
    if pending and screen.rstrip(b" ").endswith(b":"):
        os.write(fd, pending.pop(0).encode() + b"\r")
        screen += b"\n"
_, status = os.waitpid(pid, 0)
sys.stdout.write(screen.decode(errors="replace"))
sys.exit(os.waitstatus_to_exitcode(status))

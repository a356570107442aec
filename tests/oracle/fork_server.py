"""Runs the oracle scripts of tests/oracle/ for a whole test run in ONE oracle-venv process (tests/conftest.py
`run_oracle`): it imports the official implementation once (torch, transformers, qwen_tts: seconds of CPU per
process), then forks a child per request, so each script starts from that same state as a fresh process would (its
own thread count, RNG, transformers registrations) and ends with the child.

Protocol, one JSON object a line: the request on stdin {"script", "args", "env", "timeout", "log"}; the answer on
stdout {"rc": exit status (124: timed out)}. The child's stdout and stderr go to the file `log`."""
import json
import os
import runpy
import signal
import sys
import time

_ANSWERS = os.fdopen(os.dup(1), "w")   # the answers; anything else printed here (imports, scripts) goes to stderr
os.dup2(2, 1)

import tests.oracle.official  # noqa: E402,F401  (torch, transformers, qwen_tts: imported once, before any fork)


def child(req: dict) -> None:
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = [req["script"], *req["args"]]
    code = 0
    try:
        runpy.run_path(req["script"], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    out = _ANSWERS
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(req)
        deadline = time.monotonic() + float(req.get("timeout", 900))
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                rc = 124
                break
            time.sleep(0.05)
        out.write(json.dumps({"rc": rc}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()

# The W&B sidecar: lockstep's rank 0 runs this with `python -c` and feeds it JSON lines on
# stdin; it drives the official `wandb` SDK (W&B's wire protocol is internal and changes between
# versions, so lockstep never speaks it itself). Embedded in the binary by src/telemetry/wandb.rs.
#
# In (stdin, one JSON object per line):
#   {"init": {"id", "project", "entity", "name", "group", "tags", "mode", "dir", "config",
#             "local_steps", "offline_fix"}}              first line, once
#   {"log": {"step": N, "values": {"train/loss": 2.3, ...}}}   steps increasing
#   {"finish": "FINISHED" | "FAILED" | "KILLED"}
# Out (the original stdout, one JSON object per line):
#   {"started": {"line": "...", "last_step": N or null}}
#   {"error": "...", "lasting": true|false}
#   {"finished": true}
# Everything wandb itself prints goes to stderr, which lockstep points at <dir>/wandb/sidecar.log.
#
# Steps: the last step handed to wandb for a run id is kept in lockstep-<id>.json beside the run's
# files, and a lock file keeps a restarted trainer's sidecar from starting before the previous
# one has finished, so that a restart continues after the last step W&B has.
# End of input without "finish" (the trainer died): the run is finished as failed, so that what
# was logged reaches W&B.
import fcntl
import json
import os
import re
import sys
import time

reports = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # wandb's own prints go to the log, not into the report pipe
lines = os.fdopen(os.dup(0), "r")
devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(devnull, 0)  # no prompt may ever read lockstep's pipe


def report(**kw):
    try:
        reports.write(json.dumps(kw) + "\n")
        reports.flush()
    except OSError:
        pass


def fail(message, lasting):
    report(error=message, lasting=lasting)
    sys.exit(3)


def first_line():
    line = lines.readline()
    if not line:
        sys.exit(0)
    return json.loads(line)["init"]


init = first_line()
try:
    import wandb
except Exception as e:  # noqa: BLE001 - any import failure means the same to the user
    fail(
        "the Python at %s cannot import wandb (%s); install it there with `%s -m pip install "
        "wandb`, or point logging.wandb.python at a Python that has it" % (sys.executable, e, sys.executable),
        True,
    )

files = os.path.join(init["dir"], "wandb")
os.makedirs(files, exist_ok=True)
state_path = os.path.join(files, "lockstep-%s.json" % init["id"])
lock = open(os.path.join(files, "lockstep-%s.lock" % init["id"]), "w")
deadline = time.time() + 120
while True:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
    except OSError:
        if time.time() > deadline:
            break  # the previous sidecar is stuck; go on rather than never log
        time.sleep(0.2)


def recorded_step():
    try:
        with open(state_path) as f:
            return json.load(f).get("last_step")
    except (OSError, ValueError):
        return None


def keep_step(step):
    tmp = state_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"last_step": step}, f)
    os.replace(tmp, state_path)


try:
    run = wandb.init(
        id=init["id"],
        project=init["project"],
        entity=init.get("entity"),
        name=init.get("name"),
        group=init.get("group"),
        tags=init.get("tags") or None,
        mode=init["mode"],
        dir=init["dir"],
        resume="allow",
        config=init["config"],
        # console off: this process prints nothing of the training's; W&B's system metrics
        # (CPU, GPU through NVML) stay on.
        settings=wandb.Settings(console="off", silent=True),
    )
except Exception as e:  # noqa: BLE001
    text = "%s: %s" % (type(e).__name__, e)
    low = text.lower()
    # A timeout or a refused connection is the network's, whatever else the text holds (run
    # ids, ports and URLs have digits: 401/403 count only as whole words).
    transient = any(w in low for w in ("deadline exceeded", "timed out", "timeout", "connection refused"))
    lasting = not transient and (
        any(w in low for w in ("api key", "api_key", "permission", "not logged in", "login"))
        or re.search(r"\b40[13]\b", low) is not None
    )
    fix = (
        "check WANDB_API_KEY (or `wandb login`) and logging.wandb.entity / project"
        if lasting
        else "check the network, or %s and upload later with `wandb sync`"
        % init.get("offline_fix", "set logging.wandb.mode=offline")
    )
    fail("wandb.init failed (%s); %s" % (text.splitlines()[0] if text else "no detail", fix), lasting)

# `lockstep wandb-sync` trusts only the server: the local record counts steps an offline run
# kept, which the server may never have seen.
last = recorded_step() if init.get("local_steps", True) else None
if run.resumed and run.step > 0:
    last = max(last or 0, run.step - 1)
if run.offline:
    files_dir = os.path.dirname(run.dir)
    where = "offline, in %s; upload with `wandb sync %s`" % (files_dir, files_dir)
else:
    where = run.url
report(started={"line": "run %s (%s)" % (run.id, where), "last_step": last})

status = "FAILED"
while True:
    line = lines.readline()
    if not line:
        break
    msg = json.loads(line)
    if "log" in msg:
        step = msg["log"]["step"]
        if last is not None and step <= last:
            continue
        # NaN and infinities arrive as null (JSON has neither); metrics.jsonl says which.
        values = {k: v for k, v in msg["log"]["values"].items() if v is not None}
        try:
            run.log(values, step=step)
        except Exception as e:  # noqa: BLE001
            report(error="wandb.log failed at step %d: %s" % (step, e), lasting=False)
            continue
        last = step
        keep_step(step)
    elif "finish" in msg:
        status = msg["finish"]
        break

if status == "KILLED":
    try:
        run.mark_preempting()
    except Exception:  # noqa: BLE001 - offline runs have no server to tell
        pass
run.finish(exit_code=0 if status in ("FINISHED", "KILLED") else 1)
report(finished=True)

"""Parsing and comparisons for benches/gpu/accept.sh (python3 standard library, plus torch /
numpy / safetensors where a subcommand says so). Subcommands print either `NAME=value` lines
that the script evals (numbers and bare words only) or a one-line figure.

  build-match BUILD_INFO.json        torch here vs the torch the binaries were built against
  steplines LOG [--skip N]           step and timing lines of a run: medians after N steps
  losses A.jsonl B.jsonl FIRST LAST  per-step losses of two runs over FIRST..=LAST
  syncs LOG [--skip N]               libtorch's sync-debug warnings between step lines
  nan-dump FILE.safetensors          the tensors holding NaN and how many
  json-field FILE KEY...             fields of the last JSON object line of FILE, '|'-separated
  plan-total PLAN.json               the configured layout's planned peak in GB
  peak-mib FILE                      the largest integer in a file of nvidia-smi samples
  mc-task TEXT OUT N                 N four-choice items from TEXT's lines (query: a line's
                                     first words; choices: its true ending and three others)
                                     as a general-form task file (docs/evaluation.md)
  mc-compare A B                     two `eval --log-samples` files: the largest per-choice
                                     log-likelihood difference (absolute, relative) and how
                                     many items pick the same choice
  unpack CARRY DEST                  CARRY/binaries.tar.xz (prepare.sh) into DEST: the two
                                     binaries and the wheel if packed, each checked against
                                     CARRY/<name>.sha256; exit 1 otherwise
"""
import hashlib
import json
import os
import re
import statistics
import sys
import tarfile

STEP = re.compile(r"Step \[(\d+)/\d+\] \| Loss: (\S+) .*?\| Tok/s: (\d+)(?: .*?\| MFU: ([\d.]+)%)?")
TIMING = re.compile(
    r"Timing per step: data ([\d.]+) ms \| forward\+backward ([\d.]+) ms \| (?:grad norm|all-reduce \+ norm) ([\d.]+) ms"
    r" \| optimizer ([\d.]+) ms"
)
SYNC = "called a synchronizing CUDA operation"


def median(xs):
    return statistics.median(xs) if xs else None


def fmt(x, digits=1):
    return "" if x is None else f"{x:.{digits}f}"


def build_match(path):
    import torch

    built = json.load(open(path))
    here = {
        "torch": torch.__version__,
        "git": torch.version.git_version,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None,
        "cudnn": torch.backends.cudnn.version(),
    }
    diff = [f"{k}: built {built.get(k)} / here {v}" for k, v in here.items() if built.get(k) != v]
    figure = f"torch {here['torch']} git {str(here['git'])[:12]} CUDA {here['cuda']} NCCL {here['nccl']} cuDNN {here['cudnn']}"
    print(f"STATUS={'FAIL' if diff else 'PASS'}")
    print(f"FIGURE={json.dumps(figure + ('; MISMATCH ' + '; '.join(diff) if diff else ''))}")


def steplines(path, skip):
    steps, toks, mfus, timings = [], [], [], []
    for line in open(path, errors="replace"):
        m = STEP.search(line)
        if m:
            steps.append(int(m.group(1)))
            if int(m.group(1)) > skip:
                toks.append(float(m.group(3)))
                if m.group(4):
                    mfus.append(float(m.group(4)))
            continue
        t = TIMING.search(line)
        if t and steps and steps[-1] > skip:
            timings.append([float(x) for x in t.groups()])
    phases = list(zip(*timings)) if timings else [[], [], [], []]
    print(f"LAST={steps[-1] if steps else 0}")
    print(f"TIMED={len(toks)}")
    print(f"TOKS={fmt(median(toks), 0)}")
    print(f"MFU={fmt(median(mfus))}")
    for name, xs in zip(["T_DATA", "T_FB", "T_AR", "T_OPT"], phases):
        print(f"{name}={fmt(median(list(xs)))}")


def losses(a, b, first, last):
    def read(p):
        out = {}
        for line in open(p):
            r = json.loads(line)
            out[r["step"]] = r["loss"]  # a resumed run appends; the later record wins
        return out

    la, lb = read(a), read(b)
    want = range(first, last + 1)
    missing = [s for s in want if s not in la or s not in lb]
    print(f"MISSING={','.join(map(str, missing))}")
    if missing:
        print("BITWISE=0\nMAXREL=")
        return
    bitwise = all(la[s] == lb[s] for s in want)
    worst = max(abs(la[s] - lb[s]) / abs(la[s]) for s in want)
    print(f"BITWISE={int(bitwise)}")
    print(f"MAXREL={worst:.3e}")


def syncs(path, skip):
    counts, step, n, enabled = [], 0, 0, False
    for line in open(path, errors="replace"):
        if "LOCKSTEP_CUDA_SYNC_DEBUG=1" in line:
            enabled = True
        if SYNC in line:
            n += 1
            continue
        m = STEP.search(line)
        if m:
            # Warnings since the previous step line belong to this step (and its logging).
            step = int(m.group(1))
            if step > skip:
                counts.append(n)
            n = 0
    print(f"ENABLED={int(enabled)}")
    print(f"SYNCS={fmt(median(counts), 0)}")
    print(f"SYNC_LIST={','.join(map(str, counts))}")


def nan_dump(path):
    import numpy as np
    from safetensors.numpy import load_file

    d = load_file(path)
    bad = sorted((k, int(np.isnan(v).sum())) for k, v in d.items() if np.isnan(v).any())
    print(bad)


def json_field(path, keys):
    last = None
    for line in open(path, errors="replace"):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                last = json.loads(line)
            except ValueError:
                pass
    values = []
    for k in keys:
        v = None if last is None else last.get(k)
        if isinstance(v, (list, dict)):
            v = ",".join(map(str, v)) if isinstance(v, list) else json.dumps(v)
        values.append("" if v is None else str(v))
    print("|".join(values))


def plan_total(path):
    d = json.load(open(path))
    print(f"{d['configured']['total_bytes'] / 1e9:.2f}")


def peak_mib(path):
    vals = [int(x) for x in re.findall(r"\d+", open(path).read())]
    print(max(vals) if vals else "")


def mc_task(text, out, n):
    import random

    rng = random.Random(0)
    lines = [l.split() for l in open(text, errors="replace")]
    lines = [w for w in lines if len(w) >= 8]
    rng.shuffle(lines)
    endings = [" ".join(w[5:]) for w in lines]
    with open(out, "w") as f:
        for i, words in enumerate(lines[:n]):
            others = rng.sample([e for j, e in enumerate(endings) if j != i], 3)
            gold = rng.randrange(4)
            choices = others[:gold] + [endings[i]] + others[gold:]
            f.write(json.dumps({"query": " ".join(words[:5]), "choices": choices, "gold": gold}) + "\n")


def mc_compare(a, b):
    def read(path):
        return [json.loads(l) for l in open(path) if l.strip()]

    sa, sb = read(a), read(b)
    assert len(sa) == len(sb) and sa, f"{a}: {len(sa)} items, {b}: {len(sb)}"
    absd = reld = 0.0
    for x, y in zip(sa, sb):
        for u, v in zip(x["loglikelihoods"], y["loglikelihoods"], strict=True):
            absd = max(absd, abs(u - v))
            reld = max(reld, abs(u - v) / max(abs(u), 1e-30))
    print(f"N={len(sa)}")
    print(f"MAXABS={absd:.3e}")
    print(f"MAXREL={reld:.3e}")
    print(f"SAME={sum(x['pred'] == y['pred'] for x, y in zip(sa, sb))}")
    print(f"SAME_NORM={sum(x['pred_norm'] == y['pred_norm'] for x, y in zip(sa, sb))}")


BINARIES = ("lockstep", "lockstep-unit")
WHEEL = re.compile(r"lockstep-[0-9][0-9A-Za-z.]*-py3-none-[0-9A-Za-z_.]+\.whl")


def unpack(carry, dest):
    # Python's tarfile rather than `tar -xJ`: the GPU machine's python is certain, its xz is not.
    # Only known names are read (the two binaries, a wheel's plain file name), so nothing in the
    # archive writes elsewhere.
    with tarfile.open(os.path.join(carry, "binaries.tar.xz"), "r:xz") as tar:
        wheels = [n for n in tar.getnames() if WHEEL.fullmatch(n)]
        for name in BINARIES + tuple(wheels):
            src = tar.extractfile(tar.getmember(name))
            digest = hashlib.sha256()
            path = os.path.join(dest, name)
            with open(path, "wb") as out:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
            os.chmod(path, 0o644 if name in wheels else 0o755)
            want = open(os.path.join(carry, name + ".sha256")).read().strip()
            if digest.hexdigest() != want:
                sys.exit(f"{name}: sha256 {digest.hexdigest()} but prepare.sh recorded {want}")


def main(argv):
    cmd, rest = argv[1], argv[2:]
    skip = 0
    if "--skip" in rest:
        i = rest.index("--skip")
        skip = int(rest[i + 1])
        rest = rest[:i] + rest[i + 2:]
    if cmd == "build-match":
        build_match(rest[0])
    elif cmd == "steplines":
        steplines(rest[0], skip)
    elif cmd == "losses":
        losses(rest[0], rest[1], int(rest[2]), int(rest[3]))
    elif cmd == "syncs":
        syncs(rest[0], skip)
    elif cmd == "nan-dump":
        nan_dump(rest[0])
    elif cmd == "json-field":
        json_field(rest[0], rest[1:])
    elif cmd == "plan-total":
        plan_total(rest[0])
    elif cmd == "peak-mib":
        peak_mib(rest[0])
    elif cmd == "mc-task":
        mc_task(rest[0], rest[1], int(rest[2]))
    elif cmd == "mc-compare":
        mc_compare(rest[0], rest[1])
    elif cmd == "unpack":
        unpack(rest[0], rest[1])
    else:
        sys.exit(f"unknown subcommand {cmd}")


if __name__ == "__main__":
    main(sys.argv)

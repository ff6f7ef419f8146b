"""lm-evaluation-harness 0.4 itself on a local multiple-choice task (tests/downstream_eval.rs).

usage: lm_eval_mc.py OUT.json TASK_DIR MAX_LENGTH MODEL_DIR...

Scores the task `lockstep_mc` (its YAML in TASK_DIR) with lm-eval's Hugging Face backend for
every model directory, in one process (lm-eval takes most of a minute to import), and writes
{model: {"results": {...}, "samples": [{"doc_id", "lls", "acc", "acc_norm"}]}} to OUT.json.
"""

import json
import sys

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

out_path, task_dir, max_length, *models = sys.argv[1:]
tasks = TaskManager(include_path=task_dir)
out = {}
for model in models:
    r = simple_evaluate(
        model="hf",
        model_args=f"pretrained={model},dtype=float32,max_length={max_length}",
        tasks=["lockstep_mc"],
        device="cpu",
        batch_size=8,
        log_samples=True,
        task_manager=tasks,
    )
    samples = [
        {
            "doc_id": s["doc_id"],
            "lls": [float(resp[0]) for resp in s["filtered_resps"]],
            "acc": s["acc"],
            "acc_norm": s["acc_norm"],
        }
        for s in r["samples"]["lockstep_mc"]
    ]
    out[model] = {"results": r["results"]["lockstep_mc"], "samples": samples}
with open(out_path, "w") as f:
    json.dump(out, f)

"""lm-evaluation-harness's side of benches/downstream_cpu.sh: the seconds lm-eval 0.4 (HF
backend, fp32, CPU) takes to score a local multiple-choice task, the model already loaded (its
import and the model's load are not counted; building the task's requests and scoring are).

usage: lm_eval_time.py MODEL_DIR TASK_DIR MAX_LENGTH BATCH ROUNDS
Prints one line per round: `seconds acc acc_norm`.
"""

import sys
import time

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

model_dir, task_dir, max_length, batch, rounds = sys.argv[1:]
lm = HFLM(pretrained=model_dir, dtype="float32", max_length=int(max_length),
          batch_size=int(batch), device="cpu")
tasks = TaskManager(include_path=task_dir, verbosity="ERROR")
for _ in range(int(rounds)):
    t0 = time.perf_counter()
    r = lm_eval.simple_evaluate(model=lm, tasks=["bench_mc"], task_manager=tasks,
                                log_samples=False, bootstrap_iters=0, verbosity="ERROR")
    dt = time.perf_counter() - t0
    res = r["results"]["bench_mc"]
    print(f"{dt:.3f} {res['acc,none']} {res['acc_norm,none']}", flush=True)

#!/usr/bin/env bash
# `recipe launch` on one GPU, end to end: the plan of the 4-layer Qwen3.5-35B-A3B shape at world size 1, one packed
# sequence of SEQ tokens (the shape bench/bench_train_step.py times), 20 steps with checkpoints every 10 (every 20
# when the disk holds only one: a checkpoint of this model is ~53 GB of fp32 masters and moments), then a resume of 2
# more steps from the last checkpoint. Writes plan.yaml, launch.log, resume.log and metrics.jsonl under $OUT.
#
#   OUT=out bash bench/launch_h200.sh                                   # on the GPU machine
#   OUT=/tmp/o MODEL=tiny-moe SEQ=4096 HW=cpu STEPS=4 CK_GB=1 VOCAB=500 EXTRA="--dtype fp32" bash bench/launch_h200.sh
set -u
MODEL=${MODEL:-qwen35-35b}; LAYERS=${LAYERS:-4}; SEQ=${SEQ:-32768}; HW=${HW:-h200}; EXTRA=${EXTRA:-}
python3 -m recipe solve --model $MODEL --layers $LAYERS --seq $SEQ --hw $HW --gpus 1 -o $OUT/plan.yaml > $OUT/solve.txt; head -3 $OUT/solve.txt
python3 - <<PY
import json, random
rng = random.Random(0); n = $SEQ
ids = [rng.randrange(${VOCAB:-100000}) for _ in range(n)]
open("/tmp/long.jsonl", "w").write(json.dumps({"input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2), "advantages": 0.5}) + "\n")
PY
df -h /tmp /dev/shm $PWD 2>/dev/null
FREE=$(df --output=avail -B1G /tmp | tail -1); echo "free GB on /tmp: $FREE"
CK=${CK_GB:-53}
if [ -z "${EVERY:-}" ]; then if [ $FREE -ge $((2 * CK + 4)) ]; then EVERY=10; else EVERY=20; fi; fi
echo "checkpoint every $EVERY"
rm -rf /tmp/run
/usr/bin/time -f "launch wall %e s" python3 -m recipe launch $OUT/plan.yaml --steps ${STEPS:-20} --checkpoint-every $EVERY --data /tmp/long.jsonl --out /tmp/run --lr 1e-6 $EXTRA > $OUT/launch.log 2>&1; echo "launch rc $?"
grep -v "^step\|Warn" $OUT/launch.log | tail -12; cp /tmp/run/metrics.jsonl $OUT/ 2>/dev/null; du -sh /tmp/run/checkpoints/* 2>/dev/null
FREE=$(df --output=avail -B1G /tmp | tail -1)
[ $FREE -ge $((CK + 2)) ] || { echo "no room for another checkpoint ($FREE GB free): resume not run"; exit 0; }
/usr/bin/time -f "resume wall %e s" python3 -m recipe launch $OUT/plan.yaml --steps $(( ${STEPS:-20} + 2 )) --checkpoint-every 1000 --data /tmp/long.jsonl --out /tmp/run --lr 1e-6 --resume $EXTRA > $OUT/resume.log 2>&1; echo "resume rc $?"
grep -v "Warn" $OUT/resume.log | tail -6

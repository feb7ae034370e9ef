#!/usr/bin/env bash
# The whole model once, end to end through `recipe launch` on one host of GPUS GPUs: the plan `recipe solve` gives
# for each sequence length, Hugging Face weights initialized and saved by a one-step run's --export (no weights can
# be downloaded), then STEPS steps at each length started from those weights, each rank's micro-batch one packed
# sequence of the plan's length. Writes under $OUT, per length: plan_SEQ.yaml, solve_SEQ.txt, launch_SEQ.log (its
# last lines: the measured-against-predicted summary) and metrics_SEQ.jsonl; and init.log.
#
#   OUT=out GPUS=8 bash bench/whole_model.sh                        # qwen35-35b (40 layers), 64K and 128K, h200
#   OUT=out GPUS=1 LAYERS=4 SEQS="32k 64k" STEPS=4 bash bench/whole_model.sh   # full width, 4 layers, one GPU
#   OUT=/tmp/o MODEL=tiny-moe HW=cpu GPUS=2 SEQS="1k 2k" STEPS=2 bash bench/whole_model.sh     # smoke, CPU
set -u
MODEL=${MODEL:-qwen35-35b}; HW=${HW:-h200}; GPUS=${GPUS:-8}; SEQS=${SEQS:-"64k 128k"}; STEPS=${STEPS:-12}
WORK=${WORK:-/tmp/whole_model}; LR=${LR:-1e-6}; LAYERS=${LAYERS:+--layers $LAYERS}
mkdir -p "$OUT"; rm -rf "$WORK"; mkdir -p "$WORK"
for SEQ in $SEQS; do
  python3 -m recipe solve --model $MODEL $LAYERS --seq $SEQ --hw $HW --gpus $GPUS -o "$OUT/plan_$SEQ.yaml" \
    > "$OUT/solve_$SEQ.txt" 2>&1 || { cat "$OUT/solve_$SEQ.txt"; exit 1; }
  head -3 "$OUT/solve_$SEQ.txt"
  # rollouts: data-parallel ranks x micro-batches of them, each one sequence of the plan's micro-batch length
  python3 - "$OUT/plan_$SEQ.yaml" "$WORK/data_$SEQ.jsonl" <<'PY'
import json, random, sys
from recipe.plan import load_plan
plan = load_plan(sys.argv[1])
n, count = plan.train.micro_batch_tokens, plan.layout.dp * plan.train.micro_batches
vocab = plan.model_shape().vocab_size
rng = random.Random(0)
with open(sys.argv[2], "w") as f:
    for _ in range(count):
        ids = [rng.randrange(vocab) for _ in range(n)]
        f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2),
                            "advantages": rng.choice([-1.0, 1.0])}) + "\n")
print(f"{count} rollouts of {n:,} tokens")
PY
done
FIRST=${SEQS%% *}
# the starting weights: one step from the seeded random init, exported as Hugging Face safetensors (no DCP
# checkpoint anywhere: one of the whole model's is 416 GB, more than the host's disk)
python3 -m recipe launch "$OUT/plan_$FIRST.yaml" --steps 1 --data "$WORK/data_$FIRST.jsonl" --lr 1e-12 \
  --no-checkpoint --out "$WORK/init" --export "$WORK/hf" > "$OUT/init.log" 2>&1; echo "init rc $?"; tail -3 "$OUT/init.log"
[ -e "$WORK/hf/config.json" ] || { echo "no checkpoint was exported: see $OUT/init.log"; exit 1; }
du -sh "$WORK/hf"
for SEQ in $SEQS; do
  /usr/bin/time -f "launch wall %e s" python3 -m recipe launch "$OUT/plan_$SEQ.yaml" --steps $STEPS \
    --data "$WORK/data_$SEQ.jsonl" --hf-checkpoint "$WORK/hf" --out "$WORK/run_$SEQ" --lr $LR --no-checkpoint \
    > "$OUT/launch_$SEQ.log" 2>&1; echo "$SEQ: launch rc $?"
  cp "$WORK/run_$SEQ/metrics.jsonl" "$OUT/metrics_$SEQ.jsonl" 2>/dev/null
  grep -v "^step\|Warn" "$OUT/launch_$SEQ.log" | tail -8
done

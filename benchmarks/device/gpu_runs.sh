#!/usr/bin/env bash
# Third call on the same warm GPU machine, carrying .devdata_c (see benchmarks/device/README.md): rebuild CIFAR-10
# from the three WebP parts (hash-checked), then run the jobs of $JOBS ("benchmark:method:seed" separated by spaces) side by side on
# the one GPU, each a `benchmarks/reproduce.py` process with its own records folder, each stopped after $LIMIT
# seconds, its run folder under /tmp/work/<job> (COMPILE=reduce-overhead: train.compile, the compiled step;
# DETERMINISTIC=1: reproduce.py --deterministic, deterministic CUDA kernels; VALIDATION=0.1: every job on
# the validation split, for choosing, never the test set; a job "benchmark:method:seed:0.1" is on the validation
# split alone, and "benchmark:method:seed:test" on the test set whatever VALIDATION says; SCRATCH: the scratch
# folder, /tmp; POLL: seconds between progress lines, 20). The records and logs come back as $OUT/records.tgz and
# $OUT/logs.tgz; logs.tgz also holds each run folder without its checkpoints (the per-epoch log), so that a run
# stopped by the limit shows how far it got. Bring the records in with benchmarks/device/import_records.py.
# Needs CONTINUAL_BLR_COMMIT (the commit the working tree was sent from; a copied .git may be an older checkout's).
S=${SCRATCH:-/tmp}  # the machine's scratch folder (a test points it elsewhere)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CONTINUAL_BLR_DATA=$S/data CONTINUAL_BLR_DIRTY=${CONTINUAL_BLR_DIRTY:-0}
LIMIT=${LIMIT:-420}
python3 benchmarks/device/cifar10_webp.py unpack --parts $S/devdata_a $S/devdata_b .devdata_c --root $S/data || exit 3
mkdir -p $S/rec $S/logs
for job in $JOBS; do
  IFS=: read -r bench method seed split <<< "$job"
  val=${split:-$VALIDATION}; [ "$val" = test ] && val=
  tag=$(echo "$bench-$method-$seed${val:+-val$val}" | tr / _)
  timeout "$LIMIT" python3 benchmarks/reproduce.py "$bench" --methods "$method" --seeds "$seed" --device cuda \
    --threads 1 --work-dir $S/work/"$tag" ${COMPILE:+--compile $COMPILE} ${DETERMINISTIC:+--deterministic} ${val:+--validation $val} --runs-dir $S/rec/"$tag" --results-dir $S/rec/"$tag"/results \
    > $S/logs/"$tag".log 2>&1 &
done
start=$SECONDS
while [ -n "$(jobs -r)" ]; do
  sleep "${POLL:-20}"; echo "t=$((SECONDS - start))s running=$(jobs -r | wc -l) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
done
wait
find $S/rec -name "*.json" | sort
mkdir -p $S/work; cp -r $S/work $S/logs/work 2>/dev/null; find $S/logs/work -name "*.pt" -delete
tar czf "$OUT/records.tgz" -C $S/rec . ; tar czf "$OUT/logs.tgz" -C $S/logs .
grep -h -i -E "error|Traceback" $S/logs/*.log | head -20

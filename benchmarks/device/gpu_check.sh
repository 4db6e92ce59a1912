#!/usr/bin/env bash
# First call on a lent GPU machine (see benchmarks/device/README.md): the CUDA tests, the training-step speed on
# the GPU, and whether this image can decode the lossless WebP parts of CIFAR-10. Writes under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# the parts of CIFAR-10 carried in this call (.devdata_a, .devdata_b) are kept outside the tree: a later call that
# carries another part removes them. STAGE_ONLY=1: copy the part and stop (the second call, carrying .devdata_b).
for part in .devdata_a .devdata_b; do
  if [ -d $part ]; then mkdir -p /tmp/${part#.} && cp $part/* /tmp/${part#.}/ && echo "staged $part"; fi
done
[ -n "$STAGE_ONLY" ] && exit 0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, PIL, PIL.features as f; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), 'pillow', PIL.__version__, 'webp', f.check('webp'))"
nproc
python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/test_cuda.log" | tail -15
python3 benchmarks/perf/perf_train.py --device cuda --compile --steps 30 --warmup 10 --out "$OUT/perf_train_cuda.md" 2>/dev/null | grep -E "^\||^\*|^Target"
# where a step's time goes (kernels, launches, synchronisation): $OUT/profile.md
timeout 120 python3 benchmarks/perf/profile_train_cuda.py --out "$OUT" 2>/dev/null | grep -E "^##|^wall"
# FROMP's step at task 5 with the separate passes or one fused pass (fused_forward; dropout and BatchNorm split by rows):
# is the one pass worth it where a step is launch-bound? (issue 43 item 6; on the AMX CPU it is slower)
for arch in cifarnet reduced_resnet18; do
  timeout 150 python3 benchmarks/perf/perf_fromp_fused_device.py --device cuda --arch $arch \
    --out "$OUT/perf_fromp_fused_cuda_$arch.md" 2>/dev/null | grep -E "^\||^The fused"
done

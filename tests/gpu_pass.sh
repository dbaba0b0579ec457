#!/usr/bin/env bash
# The GPU pass, on a machine with one or more GPUs: tests/test_gpu.py (every case its GPUs
# allow), `python main.py` with its defaults, and GPT-2 124M in bench/bench.py (bf16,
# compiled, with a profile of where the GPU time goes). Every log and result goes to one
# folder; each step has its own time limit, so the script ends with whatever finished.
#
#     tests/gpu_pass.sh OUT_DIR            # from the repository's root
#     tests/gpu_pass.sh OUT_DIR bench      # the benchmark alone
#     tests/gpu_pass.sh OUT_DIR tests      # the tests and main.py, no benchmark
#
# PYTHON picks the interpreter (default python3). The benchmark reads random token ids
# (throughput does not depend on the text), written here into 05_mingpt/data/synth_bpe.
set -u
out=$(mkdir -p "${1:?usage: tests/gpu_pass.sh OUT_DIR [bench|tests]}" && cd "$1" && pwd)
only=${2:-}
py=${PYTHON:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1
start=$SECONDS
say() { echo "[gpu_pass $((SECONDS - start)) s] $*" | tee -a "$out/summary.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  lscpu | grep -m1 "Model name"; nproc; } > "$out/machine.txt" 2>&1
say "machine: $(tr '\n' ' ' < "$out/machine.txt")"

if [ "$only" != bench ]; then
# 1 and 2 side by side (neither is timed): the GPU tests, spread over 4 workers (--dist load:
# the file's cases in parallel, not one worker per file), and the Quickstart's training run.
(cd "$repo" && timeout 240 "$py" -m pytest -p no:cacheprovider tests/test_gpu.py -n 4 \
    --dist load -rA --junitxml="$out/test_gpu.xml") > "$out/test_gpu.log" 2>&1 &
tests=$!
(cd "$repo/05_mingpt" && timeout 240 "$py" main.py run_name=gpu_pass) > "$out/main.log" 2>&1
say "python main.py: exit $? | $(grep -E "step [0-9]+ \| val loss" "$out/main.log" | tail -1)"
wait $tests
say "tests/test_gpu.py: exit $? | $(tail -1 "$out/test_gpu.log")"
fi
[ "$only" = tests ] && exit 0

# 3. GPT-2 124M: block 1024, bf16, compiled, fused AdamW, the trainer beside the bare loop.
cd "$repo/05_mingpt" || exit 1
"$py" - <<'EOF'
import json, os
import numpy as np
rng = np.random.default_rng(0)
for name, vocab in (("synth_bpe", 50257), ("synth_bpe_50304", 50304)):
    os.makedirs(f"data/{name}", exist_ok=True)
    counts = {"train": 8 * 2**20, "val": 2**20}
    for split, n in counts.items():  # ids GPT-2's tokenizer has, whatever the model's vocab
        rng.integers(0, 50257, n, dtype=np.uint16).tofile(f"data/{name}/{split}.bin")
    meta = {"tokenizer": "gpt2", "tokenizer_sha": "random-ids", "eot": 50256,
            "vocab_size": vocab, "train_tokens": counts["train"], "val_tokens": counts["val"]}
    json.dump(meta, open(f"data/{name}/meta.json", "w"))
EOF
gpt2=(--runs ddp:1 --preset gpt2 --precision bf16 --compile --block_size 1024 --batch_size 16
      --steps 50 --warmup 15 --rounds 1 --profile 5)
timeout 200 "$py" bench/bench.py "${gpt2[@]}" --out "$out/gpu_gpt2" \
    -- data_config=bpe data_config.path=data/synth_bpe > "$out/bench.log" 2>&1
say "bench gpt2: exit $? | $(grep -E "ms/step|profile|bare loop|waiting" "$out/bench.log" \
    | tr '\n' ' ')"
# The same with the vocabulary padded to a multiple of 64 (the output layer's matmul shape).
timeout 150 "$py" bench/bench.py "${gpt2[@]}" --out "$out/gpu_gpt2_50304" \
    -- data_config=bpe data_config.path=data/synth_bpe_50304 > "$out/bench_50304.log" 2>&1
say "bench gpt2, vocab 50304: exit $? | $(grep -E "ms/step|profile|waiting" "$out/bench_50304.log" \
    | tr '\n' ' ')"

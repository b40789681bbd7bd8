#!/usr/bin/env bash
# End-to-end checks of the kiln runner: exit codes, error messages naming file:line:column, the
# config round trip, plugins, the topology view and a short training run.
# usage: cli_test.sh KILN SOURCE_DIR PLUGIN_LIB
set -u
KILN=$1
SRC=$2
PLUGIN=$3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# expect RC PATTERN -- command...: runs the command, checks its exit code and that its output matches.
expect() {
  local want_rc=$1 pattern=$2
  shift 3
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [ "$rc" != "$want_rc" ]; then fail "'$*' exited $rc, expected $want_rc. Output:"$'\n'"$out"; return; fi
  if ! grep -qF -- "$pattern" <<<"$out"; then fail "'$*' output lacks '$pattern'. Output:"$'\n'"$out"; fi
}

cd "$TMP"
mkdir data
printf 'the cat sat on the mat.\nthe dog ran to a tree.\n%.0s' $(seq 1 400) > corpus.txt
expect 0 "validation tokens" -- "$KILN" tokenize corpus.txt -o data/tiny --val-fraction 0.2

cat > tiny.toml <<TOML
[engine]
device = "cpu"
[train]
steps = 5
batch_size = 4
seq_len = 16
[model]
n_layer = 1
n_head = 2
n_embd = 16
vocab_size = 256
max_seq_len = 16
[optim]
[data]
train_files = "data/tiny/train_*.bin"
val_files = "data/tiny/val_*.bin"
val_batches = 2
[log]
every = 1
val_every = 5
metrics = "metrics.jsonl"
TOML

# A short training run, its step lines and its metrics file.
expect 0 "step 5/5" -- "$KILN" run tiny.toml
expect 0 "| val " -- "$KILN" run tiny.toml
[ "$(wc -l < metrics.jsonl)" = 5 ] || fail "metrics.jsonl has $(wc -l < metrics.jsonl) lines, expected 5"
grep -q '"val_loss"' metrics.jsonl || fail "metrics.jsonl has no val_loss"
expect 0 "wrote loss.svg (2 series)" -- "$KILN" plot metrics.jsonl=first metrics.jsonl=again -o loss.svg --smooth 2
grep -q "<polyline" loss.svg || fail "loss.svg has no curve"
expect 0 "wrote val.svg" -- "$KILN" plot metrics.jsonl --y val_loss -o val.svg
expect 1 "no row has both 'step' and 'nothing'" -- "$KILN" plot metrics.jsonl --y nothing -o x.svg
for key in step loss lr grad_norm tokens_per_s step_ms; do
  grep -q "\"$key\":" metrics.jsonl || fail "metrics.jsonl lacks $key"
done

# The effective config prints as TOML that reads back to the same text.
"$KILN" config "$SRC/pipelines/tiny-cpu.toml" > a.toml || fail "kiln config tiny-cpu.toml"
"$KILN" config a.toml > b.toml || fail "kiln config a.toml"
cmp -s a.toml b.toml || fail "kiln config output does not round trip: $(diff a.toml b.toml | head)"
grep -q '^# number of\|^# optimizer steps to run' a.toml || fail "kiln config prints no docs"
expect 0 "steps = 7" -- "$KILN" config "$SRC/pipelines/tiny-cpu.toml" --set train.steps=7
# Every shipped pipeline resolves, and its effective config round trips.
for p in "$SRC"/pipelines/*.toml; do
  "$KILN" config "$p" > p.toml 2> err.txt || fail "kiln config $p: $(cat err.txt)"
  "$KILN" config p.toml > q.toml 2> err.txt || fail "kiln config of $p's effective config: $(cat err.txt)"
  cmp -s p.toml q.toml || fail "$p's effective config does not round trip: $(diff p.toml q.toml | head)"
done
# The tiny Llama trains on one rank and, with tensor parallelism over its key/value heads, on two,
# printing the same losses (synthetic tokens: no corpus needed).
llama=("$SRC/pipelines/llama-tiny-cpu.toml" --set data.synthetic_vocab=256 --set 'data.val_files=""' --set log.val_every=0
       --set train.steps=12 --set log.every=4)
"$KILN" run "${llama[@]}" > llama1.txt 2>&1 || fail "llama-tiny-cpu on one rank: $(tail -5 llama1.txt)"
"$KILN" run "${llama[@]}" --nproc 2 --set parallel.tp=2 > llama2.txt 2>&1 || fail "llama-tiny-cpu tp=2: $(tail -5 llama2.txt)"
l1=$(grep -oE "^step +12/12 \| loss [0-9.]+" llama1.txt)
l2=$(grep -oE "^(\[rank 0\] )?step +12/12 \| loss [0-9.]+" llama2.txt | sed 's/^\[rank 0\] //')
[ -n "$l1" ] && [ "$l1" = "$l2" ] || fail "llama-tiny-cpu: one rank '$l1', tp=2 '$l2'"
# ... and samples text through the KV-cached generator (RoPE written into the cache, grouped heads).
"$KILN" run "${llama[@]}" --set log.sample_every=12 --set log.sample_tokens=16 > llama-sample.txt 2>&1 ||
  fail "llama-tiny-cpu with samples: $(tail -5 llama-sample.txt)"
grep -q "^sample (step 12): " llama-sample.txt || fail "llama-tiny-cpu printed no sample: $(tail -5 llama-sample.txt)"
expect 2 "model.n_kv_head: 2 key/value heads do not split over the 4 ranks" -- \
  "$KILN" run "${llama[@]}" --nproc 4 --set parallel.tp=4
# The tiny mixture of experts trains on one rank and with its experts split over 2 expert-parallel
# ranks (x 2 data-parallel), to the same losses; an expert-parallel size that does not divide the
# data-parallel ranks is a config error naming parallel.ep.
moe=("$SRC/pipelines/moe-tiny-cpu.toml" --set data.synthetic_vocab=256 --set 'data.val_files=""' --set log.val_every=0
     --set train.steps=12 --set log.every=4 --set log.metrics=moe.jsonl)
"$KILN" run "${moe[@]}" > moe1.txt 2>&1 || fail "moe-tiny-cpu on one rank: $(tail -5 moe1.txt)"
grep -q "parameters (.* active per token)" moe1.txt || fail "moe-tiny-cpu prints no active parameters: $(head -5 moe1.txt)"
grep -q '"blocks.0.mlp.tokens_cv":' moe.jsonl || fail "moe.jsonl has no expert load"
grep -q '"moe.aux_loss":' moe.jsonl || fail "moe.jsonl has no aux loss"
"$KILN" run "${moe[@]}" --nproc 4 --set parallel.ep=2 > moe4.txt 2>&1 || fail "moe-tiny-cpu ep=2: $(tail -5 moe4.txt)"
m1=$(grep -oE "^step +12/12 \| loss [0-9.]+" moe1.txt | grep -oE "[0-9.]+$")
m4=$(grep -oE "^(\[rank 0\] )?step +12/12 \| loss [0-9.]+" moe4.txt | grep -oE "[0-9.]+$")
awk -v a="$m1" -v b="$m4" 'BEGIN { d = a - b; if (a == "" || b == "" || d > 2e-4 || d < -2e-4) exit 1 }' ||
  fail "moe-tiny-cpu: one rank loss '$m1', ep=2 on 4 ranks '$m4'"
expect 2 "parallel.ep: 3 does not divide the 4 data-parallel ranks" -- "$KILN" run "${moe[@]}" --nproc 4 --set parallel.ep=3
expect 0 "(4 series)" -- "$KILN" plot moe.jsonl --y 'blocks.*.mlp.tokens_min' --y 'blocks.*.mlp.tokens_max' -o moe-load.svg
grep -q "<polyline" moe-load.svg || fail "moe-load.svg has no curve"

# Every config error: exit code 2, the file:line:column (or the --set) and the key named.
printf '[train]\nstpes = 3\n' > unknown.toml
expect 2 "unknown.toml:2:1: unknown key 'stpes' in [train]; did you mean 'steps'?" -- "$KILN" config unknown.toml
printf '[trian]\n' > section.toml
expect 2 "section.toml:1:2: unknown section [trian]; did you mean [train]?" -- "$KILN" config section.toml
printf '[train]\nsteps = "ten"\n' > type.toml
expect 2 "type.toml:2:1: train.steps: expected an integer, got string \"ten\"" -- "$KILN" config type.toml
printf '[engine]\ndevice = "gpu"\n' > enum.toml
expect 2 "enum.toml:2:1: engine.device: 'gpu' is not one of: auto, cuda, cpu" -- "$KILN" config enum.toml
printf '[train]\nsteps = -3\n' > invalid.toml
expect 2 "invalid.toml:2:1: train.steps: must be >= 0" -- "$KILN" config invalid.toml
printf '[train]\nsteps = \n' > syntax.toml
expect 2 "syntax.toml:2:" -- "$KILN" config syntax.toml
expect 2 "nope.toml: pipeline file not found" -- "$KILN" config nope.toml
expect 2 "expected section.key=value" -- "$KILN" config tiny.toml --set train.steps
expect 2 "--set train.steps=x: train.steps: 'x' is not a valid value" -- "$KILN" run tiny.toml --set train.steps=x
expect 2 "tiny.toml:6:1: train.seq_len: 16 exceeds model.max_seq_len = 8" -- "$KILN" run tiny.toml --set model.max_seq_len=8
# Shapes that do not split over the ranks, and parallelisms that do not run yet, name the key and where it was set.
expect 2 "--set parallel.pp=3: parallel.pp: splits the blocks into 3 pipeline chunks (parallel.pp = 3), but the model has 2 (model.n_layer): each chunk needs at least one block" -- \
  "$KILN" run tiny.toml --nproc 3 --set parallel.pp=3 --set model.n_layer=2
# Pipeline stages train: two stages of one block each.
expect 0 "step 5/5" -- "$KILN" run tiny.toml --nproc 2 --set parallel.pp=2 --set model.n_layer=2 --set train.micro_batch_size=1
{ cat tiny.toml; printf '[parallel]\ncp = 2\n'; } > cp.toml
expect 2 "cp.toml:$(( $(wc -l < tiny.toml) + 2 )):1: parallel.cp: is 2, but context parallelism does not run yet" -- \
  "$KILN" run cp.toml --nproc 2
expect 2 "tiny.toml:9:1: model.n_head: 2 attention heads do not split over the 3 ranks" -- "$KILN" run tiny.toml --nproc 3 --set parallel.tp=3
expect 2 "--set fsdp.shard_size=3: fsdp.shard_size: 3 does not divide the 4 data-parallel ranks" -- \
  "$KILN" run tiny.toml --nproc 4 --set fsdp.strategy=hybrid_shard --set fsdp.shard_size=3
# FSDP trains, each rank saying what it holds.
expect 0 "fsdp rank 1 holds 1/2" -- "$KILN" run tiny.toml --nproc 2 --set fsdp.strategy=full_shard --set train.steps=2
printf '[engine]\n' > notrain.toml
expect 2 "needs a [train] section" -- "$KILN" run notrain.toml

# Data errors name the file (exit code 2, as every bad input).
expect 2 "data.train_files = \"missing/*.bin\": no file matches" -- "$KILN" run tiny.toml --set data.train_files=missing/*.bin
head -c 2000 data/tiny/train_000000.bin > data/tiny/cut.bin
expect 2 "cut.bin: llm.c shard header says" -- "$KILN" run tiny.toml --set data.train_files=data/tiny/cut.bin

# Modules, topology, plugins, help, unknown commands.
expect 0 "[model] the transformer (GPT-2 or Llama blocks)" -- "$KILN" modules
expect 0 "n_layer" -- "$KILN" modules
expect 0 "tp groups: [0,1,2,3] [4,5,6,7]" -- "$KILN" topology tiny.toml --world 8 --set parallel.tp=4
expect 0 "dp groups: [0,4] [1,5] [2,6] [3,7]" -- "$KILN" topology tiny.toml --world 8 --set parallel.tp=4
expect 2 "world size 6 is not divisible by tp*pp*cp = 4*1*1" -- "$KILN" topology tiny.toml --world 6 --set parallel.tp=4
expect 0 "pp groups: [0,4] [1,5] [2,6] [3,7]" -- "$KILN" topology tiny.toml --world 8 --set parallel.tp=4 --set parallel.pp=2
# The pipeline's stages and schedules, and their bubble.
expect 0 "bubble: (pp - 1) / (vpp m + pp - 1) = 1 / 5 = 20.0% of the step" -- \
  "$KILN" topology tiny.toml --world 2 --schedule --set parallel.pp=2 --set model.n_layer=2 --set train.micro_batch_size=1
expect 0 "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3" -- \
  "$KILN" topology tiny.toml --world 2 --schedule --set parallel.pp=2 --set parallel.vpp=2 --set model.n_layer=4 \
  --set train.micro_batch_size=1
cat > plugin.toml <<TOML
[engine]
plugins = ["$PLUGIN"]
[train]
steps = 2
[greeter]
greeting = "hi"
TOML
expect 0 "[greeter]" -- "$KILN" config plugin.toml
expect 0 "done: train.steps reached" -- "$KILN" run plugin.toml
expect 0 "greeter" -- "$KILN" modules --plugin "$PLUGIN"
printf '[engine]\nplugins = ["./libnope.so"]\n[train]\n' > badplugin.toml
expect 2 "badplugin.toml: engine.plugins: cannot load plugin './libnope.so'" -- "$KILN" config badplugin.toml
for cmd in run config modules topology tokenize; do expect 0 "kiln $cmd" -- "$KILN" $cmd --help; done
expect 2 "unknown command 'frobnicate'" -- "$KILN" frobnicate
expect 2 "--world N" -- "$KILN" topology tiny.toml

if [ "$failures" != 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all CLI checks passed"

#!/usr/bin/env bash
# Faults injected into whole `kiln run`s: a token shard truncated or deleted mid-run, a plugin that
# throws while registering or in its install, on one rank and on two thread ranks.
# usage: fault_cli_test.sh KILN FAULT_PLUGIN THROWING_PLUGIN
set -u
KILN=$1
FAULT=$2
THROWING=$3
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
printf 'the cat sat on the mat.\nthe dog ran to a tree.\n%.0s' $(seq 1 400) > corpus.txt
expect 0 "validation tokens" -- "$KILN" tokenize corpus.txt -o data --val-fraction 0.2
shard=data/train_000000.bin
cat > run.toml <<TOML
[engine]
device = "cpu"
plugins = ["$FAULT"]
[train]
steps = 6
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
train_files = "data/train_*.bin"
[log]
every = 1
[fault]
TOML

# A shard cut to its header at step 3: a file error naming it (exit 2), not a SIGBUS.
cp "$shard" keep.bin
expect 2 "train_000000.bin: token shard changed while in use" -- \
  "$KILN" run run.toml --set fault.truncate_file="$shard" --set fault.truncate_at_step=3 --set fault.truncate_to=1024
cp keep.bin "$shard"
expect 2 "train_000000.bin: token shard changed while in use" -- \
  "$KILN" run run.toml --nproc 2 --set fault.truncate_file="$shard" --set fault.truncate_at_step=3 --set fault.truncate_to=1024
cp keep.bin "$shard"
# A shard deleted at step 3: the run goes on with the file it opened and ends normally.
expect 0 "step 6/6" -- "$KILN" run run.toml --set fault.remove_file="$shard" --set fault.remove_at_step=3
[ -e "$shard" ] && fail "the fault plugin did not remove $shard"
cp keep.bin "$shard"

# A module whose install throws: exit 1, naming the module (and the ranks).
expect 1 "installing module 'fault': disk on fire" -- "$KILN" run run.toml --set fault.throw_at_install="disk on fire"
expect 1 "[rank 1] installing module 'fault': disk on fire" -- \
  "$KILN" run run.toml --nproc 2 --set fault.throw_at_install="disk on fire"
# A plugin that throws while registering: a config error naming the file, the key and the library.
expect 2 "run.toml: engine.plugins: plugin '$THROWING': the plugin's registration failed on purpose" -- \
  "$KILN" run run.toml --set "engine.plugins=[\"$THROWING\"]"

if [ "$failures" -gt 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all fault checks passed"

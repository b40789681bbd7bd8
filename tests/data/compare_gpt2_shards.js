// A check by hand, not run by ctest: kiln's GPT-2 token shards (e.g. data/brown-gpt2 from
// scripts/prepare-data.sh) hold the npm gpt-3-encoder's ids for every document, and how fast node
// encodes the same text.
//   node tests/data/compare_gpt2_shards.js .cache/gpt-3-encoder/package data/brown-gpt2/train_000000.bin data/brown-gpt2/val_000000.bin
// The shards are read in order as one stream, cut into documents at <|endoftext|> (50256); each
// document is decoded and encoded again by the npm package, which must give the same ids.
'use strict';
const fs = require('fs');
const path = require('path');
const [dir, ...shards] = process.argv.slice(2);
const { encode, decode } = require(path.resolve(dir, 'Encoder.js'));
let ids = [];
for (const f of shards) {
  const b = fs.readFileSync(f);
  if (b.readInt32LE(0) !== 20240520 || b.readInt32LE(4) !== 1) throw new Error(f + ': not a GPT-2 llm.c shard');
  const n = b.readInt32LE(8);
  for (let i = 0; i < n; ++i) ids.push(b.readUInt16LE(1024 + 2 * i));
}
const docs = [];
let cur = null;
for (const t of ids) {
  if (t === 50256) { if (cur) docs.push(cur); cur = []; } else { if (!cur) throw new Error('the stream does not start with <|endoftext|>'); cur.push(t); }
}
if (cur) docs.push(cur);
const texts = docs.map(d => decode(d));
const start = process.hrtime.bigint();
const again = texts.map(t => encode(t));
const seconds = Number(process.hrtime.bigint() - start) / 1e9;
let bad = 0, tokens = 0, bytes = 0;
for (let i = 0; i < docs.length; ++i) {
  tokens += again[i].length;
  bytes += Buffer.byteLength(texts[i]);
  if (again[i].length !== docs[i].length || again[i].some((t, k) => t !== docs[i][k])) {
    if (++bad <= 3) console.log('document ' + i + ' differs');
  }
}
console.log(`${docs.length} documents, ${tokens} tokens (${ids.length} with separators), ${bad} differ from kiln's`);
console.log(`node ${process.version} gpt-3-encoder: ${seconds.toFixed(3)} s, ${(tokens / seconds).toFixed(0)} tokens/s, ${(bytes / seconds / 1e6).toFixed(2)} MB/s`);
process.exit(bad ? 1 : 0);

// Writes tests/data/fixtures/gpt2_reference.json: texts and the token ids that the npm package
// gpt-3-encoder (a port of OpenAI's GPT-2 encoder.py) gives them. Run once, by hand, after
//   bash scripts/fetch-tokenizers.sh
//   node tests/data/make_gpt2_fixture.js .cache/gpt-3-encoder/package > tests/data/fixtures/gpt2_reference.json
// The C++ test (tests/data/test_bpe.cpp) compares kiln's BPE with these ids; it never runs node.
//
// Left out on purpose: U+0085, U+FEFF and U+180E. The npm package splits words with a JavaScript
// regular expression whose \s differs from Unicode's White_Space (it lacks U+0085 and has U+FEFF),
// which OpenAI's encoder.py, tiktoken and kiln use; test_bpe.cpp checks those characters apart.
'use strict';
const path = require('path');
const dir = process.argv[2];
if (!dir) throw new Error('usage: node make_gpt2_fixture.js DIR_WITH_Encoder.js');
const { encode, decode } = require(path.resolve(dir, 'Encoder.js'));

const sentences = [
  '',
  'Hello world',
  'Hello, world! How are you today?',
  ' leading space',
  'trailing space ',
  '  two leading spaces',
  'many     spaces   between    words',
  'tabs\tand\t\ttabs',
  'line one\nline two\n\nline four\n\n\n',
  '\n\n\nstarts with newlines',
  'windows\r\nline\r\nendings\r\n',
  '   \n   \n\t \n',
  ' ',
  '\n',
  '          ',
  "It's, isn't, they're, we've, I'm, you'll, he'd.",
  "IT'S SHOUTING: DON'T, WE'RE, THEY'VE, I'M, YOU'LL, SHE'D",
  "rock 'n' roll, 'quoted', ''double'' and '''triple'''",
  "the dog's bone and the dogs' bones; o'clock",
  'Numbers: 0 1 12 123 1234 12345 3.14159 -42 +7 1e10 0x1F 1,000,000',
  'Dates 2026-11-23 and times 16:48:05; phone +1 (555) 010-9999',
  'Punctuation!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((())) [[]] {{}} <<>>',
  'a.b,c;d:e!f?g', 'email@example.com https://example.org/path?q=1&r=2#frag',
  'C++ code: for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; }',
  'def f(x):\n    return x ** 2  # square\n',
  'Emoji: 😀 😃 😄 👍🏽 👨‍👩‍👧‍👦 🇩🇪 ❤️ 🔥🔥🔥',
  '中文测试：我们在训练语言模型。这是一个句子，包含标点符号！',
  '日本語のテキストも、ひらがなとカタカナと漢字で書かれています。',
  '한국어 문장도 포함합니다.',
  'العربية: هذا نص باللغة العربية مع أرقام ٠١٢٣٤٥٦٧٨٩.',
  'Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю.',
  'हिन्दी: यह एक वाक्य है जिसमें देवनागरी लिपि है। १२३',
  'Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.',
  'עברית: זה משפט בעברית.',
  'ไทย: นี่คือประโยคภาษาไทย',
  'Accents: café naïve façade résumé Ångström Øresund Straße',
  'Mixed: hello世界 мир123 abcدef',
  'Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = π ≈ 3.14; ½ ¾ ⅓',
  'Fullwidth: ＡＢＣ　１２３　全角スペース',
  'Non-breaking\u00a0space and thin\u2009space and ideographic\u3000space',
  'Line separator\u2028and paragraph separator\u2029end',
  'Zero width\u200bjoiner\u200dnon-joiner\u200c',
  'Combining: e\u0301 a\u0308 n\u0303 (decomposed)',
  'Control chars: \u0001\u0002\u001f\u007f end',
  'Very long word: ' + 'supercalifragilisticexpialidocious'.repeat(5),
  'Repeated: ' + 'ab'.repeat(40) + ' ' + 'aaaa'.repeat(30),
  '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!',
  '0000000000000000000000000000000000000000',
  "<|endoftext|> is ordinary text here",
  'The Fulton County Grand Jury said Friday an investigation of Atlanta\'s recent primary election ' +
      'produced "no evidence" that any irregularities took place.',
];

// Random strings from awkward pieces, with a seeded generator (mulberry32), so the fixture is
// reproducible and covers combinations nobody wrote by hand.
let seed = 20261123;
function rand() {
  seed = (seed + 0x6d2b79f5) | 0;
  let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
  t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const pieces = [
  ' ', '  ', '   ', '\t', '\n', '\n\n', '\r\n', ' \n', '\u00a0', '\u3000', "'", "'s", "'t", "'re", "'ve", "'m",
  "'ll", "'d", "'S", "'LL", 'a', 'the', 'The', ' of', 'ing', 'tion', 'Kiln', 'xyz', 'Q', '0', '7', '42',
  '2026', '.', ',', '!', '?', '-', '--', '...', '"', '(', ')', '$', '%', '&', '/', '\\', '_', '#', '@', '*',
  'é', 'ß', 'Ж', 'ы', 'ش', 'ق', 'क', 'ि', '中', '文', 'の', 'ア', '한', '😀', '👍🏽', '🇺🇸', '½', '²', '٣',
  '१', '\u200b', '\u0301',
];
for (let i = 0; i < 300; ++i) {
  const n = 1 + Math.floor(rand() * 24);
  let s = '';
  for (let j = 0; j < n; ++j) s += pieces[Math.floor(rand() * pieces.length)];
  sentences.push(s);
}

const cases = sentences.map(text => {
  const ids = encode(text);
  if (decode(ids) !== text) throw new Error('the reference does not round trip: ' + JSON.stringify(text));
  return { text, ids };
});
const pkg = require(path.resolve(dir, 'package.json'));
process.stdout.write(JSON.stringify({
  generator: 'tests/data/make_gpt2_fixture.js with npm ' + pkg.name + '@' + pkg.version + ' under node ' +
      process.version,
  cases,
}, null, 0).replace(/\},\{/g, '},\n{') + '\n');

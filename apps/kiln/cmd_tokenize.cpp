#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/data/tokenizer.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_tokenize(const Args& args) {
  po::options_description opts("kiln tokenize TEXT... -o DIR\n\nTokenizes text files byte-level (vocabulary 256) "
                               "into llm.c token shards\nDIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin.\n\noptions");
  std::vector<std::string> inputs;
  std::string out;
  data::TokenizeOptions o;
  opts.add_options()("help,h", "show this help")("output,o", po::value(&out), "output directory")(
      "val-fraction", po::value(&o.val_fraction)->default_value(0.1), "last fraction of the tokens used for validation")(
      "shard-tokens", po::value(&o.shard_tokens)->default_value(100'000'000), "tokens per shard")(
      "strip-pos-tags", po::bool_switch(&o.strip_pos_tags), "input is word/TAG text (e.g. the Brown corpus)")(
      "input", po::value(&inputs)->composing(), "text files");
  po::positional_options_description pos;
  pos.add("input", -1);
  if (!parse_args(args, opts, pos)) return 0;
  if (inputs.empty()) throw po::error("at least one TEXT file is required");
  if (out.empty()) throw po::error("the output directory (-o DIR) is required");
  auto r = data::tokenize_files(inputs, out, o);
  std::cout << "tokenized " << inputs.size() << " file(s): " << r.train_tokens << " train and " << r.val_tokens
            << " validation tokens into " << r.files.size() << " shard(s) in " << out << "\n";
  return 0;
}

}  // namespace kiln::app
